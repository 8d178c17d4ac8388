//! Twilio: `X-Twilio-Signature` is the base64 HMAC-SHA1 (keyed with the auth token) of the URL
//! Twilio called, followed for form callbacks by every POST parameter, sorted by name, as name
//! and value concatenated. JSON deliveries (Event Streams) carry `bodySHA256=<hex>` in the
//! query instead: the URL is signed, and the body must hash to that value.
//!
//! As twilio-python's `RequestValidator` does: the URL is tried without its port and with it
//! (the default port added when none is written), because Twilio is not consistent about it;
//! repeated parameters sign each distinct value in sorted order; an
//! `X-Twilio-Webhooks-Signature-Settings: …,algorithm=HMAC_SHA256` header (shared-key signing)
//! switches to HMAC-SHA256.
//!
//! The URL is `server.public_base_url` + the request's path and query; without it,
//! `http://{Host}` + path and query (only right when nothing in front rewrites the request).

use sha2::{Digest, Sha256};

use super::Delivery;
use crate::config::webhooks::HmacAlgorithm;
use crate::webhook::crypto::{Keys, from_base64};

/// Checks `X-Twilio-Signature` (both `twilio` and `twilio_event_streams`).
///
/// # Errors
/// Missing header or URL, a body that is neither a form nor covered by `bodySHA256`, a body
/// that does not match its hash, or no secret matches either URL form.
pub fn verify(keys: &Keys<'_>, d: &Delivery<'_>) -> Result<(), &'static str> {
    let sig = d
        .header("x-twilio-signature")
        .ok_or("no single X-Twilio-Signature header")?;
    let sig = from_base64(sig).ok_or("not base64")?;
    let alg = algorithm(d.header("x-twilio-webhooks-signature-settings"))?;
    let url = public_url(d).ok_or("no public URL (set server.public_base_url)")?;
    let body_hash = d
        .uri
        .query()
        .and_then(|q| form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == "bodySHA256"))
        .map(|(_, v)| v.into_owned());
    let params = match body_hash {
        Some(expected) => {
            // Not secret: anyone can hash the body, so an ordinary comparison will do.
            if !hex::encode(Sha256::digest(d.body)).eq_ignore_ascii_case(expected.trim()) {
                return Err("the body does not match bodySHA256");
            }
            Vec::new()
        }
        None if d.is_form() => d.form(),
        // Only the URL would be signed: refuse rather than accept any body under it.
        None if !d.body.is_empty() => return Err("a body that is not a form needs bodySHA256"),
        None => Vec::new(),
    };
    let params = sorted_params(params);
    let (without, with) = port_variants(&url).ok_or("the public URL is not absolute")?;
    let without: &[&[u8]] = &[without.as_bytes(), &params];
    let with: &[&[u8]] = &[with.as_bytes(), &params];
    if keys.any_mac_matches(alg, &[without, with], &[sig]) {
        Ok(())
    } else {
        Err("no secret matches")
    }
}

/// Messaging callbacks: `MessageSid-MessageStatus` (`SmsStatus` when `MessageStatus` is absent,
/// as on inbound messages); voice callbacks, which carry no `MessageSid`: `CallSid-CallStatus`.
///
/// # Errors
/// The body is not a form, or lacks both pairs.
pub fn identifier(d: &Delivery<'_>) -> Result<String, &'static str> {
    let form = d.form();
    let field = |name: &str| {
        form.iter()
            .find(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.as_str())
    };
    if let Some(sid) = field("MessageSid") {
        let status = field("MessageStatus")
            .or_else(|| field("SmsStatus"))
            .ok_or("no MessageStatus")?;
        return Ok(format!("{sid}-{status}"));
    }
    match (field("CallSid"), field("CallStatus")) {
        (Some(sid), Some(status)) => Ok(format!("{sid}-{status}")),
        _ => Err("no MessageSid and MessageStatus (or CallSid and CallStatus)"),
    }
}

fn algorithm(settings: Option<&str>) -> Result<HmacAlgorithm, &'static str> {
    let named = settings.and_then(|s| {
        s.split(',').find_map(|part| {
            let (name, value) = part.split_once('=')?;
            (name.trim() == "algorithm" && !value.trim().is_empty()).then(|| value.trim())
        })
    });
    match named.map(str::to_ascii_uppercase).as_deref() {
        None | Some("HMAC_SHA1") => Ok(HmacAlgorithm::Sha1),
        Some("HMAC_SHA256") => Ok(HmacAlgorithm::Sha256),
        Some(_) => Err("unsupported signature algorithm"),
    }
}

