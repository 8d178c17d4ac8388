//! The per-route settings a layer applies, and the decisions that need no store: whether the
//! key is read, refused or required, and which namespaced key a request maps to.

use std::sync::Arc;

use http::HeaderName;
use http::header::HeaderValue;
use idemgate_core::engine::Policy;
use idemgate_core::key::{KeyRules, parse_header};
use idemgate_core::namespace::{Principal, Scope, namespaced_key};

use super::{IDEMPOTENCY_KEY, REPLAYED};
use crate::principal::PrincipalSource;
use crate::problem::{Problem, ProblemKind};
use crate::procedure::Procedure;

/// Whether a route reads the `Idempotency-Key` header (SPEC section 2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KeyPolicy {
    /// No key: `400 missing-idempotency-key`. With a key: deduplicated.
    Required,
    /// No key: passed to the service without dedup. With a key: deduplicated. The default.
    #[default]
    Accepted,
    /// No key: passed through. With a key: `400 idempotency-key-not-allowed` (reads, streams).
    Prohibited,
}

/// What a request gets when the store fails (SPEC section 4.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OnStoreError {
    /// `503 store-unavailable` with `Retry-After`. Default on `required` routes.
    FailClosed,
    /// The service runs without dedup. Default on `accepted` routes.
    FailOpen,
}

/// Default `max_request_bytes`, the gateway's `max_request_body`.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 10 * 1024 * 1024;

/// Default route id: part of every fingerprint and record of the layer.
pub const DEFAULT_ROUTE_ID: &str = "default";

/// Everything one layer decides with.
#[derive(Clone)]
pub(crate) struct Config<P> {
    pub route: String,
    pub key_policy: KeyPolicy,
    pub scope: Scope,
    pub project: Option<String>,
    pub header: HeaderName,
    pub replayed_header: HeaderName,
    pub keys: KeyRules,
    pub engine: Policy,
    pub on_store_error: Option<OnStoreError>,
    pub max_request_bytes: usize,
    pub principal: P,
    pub procedure: Option<Arc<dyn Procedure>>,
    /// Executions are spawned here when set, so a graceful shutdown can wait for them.
    pub tasks: Option<tokio_util::task::TaskTracker>,
}

impl<P> std::fmt::Debug for Config<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("route", &self.route)
            .field("key_policy", &self.key_policy)
            .field("scope", &self.scope)
            .field("header", &self.header)
            .field("engine", &self.engine)
            .field("on_store_error", &self.on_store_error())
            .finish_non_exhaustive()
    }
}

impl<P> Config<P> {
    pub fn new(principal: P) -> Self {
        Self {
            route: DEFAULT_ROUTE_ID.to_owned(),
            key_policy: KeyPolicy::default(),
            scope: Scope::Subject,
            project: None,
            header: IDEMPOTENCY_KEY,
            replayed_header: REPLAYED,
            keys: KeyRules::default(),
            engine: Policy::default(),
            on_store_error: None,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            principal,
            procedure: None,
            tasks: None,
        }
    }

    /// The configured choice, or the policy's default (fail closed only where a key is
    /// required: an accepted route works without dedup anyway).
    pub fn on_store_error(&self) -> OnStoreError {
        self.on_store_error.unwrap_or(match self.key_policy {
            KeyPolicy::Required => OnStoreError::FailClosed,
            KeyPolicy::Accepted | KeyPolicy::Prohibited => OnStoreError::FailOpen,
        })
    }

    /// Phase **policy + key**: `Ok(None)` passes the request through, `Ok(Some(raw))` is a
    /// validated key to deduplicate on, `Err` is the refusal to answer.
    pub fn read_key(&self, parts: &http::request::Parts) -> Result<Option<String>, Problem> {
        let mut lines = parts
            .headers
            .get_all(&self.header)
            .iter()
            .map(HeaderValue::as_bytes)
            .peekable();
        match self.key_policy {
            KeyPolicy::Prohibited if lines.peek().is_some() => Err(Problem::new(
                ProblemKind::KeyNotAllowed,
                format!("this endpoint does not take an {} header", self.header),
            )),
            KeyPolicy::Prohibited => Ok(None),
            KeyPolicy::Required | KeyPolicy::Accepted => {
                let raw = parse_header(lines)
                    .and_then(|raw| match raw {
                        Some(k) => self.keys.validate(&k).map(|()| Some(k)),
                        None => Ok(None),
                    })
                    .map_err(|e| {
                        Problem::new(ProblemKind::InvalidKey, e.to_string()).reason(e.reason.as_str())
                    })?;
                if raw.is_none() && self.key_policy == KeyPolicy::Required {
                    return Err(Problem::new(
                        ProblemKind::MissingKey,
                        format!("this endpoint requires an {} header", self.header),
                    ));
                }
                Ok(raw)
            }
        }
    }
}

impl<P: PrincipalSource> Config<P> {
    /// Phase **namespace**: the store key for this caller; a scope that needs a principal
    /// without one is `401 unauthenticated`.
    pub fn namespace(&self, parts: &http::request::Parts, raw: &str) -> Result<String, Problem> {
        let principal = self.principal.principal(parts).map(|p| match &self.project {
            Some(sentinel) => Principal {
                project: sentinel.clone(),
                ..p
            },
            None => p,
        });
        namespaced_key(self.scope, principal.as_ref(), raw).map_err(|_| {
            tracing::debug!(
                scope = %self.scope,
                "no principal for a scoped route: insert a Principal extension or choose Scope::Global"
            );
            Problem::new(
                ProblemKind::Unauthenticated,
                "this endpoint needs an authenticated caller",
            )
        })
    }
}
