//! Who is calling: the [`PrincipalSource`] the layer asks for each request's [`Principal`].
//!
//! The layer does not authenticate anyone. An authentication layer that runs before it (a JWT
//! check, an API-key lookup, a session) states who the caller is, and the principal source reads
//! that statement from the request. The default, [`FromExtensions`], reads a [`Principal`] that
//! the authentication layer inserted into the request extensions; any
//! `Fn(&http::request::Parts) -> Option<Principal>` closure works too.

use idemgate_core::namespace::Principal;

/// Resolves the caller of a request. `None` means anonymous: fine for
/// [`Scope::Global`](idemgate_core::namespace::Scope::Global), answered `401 unauthenticated`
/// on every other scope.
///
/// ```
/// use tower_idemgate::{Principal, PrincipalSource};
///
/// // A closure is a principal source: here, a trusted header set by an authenticating proxy.
/// let from_header = |parts: &http::request::Parts| {
///     let subject = parts.headers.get("x-subject")?.to_str().ok()?;
///     Some(Principal::new("acme", "_tenant", format!("user:{subject}")))
/// };
/// let (parts, ()) = http::Request::builder()
///     .header("x-subject", "alice")
///     .body(())
///     .unwrap()
///     .into_parts();
/// assert_eq!(from_header.principal(&parts).unwrap().subject, "user:alice");
/// ```
pub trait PrincipalSource: Send + Sync + 'static {
    /// The caller of the request whose head is `parts`.
    fn principal(&self, parts: &http::request::Parts) -> Option<Principal>;
}

impl<F> PrincipalSource for F
where
    F: Fn(&http::request::Parts) -> Option<Principal> + Send + Sync + 'static,
{
    fn principal(&self, parts: &http::request::Parts) -> Option<Principal> {
        self(parts)
    }
}

/// The default source: a [`Principal`] in the request extensions, put there by whatever
/// authenticated the request.
///
/// ```
/// use tower_idemgate::{FromExtensions, Principal, PrincipalSource};
///
/// let mut req = http::Request::new(());
/// assert!(FromExtensions.principal(&req.into_parts().0).is_none());
///
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(Principal::new("acme", "shop", "user:alice"));
/// let (parts, ()) = req.into_parts();
/// assert_eq!(FromExtensions.principal(&parts).unwrap().tenant, "acme");
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct FromExtensions;

impl PrincipalSource for FromExtensions {
    fn principal(&self, parts: &http::request::Parts) -> Option<Principal> {
        parts.extensions.get::<Principal>().cloned()
    }
}
