//! The `webhooks:` section, a webhook route's `provider` and `generic` settings, and the
//! registry file's entries, as written. A `generic:` block is checked while it is parsed (its
//! header names, its signed template, exactly one identifier source), so a bad one is a config
//! error at start, never a refusal at the first delivery.

use std::path::PathBuf;

use http::HeaderName;
use serde::Deserialize;

use super::file::Dur;

/// `webhooks:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhooksFile {
    /// A YAML list of [`RegistryEntry`]; re-read when it changes, without a restart.
    pub registry: Option<PathBuf>,
    /// How far a signed timestamp (Stripe `t=`, Standard Webhooks `webhook-timestamp`) may be
    /// from now. Default 300s.
    pub signature_tolerance: Option<Dur>,
}

/// One registered webhook endpoint: an opaque id mapped to its owner and secrets.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryEntry {
    /// `wh_` + 32 hex digits (128 random bits): not enumerable.
    pub id: String,
    pub tenant: String,
    pub project: Option<String>,
    pub provider: Provider,
    /// Environment variables holding the signing secrets; several at once during rotation.
    pub secrets_env: Vec<String>,
}

/// The providers of SPEC 6.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Provider {
    Stripe,
    Github,
    TwilioEventStreams,
    Twilio,
    StandardWebhooks,
    Shopify,
    Gitlab,
    Generic,
}

impl Provider {
    /// Every provider, in a fixed order (for per-provider counters).
    pub const ALL: [Self; 8] = [
        Self::Stripe,
        Self::Github,
        Self::TwilioEventStreams,
        Self::Twilio,
        Self::StandardWebhooks,
        Self::Shopify,
        Self::Gitlab,
        Self::Generic,
    ];

    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stripe => "stripe",
            Self::Github => "github",
            Self::TwilioEventStreams => "twilio_event_streams",
            Self::Twilio => "twilio",
            Self::StandardWebhooks => "standard_webhooks",
            Self::Shopify => "shopify",
            Self::Gitlab => "gitlab",
            Self::Generic => "generic",
        }
    }

    /// The position of `self` in [`Provider::ALL`].
    #[must_use]
    pub fn index(self) -> usize {
        Self::ALL.iter().position(|p| *p == self).unwrap_or(0)
    }
}

