//! The Redis store (feature `redis`): records shared by several gateway replicas.
//!
//! Layout. One string per record under `{prefix}:{<namespaced key>}`: a fixed header (state,
//! waiter flag, token, fingerprint, lease, expiry, created, generation), then route, operation
//! id and, once completed, the encoded response (`layout.rs`). The braces are a hash tag:
//! everything a record owns hashes to one slot, and every command touches one key, so the
//! layout runs unchanged on Redis Cluster.
//!
//! Atomicity. `begin` is `SET key <new record> NX PXAT <expiry> GET`: on an absent key that is
//! the whole decision, one command and no script (a Lua call cost Redis about 6 µs on top of the
//! commands inside it). When a record is there, `SET NX` leaves it and returns it, and
//! `idemgate_core::rules::begin` decides on it here; a decision that writes (a new owner for an
//! expired record, or marking that someone waits) is applied by the `swap` script only if the
//! record's header is unchanged, else `begin` asks again. `complete`, `release`, `renew` and
//! `purge` are Lua scripts (the `.lua` files beside this one) that mirror the rules line by line,
//! fencing token included; the conformance suite and the model test hold the store to the same
//! answers as the Rust rules. On a server that takes `SET … IFEQ` (Valkey 8.1+, Redis 8.4+),
//! `complete` and `renew` first try to replace the exact value this replica last wrote (its
//! `begin` or its last renewal), with no script (`written.rs`); any other value leaves that `SET`
//! without effect and the script decides. A miss
//! costs two round trips (`SET`, `complete`), a replay one (on a server with `IFEQ`, three when a
//! waiter marked the record in between: the `SET` that finds it changed, then the script).
//!
//! Time. The rules compare against the caller's clock (`now`), never Redis's. The physical key
//! expiry (`PEXPIREAT`) is set [`EXPIRY_GRACE`] after the logical one, so a Redis clock that is
//! ahead of the gateways cannot drop a record early; until then an expired record reads as
//! absent anyway.
//!
//! Waiters. A `begin` that answers "in flight" sets the record's waiter flag; `complete`,
//! `release` and `purge` then `PUBLISH` the namespaced key on `{prefix}:done`, and every replica's
//! subscriber (`subscriber.rs`) wakes its local waiters. Uncontended keys publish nothing.
//!
//! Failures. Every call is bounded by the configured timeout ([`StoreError::Timeout`]);
//! connection errors are retried within that bound, which is safe because every operation is
//! idempotent for the lease owner (SPEC 10). A Redis that refuses writes (full, read-only)
//! still answers the `begin`s a read can answer: replays above all. Nothing connects at
//! construction: a gateway starts with Redis down and connects when it comes back.

