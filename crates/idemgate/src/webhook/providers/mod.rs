//! The providers of SPEC 6: how each one signs a delivery and where it puts the delivery's
//! identifier. One file per family:
//!
//! - [`stripe`]: `Stripe-Signature` and Standard Webhooks, the timestamped schemes;
//! - [`hub`]: GitHub, Shopify (HMAC of the body) and GitLab (a shared token);
//! - [`twilio`]: messaging/voice callbacks and Event Streams (HMAC-SHA1 of the public URL);
//! - [`generic`]: the configurable HMAC of a route's `generic:` block.
//!
//! Every check returns a short reason on refusal, for a debug log; reasons never contain a
//! secret, a signature or an identifier.

pub mod generic;
pub mod hub;
pub mod stripe;
pub mod twilio;

use http::{HeaderMap, Uri};

use super::crypto::Keys;
use crate::config::webhooks::{GenericFile, Provider};

/// Identifiers longer than this are refused as `translation-failed`: every provider's ids are far
/// shorter, and the key must stay within a store key's reasonable size.
pub const MAX_IDENTIFIER_BYTES: usize = 255;

/// One delivery, as the checks see it.
#[derive(Debug)]
pub struct Delivery<'a> {
    pub headers: &'a HeaderMap,
    pub uri: &'a Uri,
    pub body: &'a [u8],
    /// `server.public_base_url` (Twilio signs the URL it called).
    pub public_base_url: Option<&'a str>,
    /// Seconds since the Unix epoch.
    pub now: i64,
    /// `webhooks.signature_tolerance`, in seconds.
    pub tolerance: u64,
}

impl Delivery<'_> {
    /// A header present exactly once, as trimmed text; `None` when absent, repeated or not text.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        let mut values = self.headers.get_all(name).iter();
        let v = values.next()?;
        if values.next().is_some() {
            return None;
        }
        v.to_str().ok().map(str::trim)
    }

    /// Whether the body is declared as a form (`application/x-www-form-urlencoded`).
    #[must_use]
    pub fn is_form(&self) -> bool {
        self.header("content-type").is_some_and(|ct| {
            ct.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/x-www-form-urlencoded"))
        })
    }

    /// The body's form fields, in order.
    #[must_use]
    pub fn form(&self) -> Vec<(String, String)> {
        form_urlencoded::parse(self.body).into_owned().collect()
    }

    /// Whether a signed Unix timestamp is within the tolerance of now, in either direction (a
    /// timestamp from the future is as suspect as a stale one; clocks are assumed in sync to
    /// within the tolerance).
    #[must_use]
    pub fn fresh(&self, timestamp: i64) -> bool {
        self.now.abs_diff(timestamp) <= self.tolerance
    }
}

/// Checks the delivery's signature against the entry's secrets.
///
/// # Errors
/// The reason the delivery is not signed with any of `keys`.
pub fn verify(
    provider: Provider,
    generic: Option<&GenericFile>,
    keys: &Keys<'_>,
    d: &Delivery<'_>,
) -> Result<(), &'static str> {
    match provider {
        Provider::Stripe => stripe::verify_stripe(keys, d),
        Provider::StandardWebhooks => stripe::verify_standard(keys, d),
        Provider::Github => hub::verify_github(keys, d),
        Provider::Shopify => hub::verify_shopify(keys, d),
        Provider::Gitlab => hub::verify_gitlab(keys, d),
        Provider::Twilio | Provider::TwilioEventStreams => twilio::verify(keys, d),
        Provider::Generic => generic.map_or(Err("no generic settings"), |g| generic::verify(g, keys, d)),
    }
}

/// The delivery's own identifier (the raw key is `{provider}-{identifier}`).
///
/// # Errors
/// The reason no usable identifier is in its slot.
pub fn identifier(
    provider: Provider,
    generic: Option<&GenericFile>,
    d: &Delivery<'_>,
) -> Result<String, &'static str> {
    let id = match provider {
        Provider::Stripe => json_string(d.body, "/id"),
        Provider::StandardWebhooks => from_header(d, "webhook-id"),
        Provider::Github => from_header(d, "x-github-delivery"),
        Provider::Shopify => from_header(d, "x-shopify-event-id"),
        Provider::Gitlab => from_header(d, "idempotency-key"),
        Provider::TwilioEventStreams => from_header(d, "i-twilio-idempotency-token"),
        Provider::Twilio => twilio::identifier(d),
        Provider::Generic => generic.map_or(Err("no generic settings"), |g| generic::identifier(g, d)),
    }?;
    if id.is_empty() {
        return Err("the identifier is empty");
    }
    if id.len() > MAX_IDENTIFIER_BYTES {
        return Err("the identifier is too long");
    }
    Ok(id)
}

