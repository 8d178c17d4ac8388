//! idemgate as a library: the same engine, stores and semantics as the idemgate gateway, inside
//! your own Rust service.
//!
//! - [`IdempotencyLayer`] (module [`idempotency`]): a tower layer for axum and hyper services.
//!   Case A: the caller sends `Idempotency-Key`; the handler runs at most once per key within
//!   the retention window and every retry gets the original response.
//! - [`once`](mod@once): case C, handler-internal deduplication. The handler derives its own
//!   token from trusted signals and runs a closure at most once per token.
//! - `client` (feature `client`): a retrying reqwest client that sends one key per logical
//!   intent and retries only what is safe to retry.
//! - [`procedure`]: hooks that resolve a created resource's asynchronous status for
//!   `Idempotency-Status` on replays.
//!
//! The rules themselves (what is final, what is replayed, leases, waiting) live in
//! [`idemgate_core::Engine`]; this crate only calls it. Stores: [`idemgate_core::MemoryStore`],
//! and the embedded, Redis and PostgreSQL stores of the `idemgate-stores` crate, or any
//! `Arc<dyn idemgate_core::DynStore>`.
//!
//! `docs/library.md` in the repository records the decisions behind this crate.
//!
//! On a whole axum router (`Router::layer`), for anonymous callers:
//!
//! ```
//! use std::sync::Arc;
//! use axum::{Router, routing::post};
//! use idemgate_core::MemoryStore;
//! use tower::ServiceExt;
//! use tower_idemgate::{IdempotencyLayer, Scope};
//!
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
//! let store = Arc::new(MemoryStore::new(64 << 20));
//! let app = Router::new()
//!     .route("/orders", post(|body: String| async move { format!("created from {body}") }))
//!     .layer(IdempotencyLayer::new(store).scope(Scope::Global));
//! let req = || {
//!     http::Request::post("/orders").header("idempotency-key", "k").body(axum::body::Body::from("a")).unwrap()
//! };
//! let first = app.clone().oneshot(req()).await.unwrap();
//! assert!(first.headers().contains_key("x-operation-id"));
//! let replay = app.oneshot(req()).await.unwrap();
//! assert_eq!(replay.headers()["idempotent-replayed"], "true");
//! # });
//! ```

#![warn(missing_docs)]

pub mod idempotency;
pub mod once;
pub mod principal;
pub mod problem;
pub mod procedure;

#[cfg(feature = "client")]
pub mod client;

pub use idemgate_core::namespace::{Principal, Scope};
pub use idempotency::{
    Idempotency, IdempotencyInfo, IdempotencyLayer, KeyPolicy, OnStoreError, Recovery, RequestBody,
    ResponseBody, ResponseFuture,
};

pub use once::{Namespace, Once, OnceError, once};
pub use principal::{FromExtensions, PrincipalSource};
pub use problem::{Problem, ProblemKind};