mod layout;
mod subscriber;
mod written;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, RecordState, StoredResponse};
use idemgate_core::rules::{self, Begin, BeginRequest, Write};
use idemgate_core::store::{Store, StoreError};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::codec::{corrupt, encode_response, token_bytes};
use layout::Decimal;
use written::{Kept, Written};

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
    swap: Script,
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
    written: Written,
    round_trips: AtomicU64,
    swapped: AtomicU64,
    /// Renewals made by `SET … IFEQ`, without the `renew` script.
    renewed: AtomicU64,
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
                swap: Script::new(include_str!("swap.lua")),
                complete: Script::new(include_str!("complete.lua")),
                release: Script::new(include_str!("release.lua")),
                renew: Script::new(include_str!("renew.lua")),
                purge: Script::new(include_str!("purge.lua")),
                sweep: Script::new(include_str!("sweep.lua")),
            },
            notifier,
            written: Written::default(),
            round_trips: AtomicU64::new(0),
            swapped: AtomicU64::new(0),
            renewed: AtomicU64::new(0),
            subscriber,
        })
    }

    /// Store calls sent to Redis so far (each one round trip), for measuring.
    #[must_use]
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// `complete`s done by `SET … IFEQ` rather than the script, for measuring.
    #[must_use]
    pub fn completes_without_script(&self) -> u64 {
        self.swapped.load(Ordering::Relaxed)
    }

    /// `renew`s done by `SET … IFEQ` rather than the script, for measuring.
    #[must_use]
    pub fn renewals_without_script(&self) -> u64 {
        self.renewed.load(Ordering::Relaxed)
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
        let pattern = &format!("{}:{{*", self.prefix);
        let mut cursor = 0u64;
        let mut removed = 0;
        loop {
            // Through `retrying`, like every other command: bounded by the store's timeout
            // (the connection has no bound of its own, see `conn`).
            let (next, keys): (u64, Vec<String>) = self
                .retrying(self.deadline(), move |mut conn| async move {
                    let mut scan = redis::cmd("SCAN");
                    scan.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000);
                    scan.query_async(&mut conn).await
                })
                .await?;
            for key in &keys {
                let script = &self.scripts.sweep;
                let n: usize = self
                    .retrying(self.deadline(), move |mut conn| async move {
                        let mut invocation = script.key(key);
                        invocation.arg(now);
                        invocation.invoke_async(&mut conn).await
                    })
                    .await?;
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
                    .set_connection_timeout(Some(self.timeout))
                    // Our own deadline bounds each call and `call` retries with its own short
                    // backoff; the manager only reconnects, once per failure. With retries of
                    // its own, a reconnect that failed during an outage slept in the manager's
                    // backoff (up to 200 ms plus jitter) and every call issued just after the
                    // store came back waited on that sleep past the store timeout (503s for
                    // half a second after each heal, found by tests/checker.rs).
                    .set_number_of_retries(0)
                    // The same deadline bounds every command. redis-rs's own default (500 ms
                    // per command) cut every call short of a longer configured `timeout` (each
                    // attempt failed at 500 ms and was retried until the deadline), and armed a
                    // second timer beside ours on every command.
                    .set_response_timeout(None);
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
        deadline: Instant,
        script: &Script,
        key: &str,
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let key = &self.record_key(key);
        self.retrying(deadline, move |mut conn| async move {
            let mut invocation = script.key(key);
            for arg in args {
                invocation.arg(*arg);
            }
            invocation.invoke_async::<T>(&mut conn).await
        })
        .await
    }

    /// `begin`'s one command: writes `value` if the key is absent, and returns what was there.
    async fn set_nx_get(
        &self,
        deadline: Instant,
        key: &str,
        value: &[u8],
        pexpireat: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let key = &self.record_key(key);
        self.retrying(deadline, move |mut conn| async move {
            let mut cmd = redis::cmd("SET");
            cmd.arg(key).arg(value).arg("NX");
            if pexpireat != 0 {
                cmd.arg("PXAT").arg(pexpireat);
            }
            cmd.arg("GET").query_async(&mut conn).await
        })
        .await
        .map_err(|e| match e {
            // Redis before 7.0 refuses NX together with GET.
            StoreError::Backend(e) if e.to_string().contains("syntax error") => {
                StoreError::Backend(Box::new(NeedsRedis7(e)))
            }
            e => e,
        })
    }

    /// `complete`'s and `renew`'s command when the record is still what this replica last wrote:
    /// `SET key new IFEQ flight`, with the physical expiry `ttl` (`None`: the one it has); whether
    /// it was set.
    async fn set_ifeq(
        &self,
        deadline: Instant,
        key: &str,
        new: &[u8],
        flight: &[u8],
        ttl: Option<u64>,
    ) -> Result<bool, StoreError> {
        let key = &self.record_key(key);
        self.retrying(deadline, move |mut conn| async move {
            let mut cmd = redis::cmd("SET");
            cmd.arg(key).arg(new).arg("IFEQ").arg(flight);
            match ttl {
                None => {
                    cmd.arg("KEEPTTL");
                }
                // Never expires.
                Some(0) => {}
                Some(at) => {
                    cmd.arg("PXAT").arg(at);
                }
            }
            cmd.query_async::<Option<String>>(&mut conn).await
        })
        .await
        .map(|reply| reply.is_some())
    }

    /// What an error reply to a `SET … IFEQ` means for the store: the `SET` did not run, so the
    /// script decides (and answers the same error if the server refuses writes). A server
    /// without `IFEQ` answers with the generic code (`ERR syntax error` from Redis before 8.4
    /// and Valkey before 8.1); from then on this store does not try. The specific codes (`OOM`,
    /// `READONLY`, `WRONGTYPE`, `LOADING`, ...) concern this moment or this record. A connection
    /// failure that outlasted the retries is the call's error.
    fn ifeq_failed(&self, e: StoreError, command: &str) -> Result<(), StoreError> {
        match e {
            StoreError::Backend(e) if !retryable(&*e) => {
                if generic_error(&*e) {
                    tracing::info!(error = %e, "redis refused SET IFEQ (to {command}); complete and renew use their scripts");
                    self.written.refuse();
                }
                Ok(())
            }
            e => Err(e),
        }
    }

    /// A record's raw value.
    async fn get_raw(&self, deadline: Instant, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = &self.record_key(key);
        self.retrying(deadline, move |mut conn| async move {
            redis::cmd("GET").arg(key).query_async(&mut conn).await
        })
        .await
    }

    /// `begin` when Redis refuses writes (full under `noeviction`, a read-only replica, a failed
    /// snapshot): `SET NX` is a write even where it would only read, so the record is read
    /// instead and whatever a read can answer is answered (a replay, a mismatch, a key in flight,
    /// an attempt's own retry), as the whole-script `begin` did before. A key found in flight is
    /// not marked, so its waiters wake at the owner's lease end rather than by its message. A
    /// `begin` that would write gets Redis's refusal.
    async fn begin_read_only(
        &self,
        deadline: Instant,
        key: &str,
        req: &BeginRequest<'_>,
        refused: StoreError,
    ) -> Result<Begin, StoreError> {
        let Some(raw) = self.get_raw(deadline, key).await? else {
            return Err(refused);
        };
        match rules::begin_taking(&mut Some(layout::decode(&raw)?.record), req) {
            (answer, Write::Keep) => Ok(answer),
            _ => Err(refused),
        }
    }

    /// The deadline of a call that starts now.
    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// One round trip, retried on connection failures until `deadline`.
    async fn retrying<T, F>(
        &self,
        deadline: Instant,
        mut send: impl FnMut(ConnectionManager) -> F,
    ) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, RedisError>>,
    {
        let attempt = async {
            let mut backoff = Duration::from_millis(10);
            loop {
                let result = async {
                    let conn = self.conn().await?;
                    self.round_trips.fetch_add(1, Ordering::Relaxed);
                    send(conn).await.map_err(StoreError::backend)
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

/// The code of a Redis error reply (`ERR`, `OOM`, `WRONGTYPE`, ...).
fn reply_code<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a str> {
    e.downcast_ref::<RedisError>().and_then(RedisError::code)
}

/// An error reply with the generic code `ERR`, as servers refuse arguments they do not parse.
fn generic_error(e: &(dyn std::error::Error + 'static)) -> bool {
    reply_code(e) == Some("ERR")
}

/// Redis refused a write it would otherwise make: full (`maxmemory` under `noeviction`), a
/// read-only replica, too few replicas, or a failed snapshot that stops writes.
fn refuses_writes(e: &StoreError) -> bool {
    let StoreError::Backend(e) = e else { return false };
    reply_code(&**e).is_some_and(|code| matches!(code, "OOM" | "READONLY" | "NOREPLICAS" | "MISCONF"))
}

/// `SET NX GET` refused as a syntax error: a server older than 7.0.
#[derive(Debug, thiserror::Error)]
#[error("redis refused SET NX GET: the redis store needs Redis 7.0 or later")]
struct NeedsRedis7(#[source] Box<dyn std::error::Error + Send + Sync>);

/// Physical expiry for a logical one: [`EXPIRY_GRACE`] later, `0` for never (Redis cannot
/// represent the far future, and a record that never expires must not get a TTL).
fn pexpireat(expires_at: Millis) -> u64 {
    const FAR: Millis = 1 << 52;
    let grace = u64::try_from(EXPIRY_GRACE.as_millis()).unwrap_or(0);
    if expires_at >= FAR { 0 } else { expires_at + grace }
}

fn ack(reply: &str) -> Result<(), StoreError> {
    match reply {
        "ok" => Ok(()),
        "fenced" => Err(idemgate_core::rules::Fenced.into()),
        _ => Err(corrupt("unexpected script reply")),
    }
}

impl Store for RedisStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        // What the rules answer and write for an absent key; `SET NX` writes it only then.
        let (first, Write::Put(fresh)) = rules::begin(None, req) else {
            unreachable!("rules::begin always creates a record for an absent key")
        };
        let value = layout::encode(&fresh)?;
        let px = pexpireat(fresh.expires_at);
        // Every call of every round shares one deadline (not one more future around the loop:
        // the engine's and the tower layer's futures nest this one, and rustc bounds the
        // depth). Rounds repeat only while others change the record in between.
        let deadline = self.deadline();
        loop {
            if Instant::now() >= deadline {
                return Err(StoreError::Timeout);
            }
            let raw = match self.set_nx_get(deadline, key, &value, px).await {
                Ok(Some(raw)) => raw,
                Ok(None) => {
                    let RecordState::InFlight { lease_until, .. } = fresh.state else {
                        unreachable!("rules::begin creates an in-flight record for an absent key")
                    };
                    let kept = Kept {
                        value,
                        expires_at: fresh.expires_at,
                        lease_until,
                    };
                    self.written.keep(req.token, kept, req.now);
                    return Ok(first);
                }
                Err(refused) if refuses_writes(&refused) => {
                    return self.begin_read_only(deadline, key, req, refused).await;
                }
                Err(e) => return Err(e),
            };
            let layout::Stored { record, waiters } = layout::decode(&raw)?;
            let (answer, write) = rules::begin_taking(&mut Some(record), req);
            let (mode, new, px): (&[u8], _, _) = match write {
                Write::Put(r) => (b"put", layout::encode(&r)?, pexpireat(r.expires_at)),
                // A waiter marks the record once, so that its owner publishes the outcome.
                Write::Keep if matches!(answer, Begin::InFlight { .. }) && !waiters => {
                    (b"wait", Vec::new(), 0)
                }
                Write::Keep => return Ok(answer),
                Write::Delete => return Err(corrupt("begin never deletes")),
            };
            let px = Decimal::new(px);
            let args: [&[u8]; 4] = [&raw[..layout::HEADER], mode, &new, px.plain()];
            let applied: u8 = self.call(deadline, &self.scripts.swap, key, &args).await?;
            if applied == 1 {
                return Ok(answer);
            }
            // The record changed since `SET` returned it: decide again on the new one.
        }
    }

    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: &StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        let expires_at = now + retention_ms;
        let (exp, px) = (Decimal::new(expires_at), pexpireat(expires_at));
        let body = encode_response(response);
        let deadline = self.deadline();
        // The record as this replica last wrote it, unless that has expired (the script
        // fences that) or the server refuses `IFEQ`.
        if let Some(flight) = self.written.take(token)
            && now < flight.expires_at
            && !self.written.refused()
        {
            let done = layout::completed(&flight.value, exp.padded(), &body);
            match self.set_ifeq(deadline, key, &done, &flight.value, Some(px)).await {
                Ok(true) => {
                    self.swapped.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                // Changed since (a waiter, a renewal of this attempt by the script, a new owner),
                // gone, or already completed by an earlier try of this call: the script decides.
                Ok(false) => {}
                Err(e) => self.ifeq_failed(e, "complete")?,
            }
        }
        let (now, px) = (Decimal::new(now), Decimal::new(px));
        let token = token_bytes(token);
        let args: [&[u8]; 7] = [
            &token,
            now.plain(),
            &body,
            exp.padded(),
            px.plain(),
            self.channel.as_bytes(),
            key.as_bytes(),
        ];
        let reply: String = self.call(deadline, &self.scripts.complete, key, &args).await?;
        ack(&reply)
    }

    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        self.written.take(token);
        let token = token_bytes(token);
        let args: [&[u8]; 3] = [&token, self.channel.as_bytes(), key.as_bytes()];
        let reply: String = self
            .call(self.deadline(), &self.scripts.release, key, &args)
            .await?;
        ack(&reply)
    }

    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        let until = Decimal::new(lease_until);
        let deadline = self.deadline();
        // The record as this replica last wrote it: the script's change as one compare-and-set,
        // and the new value kept for the next renewal and the `complete`. Copied, not taken:
        // this attempt's `complete` may take it meanwhile (the gateway renews while it retries
        // a `complete`), and then nothing is kept again for a finished attempt. A renewal that
        // would not lengthen the lease (renewals may overlap or land late) changes nothing in
        // the script either, but only the script can tell whether the lease is lost.
        if !self.written.refused()
            && let Some(flight) = self.written.peek(token)
            && lease_until > flight.lease_until
        {
            let past_expiry = lease_until > flight.expires_at;
            let renewed = layout::renewed(&flight.value, until.padded(), past_expiry);
            // As the script: a new physical expiry only with a new logical one, and none for a
            // record that never expires (`pexpireat` 0).
            let ttl = Some(pexpireat(lease_until)).filter(|at| past_expiry && *at != 0);
            match self.set_ifeq(deadline, key, &renewed, &flight.value, ttl).await {
                Ok(true) => {
                    let kept = Kept {
                        value: renewed,
                        expires_at: flight.expires_at.max(lease_until),
                        lease_until,
                    };
                    self.written.replace(token, &flight.value, Some(kept));
                    self.renewed.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                // Changed since (a waiter, a new owner), gone, or completed: what is kept is no
                // longer the record, and the script decides.
                Ok(false) => self.written.replace(token, &flight.value, None),
                Err(e) => self.ifeq_failed(e, "renew")?,
            }
        }
        let token = token_bytes(token);
        let px = Decimal::new(pexpireat(lease_until));
        let args: [&[u8]; 3] = [&token, until.padded(), px.plain()];
        let reply: String = self.call(deadline, &self.scripts.renew, key, &args).await?;
        ack(&reply)
    }

    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        let Some(raw) = self.get_raw(self.deadline(), key).await? else {
            return Ok(None);
        };
        Ok(Some(layout::decode(&raw)?.record).filter(|r| r.is_live(now)))
    }

    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        let args: [&[u8]; 2] = [self.channel.as_bytes(), key.as_bytes()];
        let n: u64 = self
            .call(self.deadline(), &self.scripts.purge, key, &args)
            .await?;
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
