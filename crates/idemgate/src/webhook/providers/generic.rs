//! The `generic` provider: an HMAC (`sha256`, `sha1`, `sha512`) of a configured template of the
//! body, headers and literal text, in a configured header, hex or base64, after an optional
//! prefix; the identifier from a header, a JSON pointer, or form fields joined with `-`. There
//! is no timestamp check: a template may sign a timestamp header, but only deduplication guards
//! against its replay.

use super::{Delivery, from_header, json_string};
use crate::config::webhooks::{GenericFile, IdentifierFile, Segment, SignatureEncoding};
use crate::webhook::crypto::{Keys, from_base64, from_hex};

/// # Errors
/// Missing signature header or prefix, undecodable signature, a header the template signs is
/// missing, or no secret matches.
pub fn verify(g: &GenericFile, keys: &Keys<'_>, d: &Delivery<'_>) -> Result<(), &'static str> {
    let header = d.header(g.header.as_str()).ok_or("no single signature header")?;
    let sig = header
        .strip_prefix(g.prefix.as_str())
        .ok_or("the signature lacks its prefix")?;
    let sig = match g.encoding {
        SignatureEncoding::Hex => from_hex(sig),
        SignatureEncoding::Base64 => from_base64(sig),
    }
    .ok_or("the signature is not in its encoding")?;
    let mut pieces: Vec<&[u8]> = Vec::with_capacity(g.signed.0.len());
    for segment in &g.signed.0 {
        pieces.push(match segment {
            Segment::Body => d.body,
            Segment::Literal(text) => text.as_bytes(),
            Segment::Header(name) => d
                .header(name.as_str())
                .ok_or("a header the template signs is missing")?
                .as_bytes(),
        });
    }
    if keys.any_mac_matches(g.algorithm, &[&pieces], &[sig]) {
        Ok(())
    } else {
        Err("no secret matches")
    }
}

/// # Errors
/// The configured slot is empty or missing.
pub fn identifier(g: &GenericFile, d: &Delivery<'_>) -> Result<String, &'static str> {
    match &g.identifier {
        IdentifierFile::Header(name) => from_header(d, name.as_str()),
        IdentifierFile::JsonPointer(pointer) => json_string(d.body, pointer),
        IdentifierFile::FormFields(names) => {
            let form = d.form();
            let mut parts = Vec::with_capacity(names.len());
            for name in names {
                let value = form
                    .iter()
                    .find(|(k, v)| k == name && !v.is_empty())
                    .ok_or("a form field of the identifier is missing")?;
                parts.push(value.1.as_str());
            }
            Ok(parts.join("-"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::Owned;
    use super::*;
    use crate::config::webhooks::HmacAlgorithm;
    use crate::webhook::crypto::{BASE64, Secret, hmac};
    use base64::Engine as _;

    fn generic(yaml: &str) -> GenericFile {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn a_slack_style_template_verifies() {
        // Slack's scheme expressed as a generic provider: `v0=` + hex HMAC-SHA256 of
        // `v0:{timestamp}:{body}`.
        let g = generic(
            "{header: X-Slack-Signature, prefix: 'v0=', signed: 'v0:{header:X-Slack-Request-Timestamp}:{body}', identifier: {json_pointer: /event_id}}",
        );
        let body = br#"{"event_id":"Ev1","n":7}"#;
        let mac = hmac(HmacAlgorithm::Sha256, b"slack", &[b"v0:1531420618:", body]);
        let sig = format!("v0={}", hex::encode(mac));
        let o = Owned::new(
            "/",
            &[
                ("x-slack-signature", &sig),
                ("x-slack-request-timestamp", "1531420618"),
            ],
            body,
        );
        let secrets = [Secret::new("slack")];
        let keys = Keys::new(&secrets);
        assert_eq!(verify(&g, &keys, &o.delivery()), Ok(()));
        assert_eq!(identifier(&g, &o.delivery()).unwrap(), "Ev1");
        let o = Owned::new(
            "/",
            &[
                ("x-slack-signature", &sig),
                ("x-slack-request-timestamp", "1531420619"),
            ],
            body,
        );
        assert!(
            verify(&g, &keys, &o.delivery()).is_err(),
            "the timestamp is signed"
        );
        let o = Owned::new("/", &[("x-slack-signature", &sig)], body);
        assert_eq!(
            verify(&g, &keys, &o.delivery()),
            Err("a header the template signs is missing")
        );
    }

    #[test]
    fn base64_sha512_and_form_identifiers() {
        let g = generic(
            "{algorithm: sha512, header: X-Sig, encoding: base64, identifier: {form_fields: [Sid, Status]}}",
        );
        let body = b"Sid=S1&Status=sent&x=1";
        let sig = BASE64.encode(hmac(HmacAlgorithm::Sha512, b"k", &[body]));
        let o = Owned::new("/", &[("x-sig", &sig)], body);
        let secrets = [Secret::new("k")];
        assert_eq!(verify(&g, &Keys::new(&secrets), &o.delivery()), Ok(()));
        assert_eq!(identifier(&g, &o.delivery()).unwrap(), "S1-sent");
        let o = Owned::new("/", &[("x-sig", &sig)], b"Sid=S1");
        assert!(identifier(&g, &o.delivery()).is_err());
        let g = generic("{header: X-Sig, prefix: 'sha1=', algorithm: sha1, identifier: {header: X-Id}}");
        let sig = format!("sha1={}", hex::encode(hmac(HmacAlgorithm::Sha1, b"k", &[b"b"])));
        let o = Owned::new("/", &[("x-sig", &sig), ("x-id", "i-1")], b"b");
        assert_eq!(verify(&g, &Keys::new(&secrets), &o.delivery()), Ok(()));
        assert_eq!(identifier(&g, &o.delivery()).unwrap(), "i-1");
        let o = Owned::new("/", &[("x-sig", &sig[5..])], b"b");
        assert_eq!(
            verify(&g, &Keys::new(&secrets), &o.delivery()),
            Err("the signature lacks its prefix")
        );
    }
}