/// A `generic` provider's signature and identifier (route key `generic:`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenericFile {
    /// `sha256` (default), `sha1` or `sha512`.
    #[serde(default)]
    pub algorithm: HmacAlgorithm,
    /// The header carrying the signature.
    #[serde(deserialize_with = "header_name")]
    pub header: HeaderName,
    /// `hex` (default) or `base64`.
    #[serde(default)]
    pub encoding: SignatureEncoding,
    /// Stripped from the header value before decoding (e.g. `sha256=`).
    #[serde(default)]
    pub prefix: String,
    /// What is signed: `body` (default), or a template of `{body}`, `{header:Name}` and
    /// literal text, e.g. `"{header:X-Timestamp}.{body}"`.
    #[serde(default)]
    pub signed: SignedTemplate,
    /// Where the delivery's identifier is: exactly one of the three.
    pub identifier: IdentifierFile,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HmacAlgorithm {
    #[default]
    Sha256,
    Sha1,
    Sha512,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SignatureEncoding {
    #[default]
    Hex,
    Base64,
}

/// `identifier:` of a generic provider: exactly one source.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "IdentifierRaw")]
pub enum IdentifierFile {
    /// A header's value.
    Header(HeaderName),
    /// An RFC 6901 pointer into a JSON body, e.g. `/id`; a string or an integer.
    JsonPointer(String),
    /// Form fields joined with `-`, e.g. `[MessageSid, MessageStatus]`; all must be present.
    FormFields(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentifierRaw {
    header: Option<String>,
    json_pointer: Option<String>,
    form_fields: Option<Vec<String>>,
}

impl TryFrom<IdentifierRaw> for IdentifierFile {
    type Error = String;

    fn try_from(raw: IdentifierRaw) -> Result<Self, String> {
        match (raw.header, raw.json_pointer, raw.form_fields) {
            (Some(h), None, None) => HeaderName::try_from(h.as_str())
                .map(Self::Header)
                .map_err(|_| format!("identifier.header: `{h}` is not a header name")),
            (None, Some(p), None) if p.starts_with('/') => Ok(Self::JsonPointer(p)),
            (None, Some(p), None) => Err(format!(
                "identifier.json_pointer: `{p}` is not a JSON pointer (it starts with `/`)"
            )),
            (None, None, Some(f)) if !f.is_empty() && f.iter().all(|n| !n.is_empty()) => {
                Ok(Self::FormFields(f))
            }
            (None, None, Some(_)) => Err("identifier.form_fields: name at least one field".into()),
            _ => Err("identifier: give exactly one of `header`, `json_pointer`, `form_fields`".into()),
        }
    }
}

/// What a generic provider signs, parsed from `signed:`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct SignedTemplate(pub Vec<Segment>);

/// One piece of a [`SignedTemplate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    Literal(String),
    Body,
    /// The value of a header (the delivery is refused when it is missing).
    Header(HeaderName),
}

impl Default for SignedTemplate {
    fn default() -> Self {
        Self(vec![Segment::Body])
    }
}

impl TryFrom<String> for SignedTemplate {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        if text == "body" {
            return Ok(Self::default());
        }
        let mut segments = Vec::new();
        let mut rest = text.as_str();
        while let Some(open) = rest.find('{') {
            if open > 0 {
                segments.push(Segment::Literal(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("signed: `{text}` has an unclosed `{{`"))?
                + open;
            let inner = &rest[open + 1..close];
            segments.push(match inner.strip_prefix("header:") {
                None if inner == "body" => Segment::Body,
                Some(name) => Segment::Header(
                    HeaderName::try_from(name)
                        .map_err(|_| format!("signed: `{name}` is not a header name"))?,
                ),
                None => {
                    return Err(format!(
                        "signed: `{{{inner}}}` is neither `{{body}}` nor `{{header:Name}}`"
                    ));
                }
            });
            rest = &rest[close + 1..];
        }
        if rest.contains('}') {
            return Err(format!("signed: `{text}` has a `}}` without its `{{`"));
        }
        if !rest.is_empty() {
            segments.push(Segment::Literal(rest.to_owned()));
        }
        if segments.is_empty() {
            return Err("signed: the template is empty".into());
        }
        Ok(Self(segments))
    }
}

fn header_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<HeaderName, D::Error> {
    let s = String::deserialize(d)?;
    HeaderName::try_from(s.as_str())
        .map_err(|_| serde::de::Error::custom(format!("`{s}` is not a header name")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(s: &str) -> Result<SignedTemplate, String> {
        SignedTemplate::try_from(s.to_owned())
    }

    #[test]
    fn templates_parse_into_segments() {
        assert_eq!(template("body").unwrap(), SignedTemplate::default());
        assert_eq!(template("{body}").unwrap(), SignedTemplate::default());
        assert_eq!(
            template("v0:{header:X-Timestamp}:{body}").unwrap().0,
            vec![
                Segment::Literal("v0:".into()),
                Segment::Header(HeaderName::from_static("x-timestamp")),
                Segment::Literal(":".into()),
                Segment::Body,
            ]
        );
        for bad in ["{body", "{nope}", "{header:bad name}", "body}", ""] {
            assert!(template(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn identifier_needs_exactly_one_source() {
        let parse = |y: &str| serde_yaml_ng::from_str::<IdentifierFile>(y);
        assert_eq!(
            parse("header: X-Event-Id").unwrap(),
            IdentifierFile::Header(HeaderName::from_static("x-event-id"))
        );
        assert_eq!(
            parse("json_pointer: /data/id").unwrap(),
            IdentifierFile::JsonPointer("/data/id".into())
        );
        assert!(parse("json_pointer: id").is_err());
        assert!(parse("{header: A, json_pointer: /id}").is_err());
        assert!(parse("form_fields: []").is_err());
        assert!(parse("{}").is_err());
    }
}
