//! [`IdempotencyLayer`]: the builder, one method per per-route option of the gateway.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use idemgate_core::engine::{Concurrency, Engine, LeaseExpiry};
use idemgate_core::key::KeyRules;
use idemgate_core::namespace::Scope;
use idemgate_core::store::{DynStore, Store};
use tower_layer::Layer;

use super::config::{Config, KeyPolicy, OnStoreError};
use super::service::Idempotency;
use crate::principal::{FromExtensions, PrincipalSource};
use crate::procedure::Procedure;

/// Applies [`Idempotency`] to a service: the gateway's lifecycle (SPEC section 4) for one route
/// or a group of routes that share settings.
///
/// Defaults, as the gateway's: policy [`KeyPolicy::Accepted`], scope [`Scope::Subject`]
/// (a request without a principal and with a key is answered `401`; choose
/// [`Scope::Global`] for anonymous APIs), retention 24 h, lease 30 s, `concurrent: wait` with a
/// 10 s `wait_timeout`, `on_lease_expiry: retry`, `max_response_bytes` 1 MiB, 5xx released,
/// header `Idempotency-Key`, replay header `Idempotent-Replayed`, request bodies up to 10 MiB,
/// and `on_store_error` fail-closed on `required` routes, fail-open otherwise.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idemgate_core::MemoryStore;
/// use idemgate_core::namespace::Scope;
/// use tower::{Service, ServiceExt};
/// use tower_idemgate::IdempotencyLayer;
///
/// # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
/// let store = Arc::new(MemoryStore::new(64 << 20));
/// let counter = Arc::new(std::sync::atomic::AtomicU32::new(0));
/// let seen = counter.clone();
/// let app = tower::service_fn(move |_req: http::Request<http_body_util::Full<bytes::Bytes>>| {
///     let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
///     async move {
///         let body = http_body_util::Full::new(bytes::Bytes::from(format!("order {n}")));
///         Ok::<_, std::convert::Infallible>(http::Response::builder().status(201).body(body).unwrap())
///     }
/// });
/// let mut svc = tower::ServiceBuilder::new()
///     .layer(IdempotencyLayer::new(store).required().scope(Scope::Global).retention(Duration::from_secs(3600)))
///     .service(app);
///
/// let req = || http::Request::post("/orders").header("idempotency-key", "k1").body("{}".into()).unwrap();
/// let first = svc.ready().await.unwrap().call(req()).await.unwrap();
/// assert_eq!(first.status(), 201);
/// # use http_body_util::BodyExt;
/// assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "order 1");
/// let again = svc.ready().await.unwrap().call(req()).await.unwrap();
/// assert_eq!(again.headers()["idempotent-replayed"], "true");
/// assert_eq!(again.into_body().collect().await.unwrap().to_bytes(), "order 1");
/// assert_eq!(counter.load(std::sync::atomic::Ordering::SeqCst), 1);
///
/// let no_key = http::Request::post("/orders").body("{}".into()).unwrap();
/// assert_eq!(svc.ready().await.unwrap().call(no_key).await.unwrap().status(), 400);
/// # });
/// ```
pub struct IdempotencyLayer<St, P = FromExtensions> {
    engine: Engine<St>,
    config: Arc<Config<P>>,
}

impl<St, P> Clone for IdempotencyLayer<St, P> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            config: self.config.clone(),
        }
    }
}

impl<St, P> std::fmt::Debug for IdempotencyLayer<St, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer over `store` with the default settings.
    #[must_use]
    pub fn new(store: Arc<St>) -> Self {
        Self {
            engine: Engine::new(store),
            config: Arc::new(Config::new(FromExtensions)),
        }
    }
}

impl IdempotencyLayer<Arc<dyn DynStore>> {
    /// A layer over a store chosen at run time. Each store call is boxed; prefer
    /// [`IdempotencyLayer::new`] when the store type is known.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idemgate_core::{DynStore, MemoryStore};
    /// use tower_idemgate::IdempotencyLayer;
    ///
    /// let store: Arc<dyn DynStore> = Arc::new(MemoryStore::new(1 << 20));
    /// let _layer = IdempotencyLayer::from_dyn(store);
    /// ```
    #[must_use]
    pub fn from_dyn(store: Arc<dyn DynStore>) -> Self {
        Self::new(Arc::new(store))
    }
}

