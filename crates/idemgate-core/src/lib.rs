//! The core of idemgate: everything that decides what a deduplicated request does, with no
//! network or storage dependency beyond the in-process [`memory::MemoryStore`].
//!
//! - [`key`]: parsing and validating the `Idempotency-Key` header (SPEC section 3).
//! - [`namespace`]: principals, scopes and the injective namespaced key (SPEC section 1).
//! - [`fingerprint`]: the request fingerprint with JSON canonicalization.
//! - [`record`]: what a store keeps per key.
//! - [`rules`]: the record transitions every store applies atomically.
//! - [`store`]: the [`store::Store`] trait.
//! - [`notify`]: in-process wake-ups for waiters.
//! - [`engine`]: begin / execute / finish, waiting and lease renewal (SPEC section 4).
//! - [`problem`]: the refusal table (slugs, titles, statuses) and the problem+json body.
//! - [`headers`]: what a record keeps of a response's headers, and what a replay adds (SPEC
//!   section 5), for the gateway and the tower layer alike.
//! - [`memory`]: the sharded, bounded memory store.

mod begin_call;
pub mod engine;
pub mod fingerprint;
pub mod headers;
pub mod key;
mod lead;
pub mod memory;
pub mod namespace;
pub mod notify;
pub mod problem;
pub mod record;
mod renew;
pub mod rules;
pub mod store;

pub use engine::{Concurrency, Engine, Execution, Finished, LeaseExpiry, Lookup, Outcome, Policy, Started};
pub use fingerprint::Fingerprint;
pub use memory::MemoryStore;
pub use record::{LeaseToken, Millis, Record, RecordState, StoredResponse};
pub use rules::{Begin, BeginRequest};
pub use store::{DynStore, Store, StoreError};
