//! The timestamped schemes: Stripe and Standard Webhooks. Both sign a timestamp with the body
//! and let a delivery carry several signatures (Stripe during secret rolls, Standard Webhooks for
//! several keys); any one may match. The timestamp must be within `signature_tolerance` of now.

use super::Delivery;
use crate::config::webhooks::HmacAlgorithm;
use crate::webhook::crypto::{Keys, from_base64, from_hex};

/// Signatures a delivery may offer: more are refused, which bounds the work an unsigned request
/// can cause.
const MAX_CANDIDATES: usize = 8;

/// `Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>…][,v0=…]`: HMAC-SHA256 of `{t}.{body}` with
/// the endpoint secret (the whole `whsec_…` text). Schemes other than `v1` are ignored.
///
/// # Errors
/// Missing or malformed header, no `v1` that matches, or a timestamp outside the tolerance.
pub fn verify_stripe(keys: &Keys<'_>, d: &Delivery<'_>) -> Result<(), &'static str> {
    let header = d
        .header("stripe-signature")
        .ok_or("no single Stripe-Signature header")?;
    let mut timestamp = None;
    let mut candidates = Vec::new();
    for item in header.split(',') {
        let Some((name, value)) = item.split_once('=') else {
            continue;
        };
        match name.trim() {
            // The first `t` counts, as in Stripe's SDKs.
            "t" if timestamp.is_none() => timestamp = Some(value.trim()),
            // An undecodable candidate stays in the list as bytes that match nothing.
            "v1" => candidates.push(from_hex(value).unwrap_or_default()),
            _ => {}
        }
    }
    let t: i64 = timestamp.and_then(|t| t.parse().ok()).ok_or("no t= timestamp")?;
    if candidates.is_empty() {
        return Err("no v1 signature");
    }
    if candidates.len() > MAX_CANDIDATES {
        return Err("too many signatures");
    }
    let t_text = t.to_string();
    let message: &[&[u8]] = &[t_text.as_bytes(), b".", d.body];
    if !keys.any_mac_matches(HmacAlgorithm::Sha256, &[message], &candidates) {
        return Err("no v1 signature matches");
    }
    // Checked after the signature, as Stripe's SDKs do: a stale timestamp is only worth
    // reporting on a delivery that is otherwise genuine.
    if !d.fresh(t) {
        return Err("timestamp outside the tolerance");
    }
    Ok(())
}

