//! The idemgate gateway as a library: the binary in `main.rs` is a thin command line over these
//! pieces, and the black-box tests and the demo use them too.
//!
//! - [`config`]: the YAML contract, resolved and checked.
//! - [`routes`]: path templates and first-match routing.
//! - [`proxy`]: the request phases (framing, route, policy, dedup, execute).
//! - [`framing`]: a strict second reading of request heads against smuggling shapes.
//! - [`identity`]: API keys, JWTs and trusted headers: who is calling.
//! - [`metrics`]: Prometheus metrics and per-route stats.
//! - [`openapi`]: the OpenAPI document of the client-facing routes.
//! - [`problem`]: RFC 9457 responses, the one place mapping refusals to status codes.
//! - [`store`]: the configured store behind one enum.
//! - [`server`]: the listener and graceful shutdown.
//! - [`upstream`]: the upstream connection pool.
//! - [`restate`]: Restate upstreams: Restate deduplicates, idemgate namespaces (SPEC 9).
//! - [`webhook`]: case B: registry, provider signatures, delivery identifiers.
//! - [`admin`]: the admin listener: health, readiness, metrics, stats, records.
//! - [`access_log`]: the per-request JSON line.
//! - [`demo`]: a counting demo upstream.

pub mod access_log;
pub mod admin;
pub mod body;
mod clock;
pub mod config;
pub mod demo;
mod detach;
pub mod framing;
mod head_timer;
pub mod identity;
pub mod metrics;
pub mod openapi;
pub mod problem;
pub mod proxy;
pub mod restate;
pub mod routes;
pub mod server;
pub mod store;
pub mod upstream;
pub mod webhook;
