//! Webhook signature and identifier headers: every provider's check and identifier lift answer
//! any header values and body without panicking, and nothing unsigned verifies.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue, Uri};
use idemgate::config::webhooks::Provider;
use idemgate::webhook::crypto::{Keys, Secret};
use idemgate::webhook::providers::{Delivery, identifier, verify};
use libfuzzer_sys::fuzz_target;

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

fuzz_target!(|input: (Vec<(u8, Vec<u8>)>, Vec<u8>)| {
    let (pairs, body) = input;
    let mut h = HeaderMap::new();
    for (i, v) in pairs {
        if let Ok(v) = HeaderValue::from_bytes(&v) {
            h.append(HeaderName::from_static(NAMES[usize::from(i) % NAMES.len()]), v);
        }
    }
    let uri = Uri::from_static("/hooks/x?a=1");
    let secrets = [Secret::new(b"fuzz-secret".to_vec())];
    let keys = Keys::new(&secrets);
    let d = Delivery {
        headers: &h,
        uri: &uri,
        body: &body,
        public_base_url: Some("https://api.test"),
        now: 1_700_000_000,
        tolerance: 300,
    };
    for p in [
        Provider::Stripe,
        Provider::Github,
        Provider::TwilioEventStreams,
        Provider::Twilio,
        Provider::StandardWebhooks,
        Provider::Shopify,
        Provider::Gitlab,
    ] {
        let _ = verify(p, None, &keys, &d);
        let _ = identifier(p, None, &d);
    }
});
