//! Record stores for idemgate beyond the core's memory store, one module and one cargo feature
//! each, and the [`conformance`] suite that every store (memory included) must pass.
//!
//! - `embedded` (feature `embedded`, default): redb file, durable across `kill -9`.
//! - `redis` (feature `redis`): one string per record, `SET NX GET` and Lua scripts; several replicas.
//! - `postgres` (feature `postgres`): one row per record; several replicas.
//!
//! `docs/stores.md` in the repository explains the choices behind the shared stores.

#[cfg(any(feature = "redis", feature = "postgres"))]
pub mod codec;
#[cfg(feature = "embedded")]
pub mod embedded;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;

pub mod conformance;

#[cfg(feature = "postgres")]
pub use crate::postgres::{PostgresConfig, PostgresStore};
#[cfg(feature = "redis")]
pub use crate::redis::{RedisConfig, RedisStore};
#[cfg(feature = "embedded")]
pub use embedded::EmbeddedStore;
