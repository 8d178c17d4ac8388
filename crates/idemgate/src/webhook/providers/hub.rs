//! Providers that sign the body alone: GitHub (`X-Hub-Signature-256: sha256=<hex>`), Shopify
//! (`X-Shopify-Hmac-Sha256: <base64>`), both HMAC-SHA256 of the raw body; and GitLab, which sends
//! the secret itself in `X-Gitlab-Token` (compared in constant time, over digests so that the
//! length does not show either).

use super::Delivery;
use crate::config::webhooks::HmacAlgorithm;
use crate::webhook::crypto::{Keys, from_base64, from_hex};

/// GitHub. Only the SHA-256 header counts: the legacy `X-Hub-Signature` (SHA-1) is ignored.
///
/// # Errors
/// Missing header, not `sha256=` + hex, or no secret matches.
pub fn verify_github(keys: &Keys<'_>, d: &Delivery<'_>) -> Result<(), &'static str> {
    let header = d
        .header("x-hub-signature-256")
        .ok_or("no single X-Hub-Signature-256 header")?;
    let sig = header.strip_prefix("sha256=").ok_or("not sha256=")?;
    let sig = from_hex(sig).ok_or("not hex")?;
    body_mac(keys, d, &sig)
}

/// Shopify.
///
/// # Errors
/// Missing header, not base64, or no secret matches.
pub fn verify_shopify(keys: &Keys<'_>, d: &Delivery<'_>) -> Result<(), &'static str> {
    let header = d
        .header("x-shopify-hmac-sha256")
        .ok_or("no single X-Shopify-Hmac-Sha256 header")?;
    let sig = from_base64(header).ok_or("not base64")?;
    body_mac(keys, d, &sig)
}

/// GitLab.
///
/// # Errors
/// Missing header, or it equals no secret.
pub fn verify_gitlab(keys: &Keys<'_>, d: &Delivery<'_>) -> Result<(), &'static str> {
    let token = d
        .header("x-gitlab-token")
        .ok_or("no single X-Gitlab-Token header")?;
    if keys.any_secret_equals(token.as_bytes()) {
        Ok(())
    } else {
        Err("the token matches no secret")
    }
}

fn body_mac(keys: &Keys<'_>, d: &Delivery<'_>, sig: &[u8]) -> Result<(), &'static str> {
    let message: &[&[u8]] = &[d.body];
    if keys.any_mac_matches(HmacAlgorithm::Sha256, &[message], &[sig.to_vec()]) {
        Ok(())
    } else {
        Err("no secret matches")
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::Owned;
    use super::*;
    use crate::webhook::crypto::Secret;

    /// GitHub's documented example ("Validating webhook deliveries").
    const GH_SECRET: &str = "It's a Secret to Everybody";
    const GH_BODY: &[u8] = b"Hello, World!";
    const GH_SIG: &str = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

    fn github(sig: &str, body: &[u8], secrets: &[&str]) -> Result<(), &'static str> {
        let o = Owned::new("/", &[("x-hub-signature-256", sig)], body);
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::new(*s)).collect();
        verify_github(&Keys::new(&secrets), &o.delivery())
    }

    #[test]
    fn github_documented_example_verifies() {
        assert_eq!(github(GH_SIG, GH_BODY, &[GH_SECRET]), Ok(()));
        assert_eq!(
            github(
                &GH_SIG.to_uppercase().replace("SHA256=", "sha256="),
                GH_BODY,
                &[GH_SECRET]
            ),
            Ok(())
        );
        assert_eq!(github(GH_SIG, GH_BODY, &["old", GH_SECRET]), Ok(()), "rotation");
        assert!(
            github(GH_SIG, b"Hello, World?", &[GH_SECRET]).is_err(),
            "tampered"
        );
        assert!(github(GH_SIG, GH_BODY, &["It's a Secret to Nobody"]).is_err());
        assert!(github(&GH_SIG.replace("sha256=", "sha1="), GH_BODY, &[GH_SECRET]).is_err());
        assert!(github(&GH_SIG[..40], GH_BODY, &[GH_SECRET]).is_err(), "truncated");
    }

    #[test]
    fn shopify_is_base64_of_the_body_mac() {
        let mac = crate::webhook::crypto::hmac(HmacAlgorithm::Sha256, b"shpss", &[b"{\"a\":1}"]);
        let sig = crate::webhook::crypto::BASE64.encode(&mac);
        let check = |sig: &str, secret: &str| {
            let o = Owned::new("/", &[("x-shopify-hmac-sha256", sig)], b"{\"a\":1}");
            let secrets = [Secret::new(secret)];
            verify_shopify(&Keys::new(&secrets), &o.delivery())
        };
        assert_eq!(check(&sig, "shpss"), Ok(()));
        assert!(check(&sig, "other").is_err());
        assert!(
            check(&hex::encode(&mac), "shpss").is_err(),
            "hex is not Shopify's encoding"
        );
    }

    #[test]
    fn gitlab_token_must_equal_a_secret() {
        let check = |token: &str| {
            let o = Owned::new("/", &[("x-gitlab-token", token)], b"{}");
            let secrets = [Secret::new("tok-old"), Secret::new("tok-new")];
            verify_gitlab(&Keys::new(&secrets), &o.delivery())
        };
        assert_eq!(check("tok-new"), Ok(()));
        assert_eq!(check("tok-old"), Ok(()));
        assert!(check("tok-ne").is_err());
        assert!(check("tok-new2").is_err());
    }

    use base64::Engine as _;
}
