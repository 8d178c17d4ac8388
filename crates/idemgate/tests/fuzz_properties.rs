//! The fuzz targets' properties (fuzz/fuzz_targets), run as property tests on every `cargo test`
//! so CI checks them without a sanitizer build; `cargo fuzz` explores the same properties for
//! longer (fuzz/README.md).

use idemgate::routes::PathTemplate;
use idemgate_core::key::{KeyRules, parse_header};
use proptest::prelude::*;

/// Bytes that look like HTTP often enough to reach the interesting states.
fn http_bytes() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"POST / HTTP/1.1\r\n".to_vec()),
        Just(b"Host: x\r\n".to_vec()),
        Just(b"Content-Length: 3\r\n".to_vec()),
        Just(b"Content-Length: 0\r\n".to_vec()),
        Just(b"Transfer-Encoding: chunked\r\n".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"3\r\nabc\r\n0\r\n\r\n".to_vec()),
        Just(b"abc".to_vec()),
        prop::collection::vec(any::<u8>(), 0..8),
    ];
    prop::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn framing_verdicts_do_not_depend_on_the_split(bytes in http_bytes(), split in 1usize..64) {
        let whole = idemgate::framing::verdicts_for(&[&bytes]);
        let chunks: Vec<&[u8]> = bytes.chunks(split).collect();
        prop_assert_eq!(idemgate::framing::verdicts_for(&chunks), whole);
    }

    #[test]
    fn key_parser_never_panics_and_parsed_keys_survive_quoting(lines in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..3)) {
        let rules = KeyRules::default();
        if let Ok(Some(key)) = parse_header(lines.iter().map(Vec::as_slice)) {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            prop_assert_eq!(parse_header([quoted.as_bytes()]).ok().flatten(), Some(key.clone()));
            let _ = rules.validate(&key);
        }
    }

    #[test]
    fn literal_templates_match_themselves(template in "(/[a-z0-9{}*]{0,6}){0,5}", path in "(/[a-z0-9]{0,6}){0,5}") {
        if let Ok(t) = PathTemplate::parse(&template) {
            let _ = t.matches(&path);
            if !template.contains(['{', '*']) {
                prop_assert!(t.matches(&template).is_some());
            }
        }
    }

    #[test]
    fn config_loader_never_panics(text in "[a-z_:{}\\[\\], \n-]{0,200}") {
        let _ = idemgate::config::Config::from_yaml(&text);
    }
}

mod webhook_headers {
    use http::{HeaderMap, HeaderName, HeaderValue, Uri};
    use idemgate::config::webhooks::Provider;
    use idemgate::webhook::crypto::{Keys, Secret};
    use idemgate::webhook::providers::{Delivery, identifier, verify};
    use proptest::prelude::*;

    const PROVIDERS: [Provider; 7] = [
        Provider::Stripe,
        Provider::Github,
        Provider::TwilioEventStreams,
        Provider::Twilio,
        Provider::StandardWebhooks,
        Provider::Shopify,
        Provider::Gitlab,
    ];

    /// Signature and identifier headers of every provider, with hostile values.
    fn headers() -> impl Strategy<Value = Vec<(usize, String)>> {
        let value = prop_oneof![
            "[ -~]{0,80}",
            Just("t=1,v1=".to_owned()),
            Just("t=,v1=,v1=zz".to_owned()),
            Just("v1,".to_owned()),
            Just("sha256=".to_owned()),
            Just("v1,!!!notbase64 v1,".to_owned()),
        ];
        prop::collection::vec((0usize..9, value), 0..6)
    }

    const NAMES: [&str; 9] = [
        "stripe-signature",
        "x-hub-signature-256",
        "x-twilio-signature",
        "webhook-signature",
        "webhook-timestamp",
        "webhook-id",
        "x-shopify-hmac-sha256",
        "x-gitlab-token",
        "content-type",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any header values and body: every provider's check and identifier lift answer (never
        /// panic), and nothing unsigned verifies.
        #[test]
        fn signature_headers_never_panic_and_never_verify_by_accident(
            pairs in headers(),
            body in prop::collection::vec(any::<u8>(), 0..64),
            query in "[a-zA-Z0-9=&]{0,20}",
        ) {
            let mut h = HeaderMap::new();
            for (i, v) in &pairs {
                if let Ok(v) = HeaderValue::from_str(v) {
                    h.append(HeaderName::from_static(NAMES[*i]), v);
                }
            }
            let uri: Uri = format!("/hooks/x?{query}").parse().unwrap_or_else(|_| Uri::from_static("/hooks/x"));
            let secrets = [Secret::new(b"test-only-fuzz-secret".to_vec())];
            let keys = Keys::new(&secrets);
            let d = Delivery { headers: &h, uri: &uri, body: &body, public_base_url: Some("https://api.test"), now: 1_700_000_000, tolerance: 300 };
            for p in PROVIDERS {
                prop_assert!(verify(p, None, &keys, &d).is_err(), "{p:?} verified an unsigned delivery");
                let _ = identifier(p, None, &d);
            }
        }
    }
}