impl<St, P: Clone> IdempotencyLayer<St, P> {
    fn with(mut self, f: impl FnOnce(&mut Config<P>)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The key policy ([`KeyPolicy::Accepted`] by default).
    #[must_use]
    pub fn policy(self, policy: KeyPolicy) -> Self {
        self.with(|c| c.key_policy = policy)
    }

    /// Shorthand for `policy(KeyPolicy::Required)`.
    #[must_use]
    pub fn required(self) -> Self {
        self.policy(KeyPolicy::Required)
    }

    /// Shorthand for `policy(KeyPolicy::Accepted)`.
    #[must_use]
    pub fn accepted(self) -> Self {
        self.policy(KeyPolicy::Accepted)
    }

    /// Shorthand for `policy(KeyPolicy::Prohibited)`.
    #[must_use]
    pub fn prohibited(self) -> Self {
        self.policy(KeyPolicy::Prohibited)
    }

    /// The route id: part of every fingerprint and record (a key reused on another route id is
    /// a 422). Default `"default"`. Give each layer its own when they share a store.
    #[must_use]
    pub fn route_id(self, id: impl Into<String>) -> Self {
        let id = id.into();
        self.with(|c| c.route = id)
    }

    /// How much of the principal keys are shared across ([`Scope::Subject`] by default).
    #[must_use]
    pub fn scope(self, scope: Scope) -> Self {
        self.with(|c| c.scope = scope)
    }

    /// A fixed project component (`_tenant`, `_platform`), whatever the caller's.
    #[must_use]
    pub fn project(self, sentinel: impl Into<String>) -> Self {
        let sentinel = sentinel.into();
        self.with(|c| c.project = Some(sentinel))
    }

    /// How long a completed outcome is replayed (24 h by default).
    #[must_use]
    pub fn retention(self, retention: Duration) -> Self {
        self.with(|c| c.engine.retention = retention)
    }

    /// How long a reservation stays owned without renewal (30 s; renewed while running).
    #[must_use]
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|c| c.engine.lease = lease)
    }

    /// What a duplicate of an in-flight request does ([`Concurrency::Wait`] by default).
    #[must_use]
    pub fn concurrent(self, concurrent: Concurrency) -> Self {
        self.with(|c| c.engine.concurrent = concurrent)
    }

    /// How long a duplicate waits for the owner before `409 request-in-flight` (10 s).
    #[must_use]
    pub fn wait_timeout(self, wait: Duration) -> Self {
        self.with(|c| c.engine.wait_timeout = wait)
    }

    /// What happens when an owner died mid-way ([`LeaseExpiry::Retry`] by default).
    #[must_use]
    pub fn on_lease_expiry(self, rule: LeaseExpiry) -> Self {
        self.with(|c| c.engine.on_lease_expiry = rule)
    }

    /// The largest response body kept for replay (1 MiB). Larger outcomes are recorded
    /// without their body; their replays answer `409 response-not-retained`.
    #[must_use]
    pub fn max_response_bytes(self, bytes: usize) -> Self {
        self.with(|c| c.engine.max_response_bytes = bytes)
    }

    /// Store 5xx outcomes instead of releasing the key (Stripe style). Off by default.
    #[must_use]
    pub fn store_server_errors(self, store: bool) -> Self {
        self.with(|c| c.engine.store_server_errors = store)
    }

    /// What a request gets when the store fails (default by policy, see [`OnStoreError`]).
    #[must_use]
    pub fn on_store_error(self, rule: OnStoreError) -> Self {
        self.with(|c| c.on_store_error = Some(rule))
    }

    /// The key header (`Idempotency-Key`).
    #[must_use]
    pub fn header(self, name: HeaderName) -> Self {
        self.with(|c| c.header = name)
    }

    /// The header that marks replays (`Idempotent-Replayed`; `X-Idempotent-Replayed` for
    /// clients used to that convention).
    #[must_use]
    pub fn replayed_header(self, name: HeaderName) -> Self {
        self.with(|c| c.replayed_header = name)
    }

    /// Key rules: `max_key_length`, `key_pattern`, reserved prefixes (see [`KeyRules::new`]).
    #[must_use]
    pub fn key_rules(self, rules: KeyRules) -> Self {
        self.with(|c| c.keys = rules)
    }

    /// The largest request body read for fingerprinting (10 MiB); larger is `413`.
    #[must_use]
    pub fn max_request_bytes(self, bytes: usize) -> Self {
        self.with(|c| c.max_request_bytes = bytes)
    }

    /// Procedure hooks: `Idempotency-Status` on replays (see [`crate::procedure`]).
    #[must_use]
    pub fn procedure(self, procedure: impl Procedure) -> Self {
        let procedure: Arc<dyn Procedure> = Arc::new(procedure);
        self.with(|c| c.procedure = Some(procedure))
    }

    /// Spawns executions on `tracker`, so that a graceful shutdown can wait for every
    /// execution still running to complete or release its record:
    /// `tracker.close(); tracker.wait().await` after the server stopped accepting. The store
    /// calls of clients that went away mid-`begin` (which release a key taken for nobody) are
    /// tracked there too.
    #[must_use]
    pub fn task_tracker(mut self, tracker: tokio_util::task::TaskTracker) -> Self {
        self.engine = self.engine.with_background(tracker.clone());
        self.with(|c| c.tasks = Some(tracker))
    }

    /// Where the caller comes from ([`FromExtensions`] by default).
    #[must_use]
    pub fn principal<P2: PrincipalSource>(self, source: P2) -> IdempotencyLayer<St, P2> {
        let c = Arc::try_unwrap(self.config).unwrap_or_else(|shared| (*shared).clone());
        IdempotencyLayer {
            engine: self.engine,
            config: Arc::new(Config {
                route: c.route,
                key_policy: c.key_policy,
                scope: c.scope,
                project: c.project,
                header: c.header,
                replayed_header: c.replayed_header,
                keys: c.keys,
                engine: c.engine,
                on_store_error: c.on_store_error,
                max_request_bytes: c.max_request_bytes,
                principal: source,
                procedure: c.procedure,
                tasks: c.tasks,
            }),
        }
    }
}