/// Standard Webhooks: `webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64>[ …]`;
/// HMAC-SHA256 of `{id}.{timestamp}.{body}` with the decoded `whsec_` secret.
///
/// # Errors
/// A missing header, no `v1` signature that matches, or a timestamp outside the tolerance.
pub fn verify_standard(keys: &Keys<'_>, d: &Delivery<'_>) -> Result<(), &'static str> {
    let id = d
        .header("webhook-id")
        .filter(|s| !s.is_empty())
        .ok_or("no webhook-id")?;
    let t: i64 = d
        .header("webhook-timestamp")
        .and_then(|t| t.parse().ok())
        .ok_or("no webhook-timestamp")?;
    let header = d.header("webhook-signature").ok_or("no webhook-signature")?;
    let candidates: Vec<Vec<u8>> = header
        .split(' ')
        .filter_map(|s| s.split_once(','))
        .filter(|(version, _)| *version == "v1")
        .map(|(_, sig)| from_base64(sig).unwrap_or_default())
        .collect();
    if candidates.is_empty() {
        return Err("no v1 signature");
    }
    if candidates.len() > MAX_CANDIDATES {
        return Err("too many signatures");
    }
    // The SDKs check the timestamp first; either way it is a 401 and the same work.
    let t_text = t.to_string();
    let message: &[&[u8]] = &[id.as_bytes(), b".", t_text.as_bytes(), b".", d.body];
    let matched = keys.any_mac_matches(HmacAlgorithm::Sha256, &[message], &candidates);
    if !d.fresh(t) {
        return Err("timestamp outside the tolerance");
    }
    if !matched {
        return Err("no v1 signature matches");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::Owned;
    use super::*;
    use crate::config::webhooks::Provider;
    use crate::webhook::crypto::Secret;
    use crate::webhook::registry::secret_for;

    const STRIPE_SECRET: &str = "whsec_test_secret";
    const STRIPE_BODY: &[u8] = br#"{"id": "evt_test_webhook", "object": "event"}"#;
    const STRIPE_T: i64 = 1_492_774_577;
    /// `stripe.WebhookSignature.generate_signature_header(body, "whsec_test_secret",
    /// timestamp=1492774577)` (stripe-python 16.1): Stripe's scheme as its SDK computes it.
    const STRIPE_V1: &str = "c137b1b62277d523cf8fed4dfbd0170a9a5b8a380e00cc3711d4bf0652f2ce7a";

    fn stripe(header: &str, now: i64, secrets: &[&str]) -> Result<(), &'static str> {
        let o = Owned::new("/", &[("stripe-signature", header)], STRIPE_BODY).at(now);
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::new(*s)).collect();
        verify_stripe(&Keys::new(&secrets), &o.delivery())
    }

    #[test]
    fn stripe_sdk_vector_verifies() {
        let h = format!("t={STRIPE_T},v1={STRIPE_V1}");
        assert_eq!(stripe(&h, STRIPE_T + 10, &[STRIPE_SECRET]), Ok(()));
        // The scheme itself: HMAC-SHA256 of `{t}.{body}` keyed with the whole `whsec_` text.
        let mac = crate::webhook::crypto::hmac(
            HmacAlgorithm::Sha256,
            STRIPE_SECRET.as_bytes(),
            &[format!("{STRIPE_T}.").as_bytes(), STRIPE_BODY],
        );
        assert_eq!(hex::encode(mac), STRIPE_V1);
    }

    #[test]
    fn stripe_any_v1_may_match_and_v0_is_ignored() {
        let wrong = "0".repeat(64);
        let h = format!("t={STRIPE_T},v1={wrong},v0={STRIPE_V1},v1={STRIPE_V1}");
        assert_eq!(stripe(&h, STRIPE_T, &[STRIPE_SECRET]), Ok(()));
        let h = format!("t={STRIPE_T},v0={STRIPE_V1}");
        assert_eq!(stripe(&h, STRIPE_T, &[STRIPE_SECRET]), Err("no v1 signature"));
        let h = format!("t={STRIPE_T},v1=zz,v1={STRIPE_V1}");
        assert_eq!(
            stripe(&h, STRIPE_T, &[STRIPE_SECRET]),
            Ok(()),
            "a malformed candidate matches nothing"
        );
    }

    #[test]
    fn stripe_refuses_wrong_secret_stale_or_future_time_and_garbage() {
        let h = format!("t={STRIPE_T},v1={STRIPE_V1}");
        assert!(stripe(&h, STRIPE_T, &["whsec_other"]).is_err());
        assert_eq!(
            stripe(&h, STRIPE_T, &["whsec_other", STRIPE_SECRET]),
            Ok(()),
            "rotation"
        );
        assert_eq!(
            stripe(&h, STRIPE_T + 301, &[STRIPE_SECRET]),
            Err("timestamp outside the tolerance")
        );
        assert_eq!(
            stripe(&h, STRIPE_T - 301, &[STRIPE_SECRET]),
            Err("timestamp outside the tolerance")
        );
        assert!(stripe(&format!("v1={STRIPE_V1}"), STRIPE_T, &[STRIPE_SECRET]).is_err());
        assert!(stripe(&format!("t=x,v1={STRIPE_V1}"), STRIPE_T, &[STRIPE_SECRET]).is_err());
        let many = format!("t={STRIPE_T}{}", ",v1=00".repeat(MAX_CANDIDATES + 1));
        assert_eq!(
            stripe(&many, STRIPE_T, &[STRIPE_SECRET]),
            Err("too many signatures")
        );
        // A different timestamp with the same signature: the timestamp is signed.
        let h = format!("t={},v1={STRIPE_V1}", STRIPE_T + 1);
        assert!(stripe(&h, STRIPE_T, &[STRIPE_SECRET]).is_err());
    }

    /// The Standard Webhooks example (standard-webhooks' own test suite; the same value comes out
    /// of the `standardwebhooks` Python package's `Webhook.sign`).
    const SW_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SW_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const SW_T: i64 = 1_614_265_330;
    const SW_BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SW_SIG: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    fn standard(sig: &str, now: i64) -> Result<(), &'static str> {
        let t = SW_T.to_string();
        let o = Owned::new(
            "/",
            &[
                ("webhook-id", SW_ID),
                ("webhook-timestamp", &t),
                ("webhook-signature", sig),
            ],
            SW_BODY,
        )
        .at(now);
        let secrets = [secret_for(Provider::StandardWebhooks, SW_SECRET).unwrap()];
        verify_standard(&Keys::new(&secrets), &o.delivery())
    }

    #[test]
    fn standard_webhooks_vector_verifies() {
        assert_eq!(standard(SW_SIG, SW_T), Ok(()));
        assert_eq!(
            standard(&format!("v1a,AAAA v2,AAAA {SW_SIG}"), SW_T),
            Ok(()),
            "a list"
        );
        assert_eq!(
            standard("v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE", SW_T),
            Ok(()),
            "unpadded"
        );
        assert_eq!(standard("v1,AAAA", SW_T), Err("no v1 signature matches"));
        assert_eq!(standard("v2,AAAA", SW_T), Err("no v1 signature"));
        assert_eq!(
            standard(SW_SIG, SW_T + 301),
            Err("timestamp outside the tolerance")
        );
        assert_eq!(
            standard(SW_SIG, SW_T - 301),
            Err("timestamp outside the tolerance")
        );
    }
}
