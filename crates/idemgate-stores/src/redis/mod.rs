//! The Redis store (feature `redis`): records shared by several gateway replicas.
//!
//! Layout. One hash per record under `{prefix}:{<namespaced key>}` with the fields `st` (`f` in
//! flight, `c` completed), `tok` (16-byte lease token), `lease`, `exp`, `created`, `gen`
//! (decimal milliseconds and counters), `fp` (32-byte fingerprint), `route`, `op`, `resp`
//! (the encoded response, see [`crate::codec`]) and `w` (someone waits). The braces are a hash
//! tag: everything a record owns hashes to one slot, and every script touches one key, so the
//! layout runs unchanged on Redis Cluster.
//!
//! Atomicity. `begin`, `complete`, `release`, `renew` and `purge` are Lua scripts (the `.lua`
//! files beside this one) that mirror `idemgate_core::rules` line by line, fencing token
//! included; the conformance suite and the model test hold them to the same answers as the
//! Rust rules. One script call is one round trip, so a miss costs two (begin, complete).
//!
//! Time. The rules compare against the caller's clock (`now`), never Redis's. The physical key
//! expiry (`PEXPIREAT`) is set [`EXPIRY_GRACE`] after the logical one, so a Redis clock that is
//! ahead of the gateways cannot drop a record early; until then an expired record reads as
//! absent anyway.
//!
//! Waiters. A `begin` that answers "in flight" marks the record (`w`); `complete`, `release`
//! and `purge` then `PUBLISH` the namespaced key on `{prefix}:done`, and every replica's
//! subscriber ([`subscriber`]) wakes its local waiters. Uncontended keys publish nothing.
//!
//! Failures. Every call is bounded by the configured timeout ([`StoreError::Timeout`]);
//! connection errors are retried within that bound, which is safe because every operation is
//! idempotent for the lease owner (SPEC 10). Nothing connects at construction: a gateway starts
//! with Redis down and connects when it comes back.

mod subscriber;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, RecordState, StoredResponse};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::codec::{corrupt, decode_response, encode_response, fingerprint_from, token_bytes, token_from};

/// How long after its logical expiry Redis drops a record's key: a bound on the clock skew
/// between the gateways and Redis that cannot cost a record.
pub const EXPIRY_GRACE: Duration = Duration::from_secs(60);

/// How to reach Redis.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port/db` (or `rediss://` is refused: no TLS yet).
    pub url: String,
    /// Prefix of every key and of the notification channel (default `idemgate`).
    pub prefix: String,
    /// Bound on every store call, connection included.
    pub timeout: Duration,
}

impl RedisConfig {
    /// Defaults for `url`: prefix `idemgate`, timeout 2 s.
    #[must_use]
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: "idemgate".into(),
            timeout: Duration::from_secs(2),
        }
    }
}

/// Why a Redis store could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisConfigError {
    #[error("invalid redis url")]
    Url(#[source] RedisError),
}

/// Checks a Redis URL without connecting (for configuration errors at start).
///
/// # Errors
/// The URL is not a Redis URL this build can use.
pub fn check_url(url: &str) -> Result<(), RedisConfigError> {
    redis::Client::open(url).map(drop).map_err(RedisConfigError::Url)
}

struct Scripts {
    begin: Script,
    complete: Script,
    release: Script,
    renew: Script,
    purge: Script,
    sweep: Script,
}

/// Records in Redis, shared by every replica pointed at the same server.
pub struct RedisStore {
    client: redis::Client,
    conn: OnceCell<ConnectionManager>,
    prefix: String,
    channel: String,
    timeout: Duration,
    scripts: Scripts,
    notifier: Arc<Notifier>,
    round_trips: AtomicU64,
    subscriber: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        self.subscriber.abort();
    }
}

impl RedisStore {
    /// Builds the store and starts its notification subscriber. Connects lazily: Redis may be
    /// down now. Must run inside a Tokio runtime.
    ///
    /// # Errors
    /// The URL is not a Redis URL.
    pub fn new(config: &RedisConfig) -> Result<Self, RedisConfigError> {
        let client = redis::Client::open(config.url.as_str()).map_err(RedisConfigError::Url)?;
        let notifier = Arc::new(Notifier::default());
        let channel = format!("{}:done", config.prefix);
        let subscriber = tokio::spawn(subscriber::run(
            client.clone(),
            channel.clone(),
            notifier.clone(),
            config.timeout,
        ));
        Ok(Self {
            client,
            conn: OnceCell::new(),
            prefix: config.prefix.clone(),
            channel,
            timeout: config.timeout,
            scripts: Scripts {
                begin: Script::new(include_str!("begin.lua")),
                complete: Script::new(include_str!("complete.lua")),
                release: Script::new(include_str!("release.lua")),
                renew: Script::new(include_str!("renew.lua")),
                purge: Script::new(include_str!("purge.lua")),
                sweep: Script::new(include_str!("sweep.lua")),
            },
            notifier,
            round_trips: AtomicU64::new(0),
            subscriber,
        })
    }

