//! One JSON line per request (SPEC 12). The key appears only as a short digest; raw keys,
//! tokens and bodies are never written.

use std::time::Instant;

/// Fields gathered while a request is handled, emitted once at its end.
#[derive(Debug)]
pub struct AccessLog {
    /// When the request arrived; read only when access lines are written (the clock read was
    /// one of every request's half dozen).
    pub started: Option<Instant>,
    pub method: http::Method,
    /// The route's id, once a route matched.
    pub endpoint: Option<std::sync::Arc<str>>,
    pub policy: &'static str,
    /// `A` (caller's header), or `none` when the request was not deduplicated.
    pub case: &'static str,
    /// Where the key came from: `header` or `none`.
    pub source: &'static str,
    pub key_digest: String,
    pub operation_id: String,
    pub cache_hit: bool,
    /// What the engine did: `executed`, `replayed`, `released`, `refused`, `forwarded`, ...
    pub outcome: &'static str,
    pub tenant: String,
    pub project: String,
    /// A deduplicating route got no key (refused under `required`, forwarded under `accepted`).
    pub key_missing: bool,
    /// The request waited for another owner of its key.
    pub waited: bool,
    /// The outcome was stored for replay.
    pub stored: bool,
    /// A store call failed for this request.
    pub store_error: bool,
    /// The problem idemgate answered with, if any, and its reason.
    pub refusal: Option<crate::problem::Kind>,
    pub reason: Option<&'static str>,
}

impl AccessLog {
    #[must_use]
    pub fn new(method: &http::Method) -> Self {
        Self {
            started: lines_written().then(Instant::now),
            // A clone of a standard method allocates nothing; `to_owned` of its name did, per request.
            method: method.clone(),
            endpoint: None,
            policy: "",
            case: "none",
            source: "none",
            key_digest: String::new(),
            operation_id: String::new(),
            cache_hit: false,
            outcome: "forwarded",
            tenant: String::new(),
            project: String::new(),
            key_missing: false,
            waited: false,
            stored: false,
            store_error: false,
            refusal: None,
            reason: None,
        }
    }

    /// Records the namespaced key, as its digest. The digest (a SHA-256) is only computed when
    /// access lines are written at all.
    pub fn set_key(&mut self, key: &str) {
        if lines_written() {
            self.key_digest = idemgate_core::namespace::key_digest(key);
        }
    }

    /// Records the operation id, only when access lines are written at all (the copy was one
    /// of a replay's allocations).
    pub fn set_operation_id(&mut self, id: &str) {
        if lines_written() {
            id.clone_into(&mut self.operation_id);
        }
    }

    /// Records who called (tenant and project only: the subject may identify a person).
    pub fn set_principal(&mut self, p: Option<&idemgate_core::namespace::Principal>) {
        if let Some(p) = p {
            self.tenant.clone_from(&p.tenant);
            self.project.clone_from(&p.project);
        }
    }

    /// Writes the line.
    pub fn emit(&self, status: u16) {
        tracing::info!(
            target: "idemgate::access",
            method = %self.method,
            endpoint = self.endpoint.as_deref().unwrap_or(""),
            idempotency_policy = self.policy,
            idempotency_case = self.case,
            idempotency_source = self.source,
            idempotency_key_namespaced = %self.key_digest,
            operation_id = %self.operation_id,
            cache_hit = self.cache_hit,
            outcome = self.outcome,
            tenant = %self.tenant,
            project = %self.project,
            status,
            latency_ms = self.started.map_or(0.0, |at| at.elapsed().as_secs_f64() * 1000.0),
            "request"
        );
    }
}

/// Whether access lines are written at all: the fields only a line reads are gathered then.
fn lines_written() -> bool {
    tracing::enabled!(target: "idemgate::access", tracing::Level::INFO)
}