/// The URL Twilio called: the configured public base (or `http://{Host}`) + path and query.
#[must_use]
pub fn public_url(d: &Delivery<'_>) -> Option<String> {
    let pq = d
        .uri
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    match d.public_base_url {
        Some(base) => Some(format!("{}{pq}", base.trim_end_matches('/'))),
        None => {
            let host = d.header("host").filter(|h| !h.is_empty())?;
            Some(format!("http://{host}{pq}"))
        }
    }
}

/// `url` without any port, and with its port (the scheme's default when none is written).
fn port_variants(url: &str) -> Option<(String, String)> {
    let (scheme, rest) = url.split_once("://")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority: http::uri::Authority = authority.parse().ok()?;
    let host = authority.host();
    let port = authority
        .port_u16()
        .unwrap_or(if scheme.eq_ignore_ascii_case("https") {
            443
        } else {
            80
        });
    Some((
        format!("{scheme}://{host}{tail}"),
        format!("{scheme}://{host}:{port}{tail}"),
    ))
}

/// Every distinct name, sorted; under each, every distinct value, sorted; as `name value` pairs
/// concatenated.
fn sorted_params(mut params: Vec<(String, String)>) -> Vec<u8> {
    params.sort();
    params.dedup();
    let mut out = Vec::new();
    for (k, v) in params {
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(v.as_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    //! The vectors of twilio-python's `tests/unit/test_request_validator.py`.

    use super::super::testing::Owned;
    use super::*;
    use crate::webhook::crypto::{BASE64, Secret, hmac};
    use base64::Engine as _;

    const TOKEN: &str = "12345";
    const PATH: &str = "/myapp.php?foo=1&bar=2";
    const PARAMS: &str =
        "CallSid=CA1234567890ABCDE&Digits=1234&From=%2B14158675309&To=%2B18005551212&Caller=%2B14158675309";
    const EXPECTED: &str = "RSOYDt4T1cUTdK1PDd93/VVr8B8=";
    const BODY: &str = "{\"property\": \"value\", \"boolean\": true}";
    const BODY_HASH: &str = "0a1ff7634d9ab3b95db5c9a2dfe9416e41502b283a80c7cf19632632f96e6620";

    fn compute(url: &str, form: &str) -> String {
        let params = sorted_params(form_urlencoded::parse(form.as_bytes()).into_owned().collect());
        BASE64.encode(hmac(
            HmacAlgorithm::Sha1,
            TOKEN.as_bytes(),
            &[url.as_bytes(), &params],
        ))
    }

    fn validate(
        base: &str,
        path: &str,
        body: &str,
        content_type: &str,
        sig: &str,
    ) -> Result<(), &'static str> {
        let o = Owned::new(
            path,
            &[("x-twilio-signature", sig), ("content-type", content_type)],
            body.as_bytes(),
        )
        .base(base);
        let secrets = [Secret::new(TOKEN)];
        verify(&Keys::new(&secrets), &o.delivery())
    }

    const FORM: &str = "application/x-www-form-urlencoded";

    #[test]
    fn compute_signature() {
        assert_eq!(compute(&format!("https://mycompany.com{PATH}"), PARAMS), EXPECTED);
    }

    #[test]
    fn compute_signature_with_duplicate_parameters() {
        let form = "Sid=CA123&SidAccount=AC123&Digits=5678&Digits=1234";
        assert_eq!(
            compute(&format!("https://mycompany.com{PATH}"), form),
            "IK+Dwps556ElfBT0I3Rgjkr1wJU="
        );
    }

    #[test]
    fn compute_hash() {
        assert_eq!(hex::encode(Sha256::digest(BODY)), BODY_HASH);
    }

    #[test]
    fn validation() {
        assert_eq!(
            validate("https://mycompany.com", PATH, PARAMS, FORM, EXPECTED),
            Ok(())
        );
        assert!(
            validate("https://mycompany.com", PATH, "CallSid=CA0", FORM, EXPECTED).is_err(),
            "tampered"
        );
        assert!(
            validate("https://other.com", PATH, PARAMS, FORM, EXPECTED).is_err(),
            "another URL"
        );
    }

    #[test]
    fn validation_removes_port_on_https() {
        assert_eq!(
            validate("https://mycompany.com:1234", PATH, PARAMS, FORM, EXPECTED),
            Ok(())
        );
    }

    #[test]
    fn validation_removes_port_on_http() {
        let sig = "Zmvh+3yNM1Phv2jhDCwEM3q5ebU="; // the http URL with port 1234
        assert_eq!(
            validate("http://mycompany.com:1234", PATH, PARAMS, FORM, sig),
            Ok(())
        );
    }

    #[test]
    fn validation_adds_port_on_https() {
        let sig = "kvajT1Ptam85bY51eRf/AJRuM3w="; // the URL with port 443
        assert_eq!(validate("https://mycompany.com", PATH, PARAMS, FORM, sig), Ok(()));
    }

    #[test]
    fn validation_adds_port_on_http() {
        let sig = "0ZXoZLH/DfblKGATFgpif+LLRf4="; // the URL with port 80
        assert_eq!(validate("http://mycompany.com", PATH, PARAMS, FORM, sig), Ok(()));
    }

    #[test]
    fn validation_of_body_succeeds() {
        let path = format!("{PATH}&bodySHA256={BODY_HASH}");
        let sig = "a9nBmqA0ju/hNViExpshrM61xv4=";
        assert_eq!(
            validate("https://mycompany.com", &path, BODY, "application/json", sig),
            Ok(())
        );
        assert_eq!(
            validate("https://mycompany.com", &path, "{}", "application/json", sig),
            Err("the body does not match bodySHA256")
        );
        assert_eq!(
            validate("https://mycompany.com", PATH, BODY, "application/json", EXPECTED),
            Err("a body that is not a form needs bodySHA256")
        );
    }

    #[test]
    fn the_host_header_stands_in_for_a_missing_public_base_url() {
        let url = format!("http://gw.local:8080{PATH}");
        let sig = compute(&url, PARAMS);
        let o = Owned::new(
            PATH,
            &[
                ("x-twilio-signature", &sig),
                ("content-type", FORM),
                ("host", "gw.local:8080"),
            ],
            PARAMS.as_bytes(),
        );
        let secrets = [Secret::new(TOKEN)];
        assert_eq!(verify(&Keys::new(&secrets), &o.delivery()), Ok(()));
    }

    #[test]
    fn shared_key_signatures_use_hmac_sha256() {
        let url = format!("https://mycompany.com{PATH}");
        let params = sorted_params(form_urlencoded::parse(PARAMS.as_bytes()).into_owned().collect());
        let sig = BASE64.encode(hmac(
            HmacAlgorithm::Sha256,
            TOKEN.as_bytes(),
            &[url.as_bytes(), &params],
        ));
        let o = Owned::new(
            PATH,
            &[
                ("x-twilio-signature", &sig),
                ("content-type", FORM),
                (
                    "x-twilio-webhooks-signature-settings",
                    "key=webhooks_sharedkey_1,algorithm=HMAC_SHA256",
                ),
            ],
            PARAMS.as_bytes(),
        )
        .base("https://mycompany.com");
        let secrets = [Secret::new(TOKEN)];
        assert_eq!(verify(&Keys::new(&secrets), &o.delivery()), Ok(()));
        assert_eq!(
            algorithm(Some("algorithm=HMAC_MD5")),
            Err("unsupported signature algorithm")
        );
    }

    #[test]
    fn identifiers() {
        let id = |form: &str| {
            let o = Owned::new("/", &[], form.as_bytes());
            identifier(&o.delivery())
        };
        assert_eq!(
            id("MessageSid=SM1&MessageStatus=delivered").unwrap(),
            "SM1-delivered"
        );
        assert_eq!(id("MessageSid=SM1&SmsStatus=received").unwrap(), "SM1-received");
        assert_eq!(id("CallSid=CA1&CallStatus=completed").unwrap(), "CA1-completed");
        assert!(id("MessageSid=SM1").is_err());
        assert!(id("Body=hi").is_err());
    }
}
