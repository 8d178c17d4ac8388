//! Record stores for idemgate beyond the core's memory store, one module and one cargo feature
//! each, and the [`conformance`] suite that every store (memory included) must pass.
//!
//! - `embedded` (feature `embedded`, default): redb file, durable across `kill -9`.

#[cfg(feature = "embedded")]
pub mod embedded;

pub mod conformance;

#[cfg(feature = "embedded")]
pub use embedded::EmbeddedStore;
