//! Case C, handler-internal deduplication: run a closure at most once per dedup token.
//!
//! Some operations carry no `Idempotency-Key`: a scheduler tick, a message from a queue that
//! redelivers, a webhook the handler verifies itself, an internal step of a larger request. The
//! handler then derives its own token from signals it trusts (the message id the broker
//! assigned, `{schedule_id}:{fire_time}`, the provider's event id after checking the signature,
//! an invoice id and a billing period) and calls [`once`]:
//!
//! - the first call with a token runs the closure, stores its `Ok` value (as JSON) and returns
//!   it; the value is durable before the caller sees it;
//! - later calls with the same token and fingerprint get the stored value without running the
//!   closure; concurrent callers wait for the first (by notification, up to `wait_timeout`);
//! - an `Err`, or a panic, releases the token: the next call runs the closure again. A failure
//!   that must *not* be retried (a declined card) belongs in the `Ok` value, e.g.
//!   `Ok(Outcome::Declined)`;
//! - the same token with another fingerprint is [`OnceError::Mismatch`], never the stored value.
//!
//! The closure runs in its own task, so it finishes even if the caller's future is dropped, and
//! its outcome is recorded either way. It is the same [`Engine`] as the layer's: leases are
//! renewed while the closure runs, and a dead process's token is taken over after the lease.
//!
//! A handler deriving its token from trusted signals (`examples/handler_internal.rs` runs a
//! full service around it):
//!
//! ```
//! use std::sync::Arc;
//! use idemgate_core::MemoryStore;
//! use tower_idemgate::once::{Namespace, fingerprint, once};
//!
//! #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
//! struct Charge { id: String, cents: u64 }
//!
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
//! let store = Arc::new(MemoryStore::new(1 << 20));
//! // The broker's delivery id and the invoice are trusted: the token is derived from them,
//! // never from anything the sender could vary between redeliveries.
//! let (message_id, invoice, cents) = ("msg-42", "inv-7", 1_250u64);
//! let ns = Namespace::global("charge-invoice");
//! let token = format!("{invoice}:{message_id}");
//! let fp = fingerprint(&(invoice, cents));
//! let charge = |n: u32| async move {
//!     Ok::<_, std::io::Error>(Charge { id: format!("ch_{n}"), cents: 1_250 })
//! };
//! let first = once(&store, &ns, &token, fp, charge(1)).await.unwrap();
//! let redelivered = once(&store, &ns, &token, fp, charge(2)).await.unwrap();
//! assert_eq!(first, Charge { id: "ch_1".into(), cents: 1_250 });
//! assert_eq!(redelivered, first); // the second closure never ran
//! # });
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate_core::engine::{Concurrency, Engine, LeaseExpiry, Outcome, Policy, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::namespace::{Principal, Scope, namespaced_key};
use idemgate_core::record::StoredResponse;
use idemgate_core::store::{Store, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;

/// Where a token lives: the operation it dedups, and the scope and principal it is private to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace {
    operation: String,
    scope: Scope,
    principal: Option<Principal>,
}

impl Namespace {
    /// A token shared by every caller: for tokens that are unique by construction (a broker's
    /// message id, a provider's event id).
    pub fn global(operation: impl Into<String>) -> Self {
        Self {
            operation: operation.into(),
            scope: Scope::Global,
            principal: None,
        }
    }

    /// A token private to `principal` at `scope` (tenant, project or subject).
    pub fn scoped(operation: impl Into<String>, scope: Scope, principal: Principal) -> Self {
        Self {
            operation: operation.into(),
            scope,
            principal: Some(principal),
        }
    }

    /// The operation name (the record's route).
    #[must_use]
    pub fn operation(&self) -> &str {
        &self.operation
    }

    /// The store key of `token`: the namespaced key of `{operation}/{token}`, with `%` and `/`
    /// of the operation escaped so that (operation, token) pairs never collide.
    ///
    /// ```
    /// use tower_idemgate::once::Namespace;
    /// let ns = Namespace::global("a/b");
    /// assert_ne!(ns.key("c").unwrap(), Namespace::global("a").key("b/c").unwrap());
    /// ```
    ///
    /// # Errors
    /// A non-global scope without a principal cannot happen through the constructors; the
    /// error is kept for completeness.
    pub fn key(&self, token: &str) -> Result<String, idemgate_core::namespace::NamespaceError> {
        let op = self.operation.replace('%', "%25").replace('/', "%2F");
        namespaced_key(self.scope, self.principal.as_ref(), &format!("{op}/{token}"))
    }
}

/// The fingerprint of what the token stands for: canonical JSON of `value` (key order and
/// whitespace do not matter), so a token reused for a different request is caught.
///
/// ```
/// use tower_idemgate::once::fingerprint;
/// assert_eq!(
///     fingerprint(&serde_json::json!({"a": 1, "b": 2})),
///     fingerprint(&serde_json::json!({"b": 2, "a": 1})),
/// );
/// assert_ne!(fingerprint(&("inv-1", 100)), fingerprint(&("inv-1", 200)));
/// ```
#[must_use]
pub fn fingerprint(value: &impl Serialize) -> Fingerprint {
    let json = serde_json::to_vec(value).unwrap_or_default();
    Fingerprint::compute("once", "ONCE", "/", Some("application/json"), &json)
}

/// Why [`once`] did not return a value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// The closure failed; the token was released, a later call runs it again.
    #[error("the operation failed; the token was released")]
    Failed(E),
    /// The token is in use for a different fingerprint or operation.
    #[error("the dedup token was used for a different operation or input")]
    Mismatch {
        /// The record's operation id.
        operation_id: String,
    },
    /// Another call holds the token and did not finish within `wait_timeout`.
    #[error("another call with this token is still running")]
    InFlight {
        /// The running call's operation id.
        operation_id: String,
        /// When its lease ends: the earliest moment another answer is possible.
        retry_after: Duration,
    },
    /// The owner died and the rule is [`LeaseExpiry::Fail`].
    #[error("the outcome of an earlier call with this token is unknown")]
    OutcomeUnknown {
        /// The dead owner's operation id.
        operation_id: String,
    },
    /// The value was stored without its body (over `max_value_bytes`): it ran, but cannot be
    /// returned again.
    #[error("the stored value was too large to keep")]
    NotRetained {
        /// The record's operation id.
        operation_id: String,
    },
    /// The store failed; nothing ran.
    #[error("the idempotency store failed")]
    Store(#[source] StoreError),
    /// The value could not be encoded; it ran, the token was released.
    #[error("the value could not be encoded as JSON")]
    Encode(#[source] serde_json::Error),
    /// The stored value does not decode as the requested type.
    #[error("the stored value does not decode as the requested type")]
    Decode(#[source] serde_json::Error),
    /// The runtime shut down under the closure.
    #[error("the operation was cancelled")]
    Cancelled,
}

/// [`once`] with settings: retention, lease, waiting, the size limit of stored values.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idemgate_core::MemoryStore;
/// use tower_idemgate::once::{Namespace, Once, OnceError, fingerprint};
///
/// # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
/// let runner = Once::new(Arc::new(MemoryStore::new(1 << 20))).retention(Duration::from_secs(7 * 86_400));
/// let ns = Namespace::global("send-receipt");
/// // A failure releases the token...
/// let failed = runner.run(&ns, "order-9", fingerprint(&9), async { Err::<u32, _>("smtp down") }).await;
/// assert!(matches!(failed, Err(OnceError::Failed("smtp down"))));
/// // ...so the retry runs, and from then on the token is done.
/// assert_eq!(runner.run(&ns, "order-9", fingerprint(&9), async { Ok::<_, &str>(1) }).await.unwrap(), 1);
/// assert_eq!(runner.run(&ns, "order-9", fingerprint(&9), async { Ok::<_, &str>(2) }).await.unwrap(), 1);
/// # });
/// ```
pub struct Once<St> {
    engine: Engine<St>,
    policy: Policy,
}

impl<St> Clone for Once<St> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            policy: self.policy.clone(),
        }
    }
}