fn from_header(d: &Delivery<'_>, name: &str) -> Result<String, &'static str> {
    d.header(name)
        .map(str::to_owned)
        .ok_or("the identifier header is missing, repeated or not text")
}

/// A string (or integer) at `pointer` in a JSON body.
fn json_string(body: &[u8], pointer: &str) -> Result<String, &'static str> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|_| "the body is not JSON")?;
    match v.pointer(pointer) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
        Some(_) => Err("the identifier in the body is not a string"),
        None => Err("the body has no identifier"),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A delivery built from literals, for the providers' unit tests.

    use http::{HeaderMap, HeaderName, HeaderValue, Uri};

    use super::Delivery;

    pub struct Owned {
        pub headers: HeaderMap,
        pub uri: Uri,
        pub body: Vec<u8>,
        pub base: Option<String>,
        pub now: i64,
    }

    impl Owned {
        pub fn new(uri: &str, headers: &[(&str, &str)], body: &[u8]) -> Self {
            let mut map = HeaderMap::new();
            for (n, v) in headers {
                map.append(
                    HeaderName::try_from(*n).unwrap(),
                    HeaderValue::try_from(*v).unwrap(),
                );
            }
            Self {
                headers: map,
                uri: uri.parse().unwrap(),
                body: body.to_vec(),
                base: None,
                now: 1_700_000_000,
            }
        }

        pub fn at(mut self, now: i64) -> Self {
            self.now = now;
            self
        }

        pub fn base(mut self, base: &str) -> Self {
            self.base = Some(base.into());
            self
        }

        pub fn delivery(&self) -> Delivery<'_> {
            Delivery {
                headers: &self.headers,
                uri: &self.uri,
                body: &self.body,
                public_base_url: self.base.as_deref(),
                now: self.now,
                tolerance: 300,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::Owned;
    use super::*;

    #[test]
    fn identifiers_come_from_their_slots() {
        let o = Owned::new("/", &[("x-github-delivery", " 72d3162e ")], b"");
        assert_eq!(
            identifier(Provider::Github, None, &o.delivery()).unwrap(),
            "72d3162e"
        );
        let o = Owned::new(
            "/",
            &[("x-github-delivery", "a"), ("x-github-delivery", "b")],
            b"",
        );
        assert!(
            identifier(Provider::Github, None, &o.delivery()).is_err(),
            "repeated"
        );
        let o = Owned::new("/", &[], br#"{"id":"evt_1","object":"event"}"#);
        assert_eq!(
            identifier(Provider::Stripe, None, &o.delivery()).unwrap(),
            "evt_1"
        );
        for body in [
            &br#"{"object":"event"}"#[..],
            br#"{"id":{}}"#,
            b"not json",
            br#"{"id":""}"#,
        ] {
            let o = Owned::new("/", &[], body);
            assert!(identifier(Provider::Stripe, None, &o.delivery()).is_err());
        }
        let long = format!(r#"{{"id":"{}"}}"#, "x".repeat(MAX_IDENTIFIER_BYTES + 1));
        let o = Owned::new("/", &[], long.as_bytes());
        assert!(identifier(Provider::Stripe, None, &o.delivery()).is_err());
        let o = Owned::new("/", &[("i-twilio-idempotency-token", "tok")], b"{}");
        assert_eq!(
            identifier(Provider::TwilioEventStreams, None, &o.delivery()).unwrap(),
            "tok"
        );
        let o = Owned::new(
            "/",
            &[
                ("idempotency-key", "k"),
                ("webhook-id", "msg_1"),
                ("x-shopify-event-id", "e"),
            ],
            b"",
        );
        let d = o.delivery();
        assert_eq!(identifier(Provider::Gitlab, None, &d).unwrap(), "k");
        assert_eq!(identifier(Provider::StandardWebhooks, None, &d).unwrap(), "msg_1");
        assert_eq!(identifier(Provider::Shopify, None, &d).unwrap(), "e");
    }

    #[test]
    fn freshness_is_symmetric() {
        let o = Owned::new("/", &[], b"").at(1000);
        let d = o.delivery();
        assert!(d.fresh(700) && d.fresh(1300));
        assert!(!d.fresh(699) && !d.fresh(1301));
    }
}