impl<St, P> IdempotencyLayer<St, P> {
    /// The engine (and through it the store) the layer calls.
    pub fn engine(&self) -> &Engine<St> {
        &self.engine
    }

    /// The recovery service of this route (`recovery: true` in the gateway, SPEC section 5):
    /// mount it at `{path}/by-idempotency-key/{key}` and `.../{key}/output`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use axum::routing::{get_service, post};
    /// use idemgate_core::MemoryStore;
    /// use tower_idemgate::{IdempotencyLayer, Scope};
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new(1 << 20))).scope(Scope::Global);
    /// let app: axum::Router = axum::Router::new()
    ///     .route("/orders", post(|| async { "created" }).route_layer(layer.clone()))
    ///     .route("/orders/by-idempotency-key/{key}", get_service(layer.recovery()))
    ///     .route("/orders/by-idempotency-key/{key}/output", get_service(layer.recovery()));
    /// ```
    pub fn recovery(&self) -> super::Recovery<St, P> {
        super::Recovery {
            engine: self.engine.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S, St, P> Layer<S> for IdempotencyLayer<St, P> {
    type Service = Idempotency<S, St, P>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            engine: self.engine.clone(),
            config: self.config.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tracker a server drains at shutdown also holds the engine's background store calls
    /// (an abandoned `begin` releasing a key taken for nobody).
    #[tokio::test]
    async fn the_task_tracker_also_tracks_abandoned_begins() {
        let tracker = tokio_util::task::TaskTracker::new();
        let layer = IdempotencyLayer::new(Arc::new(idemgate_core::MemoryStore::new(1 << 20)))
            .task_tracker(tracker.clone());
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        layer.engine.background().spawn(async move {
            let _ = finished.await;
        });
        assert_eq!(tracker.len(), 1);
        done.send(()).unwrap();
        tracker.close();
        tracker.wait().await;
    }
}
