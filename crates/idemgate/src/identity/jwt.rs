//! JWT bearer tokens: HS256 (a shared secret from the environment), RS256, ES256 and EdDSA
//! (public keys from a JWKS file or URL, refreshed when a token names an unknown `kid`).
//!
//! Algorithm confusion is closed by deciding the algorithm from the *key*, never from the
//! token: a JWKS key's type fixes its algorithm (RSA → RS256, P-256 → ES256, Ed25519 → EdDSA),
//! the secret is HS256 only, and a token whose header names any other algorithm for that key
//! is refused. `alg: none` has no key and is refused by the parser.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::{BodyExt, Full};
use idemgate_core::namespace::Principal;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};

use super::{Rejected, SUBJECT_TYPES, SetupError, bearer, looks_like_jwt, principal};
use crate::config::identity::JwtFile;
use crate::upstream::Upstreams;

/// A JWKS URL is asked again for an unknown `kid` at most this often.
const URL_REFRESH_EVERY: Duration = Duration::from_secs(5);
/// Clock skew allowed on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 30;

pub struct Jwt {
    issuer: Option<String>,
    audience: Option<String>,
    claims: [String; 3],
    subject_type: String,
    secret: Option<DecodingKey>,
    jwks: Option<Jwks>,
}

impl std::fmt::Debug for Jwt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jwt")
            .field("issuer", &self.issuer)
            .finish_non_exhaustive()
    }
}

struct Jwks {
    source: Source,
    keys: RwLock<HashMap<String, (DecodingKey, Algorithm)>>,
    /// File: the modification time last loaded; URL: when it was last asked.
    seen: Mutex<(Option<SystemTime>, Option<Instant>)>,
}

enum Source {
    File(PathBuf),
    Url(http::Uri),
}

impl Jwt {
    /// # Errors
    /// No key source, an unset secret variable, an unreadable JWKS file, a bad subject type.
    pub fn from_file(f: &JwtFile, base: &Path) -> Result<Self, SetupError> {
        let err = |key, why: String| SetupError { key, why };
        let secret = match &f.hs256_secret_env {
            Some(var) => {
                let value = std::env::var(var).map_err(|_| {
                    err(
                        "jwt.hs256_secret_env",
                        format!("environment variable {var} is not set"),
                    )
                })?;
                Some(DecodingKey::from_secret(value.as_bytes()))
            }
            None => None,
        };
        let source = match (&f.jwks_file, &f.jwks_url) {
            (Some(_), Some(_)) => return Err(err("jwt", "give jwks_file or jwks_url, not both".into())),
            (Some(file), None) => Some(Source::File(base.join(file))),
            (None, Some(url)) => {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|_| err("jwt.jwks_url", format!("`{url}` is not a URL")))?;
                if uri.scheme_str() != Some("http") {
                    return Err(err("jwt.jwks_url", "only http:// URLs are supported so far (serve the JWKS through a local sidecar, or use jwks_file)".into()));
                }
                Some(Source::Url(uri))
            }
            (None, None) => None,
        };
        if secret.is_none() && source.is_none() {
            return Err(err("jwt", "needs jwks_file, jwks_url or hs256_secret_env".into()));
        }
        let subject_type = f.subject_type.clone().unwrap_or_else(|| "user".into());
        if !SUBJECT_TYPES.contains(&subject_type.as_str()) {
            return Err(err(
                "jwt.subject_type",
                format!("`{subject_type}` is not one of {SUBJECT_TYPES:?}"),
            ));
        }
        let jwks = source.map(|source| Jwks {
            source,
            keys: RwLock::new(HashMap::new()),
            seen: Mutex::new((None, None)),
        });
        if let Some(Jwks {
            source: Source::File(path),
            keys,
            seen,
        }) = &jwks
        {
            let (loaded, mtime) = load_file(path).map_err(|why| err("jwt.jwks_file", why))?;
            *keys.write().unwrap_or_else(PoisonError::into_inner) = loaded;
            seen.lock().unwrap_or_else(PoisonError::into_inner).0 = mtime;
        }
        Ok(Self {
            issuer: f.issuer.clone(),
            audience: f.audience.clone(),
            claims: [
                f.claims.tenant.clone(),
                f.claims.project.clone(),
                f.claims.subject.clone(),
            ],
            subject_type,
            secret,
            jwks,
        })
    }

    /// `None` when no JWT is presented.
    pub async fn resolve(&self, headers: &HeaderMap) -> Option<Result<Principal, Rejected>> {
        let token = bearer(headers).filter(|t| looks_like_jwt(t))?;
        Some(self.verify(token).await)
    }

    async fn verify(&self, token: &str) -> Result<Principal, Rejected> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| Rejected::new("malformed or unsupported token"))?;
        let (key, alg) = if header.alg == Algorithm::HS256 {
            let secret = self
                .secret
                .clone()
                .ok_or_else(|| Rejected::new("HS256 tokens are not accepted"))?;
            (secret, Algorithm::HS256)
        } else {
            let jwks = self
                .jwks
                .as_ref()
                .ok_or_else(|| Rejected::new("only HS256 tokens are accepted"))?;
            let kid = header
                .kid
                .as_deref()
                .ok_or_else(|| Rejected::new("the token names no key (kid)"))?;
            jwks.key(kid)
                .await
                .ok_or_else(|| Rejected::new("the token's key (kid) is unknown"))?
        };
        if header.alg != alg {
            return Err(Rejected::new("the token's algorithm does not match its key"));
        }
        let mut v = Validation::new(alg);
        v.leeway = LEEWAY_SECS;
        v.validate_nbf = true;
        v.set_required_spec_claims(&["exp"]);
        match &self.issuer {
            Some(iss) => v.set_issuer(&[iss]),
            None => v.iss = None,
        }
        match &self.audience {
            Some(aud) => v.set_audience(&[aud]),
            None => v.validate_aud = false,
        }
        let data = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(token, &key, &v)
            .map_err(|e| {
                use jsonwebtoken::errors::ErrorKind as K;
                Rejected::new(match e.kind() {
                    K::ExpiredSignature => "the token has expired",
                    K::ImmatureSignature => "the token is not valid yet",
                    K::InvalidIssuer => "the token's issuer is not accepted",
                    K::InvalidAudience => "the token's audience is not accepted",
                    K::InvalidSignature => "the token's signature is invalid",
                    K::MissingRequiredClaim(_) => "the token lacks a required claim",
                    _ => "the token is invalid",
                })
            })?;
        let claim = |name: &str| data.claims.get(name).and_then(serde_json::Value::as_str);
        let [tenant, project, subject] = &self.claims;
        let id =
            claim(subject).ok_or_else(|| Rejected::new(format!("the token has no `{subject}` claim")))?;
        let tenant =
            claim(tenant).ok_or_else(|| Rejected::new(format!("the token has no `{tenant}` claim")))?;
        principal(tenant, claim(project), &format!("{}:{id}", self.subject_type))
    }
}

