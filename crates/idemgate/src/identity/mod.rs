//! Who is calling (SPEC 7): API keys, JWTs, or headers from a trusted authenticating proxy,
//! tried in the configured order; the first method that recognises the request decides.
//!
//! The principal decides the namespace a key lives in, and on a replay no handler runs to check
//! anything, so this is the load-bearing security step: a credential that is presented but
//! wrong is refused (401), never skipped over to the next method.

mod api_keys;
mod jwt;
mod trusted;

use std::net::IpAddr;
use std::path::Path;

use http::HeaderMap;
use http::header::HeaderName;
use idemgate_core::namespace::Principal;

pub use api_keys::{ApiKeyView, ApiKeys};
pub use jwt::Jwt;
pub use trusted::TrustedHeaders;

use crate::config::identity::{IdentityFile, MethodFile};

/// Subject types a principal may carry (`{type}:{id}`).
pub const SUBJECT_TYPES: &[&str] = &["user", "service", "client", "tenant_member"];

/// Headers through which idemgate tells the upstream who called. Client-sent copies are always
/// removed before the request goes on.
pub const TENANT_HEADER: HeaderName = HeaderName::from_static("x-tenant-id");
pub const PROJECT_HEADER: HeaderName = HeaderName::from_static("x-project-id");
pub const SUBJECT_HEADER: HeaderName = HeaderName::from_static("x-subject");

/// A credential was presented and refused. The reason goes to the client; it never contains
/// the credential.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Rejected(pub String);

impl Rejected {
    pub fn new(why: impl Into<String>) -> Self {
        Self(why.into())
    }
}

/// A configuration of identity that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("identity.{key}: {why}")]
pub struct SetupError {
    pub key: &'static str,
    pub why: String,
}

/// The configured methods, in order.
#[derive(Debug)]
pub struct Identity {
    methods: Vec<Method>,
}

#[derive(Debug)]
enum Method {
    ApiKeys(ApiKeys),
    Jwt(Box<Jwt>),
    Trusted(TrustedHeaders),
}

impl Identity {
    /// Builds the methods, reading key files relative to `base`.
    ///
    /// # Errors
    /// A file cannot be read or parsed, a secret's environment variable is unset, a proxy
    /// address is not a CIDR.
    pub fn from_file(file: &IdentityFile, base: &Path) -> Result<Self, SetupError> {
        let methods = file
            .methods
            .iter()
            .map(|m| match m {
                MethodFile::ApiKeys(f) => ApiKeys::load(&base.join(&f.file)).map(Method::ApiKeys),
                MethodFile::Jwt(f) => Jwt::from_file(f, base).map(|j| Method::Jwt(Box::new(j))),
                MethodFile::TrustedHeaders(f) => TrustedHeaders::from_file(f).map(Method::Trusted),
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { methods })
    }

    /// Resolves the caller: `Ok(None)` when no method recognises the request (anonymous).
    ///
    /// # Errors
    /// A credential was presented and is not valid.
    pub async fn resolve(&self, headers: &HeaderMap, peer: IpAddr) -> Result<Option<Principal>, Rejected> {
        for method in &self.methods {
            let found = match method {
                Method::ApiKeys(m) => m.resolve(headers),
                Method::Jwt(m) => m.resolve(headers).await,
                Method::Trusted(m) => m.resolve(headers, peer),
            };
            if let Some(result) = found {
                return result.map(Some);
            }
        }
        Ok(None)
    }

    /// The API key method, for provisioning through the admin API.
    #[must_use]
    pub fn api_keys(&self) -> Option<&ApiKeys> {
        self.methods.iter().find_map(|m| match m {
            Method::ApiKeys(k) => Some(k),
            _ => None,
        })
    }

    /// Header names that carry identity in from a trusted proxy; removed from every request.
    pub fn inbound_headers(&self) -> impl Iterator<Item = &HeaderName> {
        self.methods.iter().flat_map(|m| match m {
            Method::Trusted(t) => t.header_names(),
            _ => &[],
        })
    }
}

/// Builds a principal, checking the subject's type.
///
/// # Errors
/// Empty components, or a subject without one of [`SUBJECT_TYPES`].
pub fn principal(tenant: &str, project: Option<&str>, subject: &str) -> Result<Principal, Rejected> {
    if tenant.is_empty() {
        return Err(Rejected::new("the credential names no tenant"));
    }
    let Some((kind, id)) = subject.split_once(':') else {
        return Err(Rejected::new(
            "the subject has no type (user:, service:, client:, tenant_member:)",
        ));
    };
    if !SUBJECT_TYPES.contains(&kind) || id.is_empty() {
        return Err(Rejected::new(format!("`{kind}` is not a subject type")));
    }
    let project = project
        .filter(|p| !p.is_empty())
        .unwrap_or(idemgate_core::namespace::PROJECT_TENANT);
    Ok(Principal {
        tenant: tenant.to_owned(),
        project: project.to_owned(),
        subject: subject.to_owned(),
    })
}

/// The bearer token of an `Authorization: Bearer` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Whether a token has the shape of a JWT (three base64url parts), so the API key method leaves
/// it to the JWT method.
fn looks_like_jwt(token: &str) -> bool {
    let parts: Vec<&str> = token.split('.').collect();
    parts.len() == 3
        && parts[..2].iter().all(|p| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}