impl<St> std::fmt::Debug for Once<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Once")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl<St: Store> Once<St> {
    /// The gateway's defaults: retention 24 h, lease 30 s, wait up to 10 s, 1 MiB values.
    #[must_use]
    pub fn new(store: Arc<St>) -> Self {
        Self {
            engine: Engine::new(store),
            policy: Policy::default(),
        }
    }

    /// How long a stored value is returned.
    #[must_use]
    pub fn retention(mut self, d: Duration) -> Self {
        self.policy.retention = d;
        self
    }

    /// The lease while the closure runs (renewed in the background).
    #[must_use]
    pub fn lease(mut self, d: Duration) -> Self {
        self.policy.lease = d;
        self
    }

    /// Wait for a running call ([`Concurrency::Wait`]) or refuse at once.
    #[must_use]
    pub fn concurrent(mut self, c: Concurrency) -> Self {
        self.policy.concurrent = c;
        self
    }

    /// How long a concurrent call waits for the running one.
    #[must_use]
    pub fn wait_timeout(mut self, d: Duration) -> Self {
        self.policy.wait_timeout = d;
        self
    }

    /// Take over a dead owner's token ([`LeaseExpiry::Retry`]) or report it unknown.
    #[must_use]
    pub fn on_lease_expiry(mut self, rule: LeaseExpiry) -> Self {
        self.policy.on_lease_expiry = rule;
        self
    }

    /// The largest stored value, as JSON bytes.
    #[must_use]
    pub fn max_value_bytes(mut self, bytes: usize) -> Self {
        self.policy.max_response_bytes = bytes;
        self
    }

    /// Runs `f` at most once per `token` in `ns` (see the [module docs](self)).
    ///
    /// # Errors
    /// See [`OnceError`].
    ///
    /// # Panics
    /// Re-raises a panic of `f`, after releasing the token.
    pub async fn run<T, E, F>(
        &self,
        ns: &Namespace,
        token: &str,
        fingerprint: Fingerprint,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        F: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
    {
        let key = ns
            .key(token)
            .map_err(|e| OnceError::Store(StoreError::backend(e)))?;
        let started = self
            .engine
            .begin(&key, &ns.operation, fingerprint, &self.policy)
            .await
            .map_err(OnceError::Store)?;
        let exec = match started {
            Started::Execute(exec) => exec,
            Started::Replay { response, .. } => {
                let body = response.body.unwrap_or_default();
                return serde_json::from_slice(&body).map_err(OnceError::Decode);
            }
            Started::NotRetained { operation_id, .. } => return Err(OnceError::NotRetained { operation_id }),
            Started::Mismatch { operation_id } => return Err(OnceError::Mismatch { operation_id }),
            Started::InFlight {
                operation_id,
                retry_after,
            } => {
                return Err(OnceError::InFlight {
                    operation_id,
                    retry_after,
                });
            }
            Started::OutcomeUnknown { operation_id } => {
                return Err(OnceError::OutcomeUnknown { operation_id });
            }
        };
        // Paused past the lease since `begin`: another caller may have taken the key over and
        // run `f` (`Execution::lease_held`). The key is released if it is still ours.
        if !exec.lease_held() {
            let operation_id = exec.operation_id().to_owned();
            exec.withdraw().await;
            return Err(OnceError::InFlight {
                operation_id,
                retry_after: Duration::from_secs(1),
            });
        }
        let max = self.policy.max_response_bytes;
        let (tx, rx) = oneshot::channel();
        // A supervising task: it records the outcome even if this future is dropped.
        tokio::spawn(async move {
            // The closure in a task of its own, so a panic arrives as a JoinError.
            let result = match tokio::spawn(f).await {
                Ok(Ok(value)) => match serde_json::to_vec(&value) {
                    Ok(json) => {
                        let body = (json.len() <= max).then(|| Bytes::from(json));
                        let stored = StoredResponse {
                            status: 200,
                            headers: vec![(
                                "content-type".to_owned(),
                                Bytes::from_static(b"application/json"),
                            )],
                            body,
                        };
                        record(exec, Outcome::Response(stored)).await;
                        Ok(Ok(value))
                    }
                    Err(e) => {
                        record(exec, Outcome::NoResponse).await;
                        Ok(Err(OnceError::Encode(e)))
                    }
                },
                Ok(Err(e)) => {
                    record(exec, Outcome::NoResponse).await;
                    Ok(Err(OnceError::Failed(e)))
                }
                Err(join) => {
                    record(exec, Outcome::NoResponse).await;
                    match join.try_into_panic() {
                        Ok(panic) => Err(panic),
                        Err(_) => Ok(Err(OnceError::Cancelled)),
                    }
                }
            };
            let _ = tx.send(result);
        });
        match rx.await {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(_) => Err(OnceError::Cancelled),
        }
    }
}

async fn record<St: Store>(exec: idemgate_core::Execution<St>, outcome: Outcome) {
    if let Err(e) = exec.finish(outcome).await {
        tracing::error!(error = %e, "once: could not record the outcome");
    }
}

/// Runs `f` at most once per `token` in `ns`, with the default settings of [`Once`].
///
/// # Errors
/// See [`OnceError`].
///
/// # Panics
/// Re-raises a panic of `f`, after releasing the token.
pub async fn once<St, T, E, F>(
    store: &Arc<St>,
    ns: &Namespace,
    token: &str,
    fingerprint: Fingerprint,
    f: F,
) -> Result<T, OnceError<E>>
where
    St: Store,
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Serialize + DeserializeOwned + Send + 'static,
    E: Send + 'static,
{
    Once::new(store.clone()).run(ns, token, fingerprint, f).await
}