impl Jwks {
    /// The key for `kid`, refreshing the set once if it is unknown.
    async fn key(&self, kid: &str) -> Option<(DecodingKey, Algorithm)> {
        if let Some(k) = self.keys.read().unwrap_or_else(PoisonError::into_inner).get(kid) {
            return Some(k.clone());
        }
        self.refresh().await;
        self.keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(kid)
            .cloned()
    }

    async fn refresh(&self) {
        let loaded = match &self.source {
            Source::File(path) => {
                let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
                let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
                if mtime.is_some() && mtime == seen.0 {
                    return; // unchanged since the last load
                }
                match load_file(path) {
                    Ok((keys, m)) => {
                        seen.0 = m;
                        keys
                    }
                    Err(why) => {
                        tracing::warn!(%why, "JWKS file reload failed; keeping the previous keys");
                        return;
                    }
                }
            }
            Source::Url(uri) => {
                {
                    let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
                    if seen.1.is_some_and(|at| at.elapsed() < URL_REFRESH_EVERY) {
                        return;
                    }
                    seen.1 = Some(Instant::now());
                }
                match fetch(uri).await {
                    Ok(keys) => keys,
                    Err(why) => {
                        tracing::warn!(%why, "JWKS fetch failed; keeping the previous keys");
                        return;
                    }
                }
            }
        };
        *self.keys.write().unwrap_or_else(PoisonError::into_inner) = loaded;
    }
}

type KeyMap = HashMap<String, (DecodingKey, Algorithm)>;

fn load_file(path: &Path) -> Result<(KeyMap, Option<SystemTime>), String> {
    let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let text = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok((parse_jwks(&text)?, mtime))
}

async fn fetch(uri: &http::Uri) -> Result<KeyMap, String> {
    let req = http::Request::get(uri.clone())
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let call = async {
        let resp = Upstreams::new(Duration::from_secs(5), Duration::from_secs(1))
            .request(req)
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status()));
        }
        let body = resp.into_body().collect().await.map_err(|e| e.to_string())?;
        parse_jwks(&body.to_bytes())
    };
    tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .map_err(|_| "timed out".to_owned())?
}

/// Keys usable for signatures, each with the one algorithm its type allows.
fn parse_jwks(bytes: &[u8]) -> Result<KeyMap, String> {
    let set: JwkSet = serde_json::from_slice(bytes).map_err(|e| format!("not a JWKS document: {e}"))?;
    let mut keys = HashMap::new();
    for jwk in &set.keys {
        let Some(kid) = jwk.common.key_id.clone() else {
            continue;
        };
        let alg = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => Algorithm::RS256,
            AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => Algorithm::ES256,
            AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
            // Symmetric keys in a published set, and other curves, are never accepted.
            _ => continue,
        };
        if let Ok(key) = DecodingKey::from_jwk(jwk) {
            keys.insert(kid, (key, alg));
        }
    }
    Ok(keys)
}