    /// Store calls sent to Redis so far (each one round trip), for measuring.
    #[must_use]
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// The Redis key of a record.
    #[must_use]
    pub fn record_key(&self, key: &str) -> String {
        format!("{}:{{{key}}}", self.prefix)
    }

    /// Deletes every record under this store's prefix that has expired at `now` and returns
    /// how many. Not needed in production (Redis drops expired keys itself,
    /// [`EXPIRY_GRACE`] after they expire); it scans the key space, so it is for tests and
    /// maintenance.
    ///
    /// # Errors
    /// Redis failed or did not answer in time.
    pub async fn sweep(&self, now: Millis) -> Result<usize, StoreError> {
        let pattern = format!("{}:{{*", self.prefix);
        let mut conn = self.conn().await?;
        let mut cursor = 0u64;
        let mut removed = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(StoreError::backend)?;
            for key in keys {
                let n: usize = self
                    .scripts
                    .sweep
                    .key(&key)
                    .arg(now)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(StoreError::backend)?;
                removed += n;
            }
            if next == 0 {
                return Ok(removed);
            }
            cursor = next;
        }
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        let conn = self
            .conn
            .get_or_try_init(|| async {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(self.timeout)
                    // Our own deadline bounds each call and `call` retries with its own short
                    // backoff; the manager only reconnects, once per failure. With retries of
                    // its own, a reconnect that failed during an outage slept in the manager's
                    // backoff (up to 200 ms plus jitter) and every call issued just after the
                    // store came back waited on that sleep past the store timeout (503s for
                    // half a second after each heal, found by tests/checker.rs).
                    .set_number_of_retries(0);
                ConnectionManager::new_with_config(self.client.clone(), config).await
            })
            .await
            .map_err(StoreError::backend)?;
        Ok(conn.clone())
    }

    /// Runs one script call (one round trip), retrying connection failures until the
    /// deadline. Retrying is safe: every operation is idempotent for the lease owner.
    async fn call<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        key: &str,
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let deadline = Instant::now() + self.timeout;
        let attempt = async {
            let mut backoff = Duration::from_millis(10);
            loop {
                let result = async {
                    let mut conn = self.conn().await?;
                    let mut invocation = script.key(self.record_key(key));
                    for arg in args {
                        invocation.arg(*arg);
                    }
                    self.round_trips.fetch_add(1, Ordering::Relaxed);
                    invocation
                        .invoke_async::<T>(&mut conn)
                        .await
                        .map_err(StoreError::backend)
                }
                .await;
                match result {
                    Err(StoreError::Backend(e)) if retryable(&*e) && Instant::now() + backoff < deadline => {
                        tracing::debug!(error = %e, "redis call failed; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_millis(200));
                    }
                    other => return other,
                }
            }
        };
        tokio::time::timeout_at(deadline, attempt)
            .await
            .map_err(|_| StoreError::Timeout)?
    }
}

/// Connection-class failures (refused, dropped, reset) are worth another try; a script error
/// or a bad reply is not.
fn retryable(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<RedisError>().is_some_and(|e| {
        e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
    })
}

/// Physical expiry for a logical one: [`EXPIRY_GRACE`] later, `0` for never (Redis cannot
/// represent the far future, and a record that never expires must not get a TTL).
fn pexpireat(expires_at: Millis) -> u64 {
    const FAR: Millis = 1 << 52;
    let grace = u64::try_from(EXPIRY_GRACE.as_millis()).unwrap_or(0);
    if expires_at >= FAR { 0 } else { expires_at + grace }
}

fn num(s: &[u8], what: &'static str) -> Result<u64, StoreError> {
    std::str::from_utf8(s)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| corrupt(what))
}

fn text(s: Vec<u8>, what: &'static str) -> Result<String, StoreError> {
    String::from_utf8(s).map_err(|_| corrupt(what))
}

fn ack(reply: &str) -> Result<(), StoreError> {
    match reply {
        "ok" => Ok(()),
        "fenced" => Err(idemgate_core::rules::Fenced.into()),
        _ => Err(corrupt("unexpected script reply")),
    }
}

/// Decodes the `begin` script's reply.
fn begin_answer(reply: Vec<Vec<u8>>, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
    let mut it = reply.into_iter();
    let mut next = || it.next().ok_or_else(|| corrupt("short begin reply"));
    let tag = next()?;
    Ok(match tag.as_slice() {
        b"acquired" => Begin::Acquired {
            operation_id: text(next()?, "operation id")?,
            generation: num(&next()?, "generation")?,
            took_over: next()? == b"1",
        },
        b"mismatch" => Begin::Mismatch {
            operation_id: text(next()?, "operation id")?,
        },
        b"inflight" => Begin::InFlight {
            operation_id: text(next()?, "operation id")?,
            lease_until: num(&next()?, "lease")?,
        },
        b"expired" => Begin::LeaseExpired {
            operation_id: text(next()?, "operation id")?,
        },
        b"replay" => {
            let token = token_from(&next()?)?;
            let operation_id = text(next()?, "operation id")?;
            let created_at = num(&next()?, "created")?;
            let expires_at = num(&next()?, "expiry")?;
            let generation = num(&next()?, "generation")?;
            let response = decode_response(&next()?)?;
            // A replay matched the request's fingerprint and route, so those are the request's.
            Begin::Replay(Box::new(Record {
                state: RecordState::Completed { token, response },
                fingerprint: req.fingerprint,
                route: req.route.to_owned(),
                operation_id,
                created_at,
                expires_at,
                generation,
            }))
        }
        _ => return Err(corrupt("unknown begin reply")),
    })
}

/// Decodes a record hash (`HGETALL`).
fn record_from(fields: std::collections::HashMap<String, Vec<u8>>) -> Result<Record, StoreError> {
    let mut fields = fields;
    let mut take = |name: &'static str| fields.remove(name).ok_or_else(|| corrupt(name));
    let token = token_from(&take("tok")?)?;
    let state = match take("st")?.as_slice() {
        b"f" => RecordState::InFlight {
            token,
            lease_until: num(&take("lease")?, "lease")?,
        },
        b"c" => RecordState::Completed {
            token,
            response: decode_response(&take("resp")?)?,
        },
        _ => return Err(corrupt("unknown record state")),
    };
    Ok(Record {
        state,
        fingerprint: fingerprint_from(&take("fp")?)?,
        route: text(take("route")?, "route")?,
        operation_id: text(take("op")?, "operation id")?,
        created_at: num(&take("created")?, "created")?,
        expires_at: num(&take("exp")?, "expiry")?,
        generation: num(&take("gen")?, "generation")?,
    })
}

impl Store for RedisStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        let lease_until = req.now + req.lease_ms;
        // The same expiry rules::begin gives a new record (see `rules::acquire`).
        let expires_at = if req.takeover {
            req.now + req.lease_ms.max(req.retention_ms)
        } else {
            Millis::MAX
        };
        let (now, lease_until, exp, px) = (
            req.now.to_string(),
            lease_until.to_string(),
            expires_at.to_string(),
            pexpireat(expires_at).to_string(),
        );
        let token = token_bytes(req.token);
        let args: [&[u8]; 9] = [
            now.as_bytes(),
            &token,
            &req.fingerprint.0,
            req.route.as_bytes(),
            req.operation_id.as_bytes(),
            lease_until.as_bytes(),
            exp.as_bytes(),
            px.as_bytes(),
            if req.takeover { b"1" } else { b"0" },
        ];
        let reply: Vec<Vec<u8>> = self.call(&self.scripts.begin, key, &args).await?;
        begin_answer(reply, req)
    }

    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        let expires_at = now + retention_ms;
        let (now, exp, px) = (
            now.to_string(),
            expires_at.to_string(),
            pexpireat(expires_at).to_string(),
        );
        let token = token_bytes(token);
        let body = encode_response(&response);
        let args: [&[u8]; 7] = [
            &token,
            now.as_bytes(),
            &body,
            exp.as_bytes(),
            px.as_bytes(),
            self.channel.as_bytes(),
            key.as_bytes(),
        ];
        let reply: String = self.call(&self.scripts.complete, key, &args).await?;
        ack(&reply)
    }

    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        let token = token_bytes(token);
        let args: [&[u8]; 3] = [&token, self.channel.as_bytes(), key.as_bytes()];
        let reply: String = self.call(&self.scripts.release, key, &args).await?;
        ack(&reply)
    }

    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        let token = token_bytes(token);
        let (until, px) = (lease_until.to_string(), pexpireat(lease_until).to_string());
        let args: [&[u8]; 3] = [&token, until.as_bytes(), px.as_bytes()];
        let reply: String = self.call(&self.scripts.renew, key, &args).await?;
        ack(&reply)
    }

    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        let fetch = async {
            let mut conn = self.conn().await?;
            self.round_trips.fetch_add(1, Ordering::Relaxed);
            redis::cmd("HGETALL")
                .arg(self.record_key(key))
                .query_async::<std::collections::HashMap<String, Vec<u8>>>(&mut conn)
                .await
                .map_err(StoreError::backend)
        };
        let fields = tokio::time::timeout(self.timeout, fetch)
            .await
            .map_err(|_| StoreError::Timeout)??;
        if fields.is_empty() {
            return Ok(None);
        }
        Ok(Some(record_from(fields)?).filter(|r| r.is_live(now)))
    }

    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        let args: [&[u8]; 2] = [self.channel.as_bytes(), key.as_bytes()];
        let n: u64 = self.call(&self.scripts.purge, key, &args).await?;
        Ok(n > 0)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let ping = async {
            let mut conn = self.conn().await?;
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map(drop)
                .map_err(StoreError::backend)
        };
        tokio::time::timeout(self.timeout, ping)
            .await
            .map_err(|_| StoreError::Timeout)?
    }

    fn remote(&self) -> bool {
        true
    }

    fn notifier(&self) -> &Arc<Notifier> {
        &self.notifier
    }
}
