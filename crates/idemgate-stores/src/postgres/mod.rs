//! The PostgreSQL store (feature `postgres`): one row per record, shared by several replicas.
//!
//! Rules. Every decision is `idemgate_core::rules`, applied in Rust. The common paths are one
//! statement each: `begin` tries `INSERT … ON CONFLICT DO NOTHING` and reads a conflicting row
//! in the same statement (a first attempt is acquired, a replay is answered, in one round
//! trip); `complete`, `release` and `renew` are guarded `UPDATE`/`DELETE`s whose condition and
//! write are exactly the rule's. Anything else (an expired record to replace, a lease to take
//! over, a guarded statement that matched nothing) takes the locked path: a transaction that
//! reads the row `FOR UPDATE`, asks the rule, and writes its answer. A miss is therefore two
//! round trips: begin and complete.
//!
//! Waiters. A `begin` that answers "in flight" flags the owner's row (`waiters`), guarded by
//! the owner's token so the flag cannot land on a successor. `complete` and `release` of a
//! flagged row `NOTIFY idemgate_records` with the namespaced key; one `LISTEN` connection per
//! store (`listener.rs`) wakes local waiters. Unflagged rows notify nothing: `NOTIFY` takes a
//! database-wide lock at commit, which uncontended traffic should not pay for.
//!
//! Schema. Versioned migrations ([`sql::MIGRATIONS`]) run under `pg_advisory_xact_lock`, so two
//! replicas starting together apply each version once. They run on first use, not at
//! construction: a gateway starts with PostgreSQL down and migrates when it is reachable.
//!
//! Failures. Every call is bounded by the configured timeout; connection failures (a
//! terminated backend, a refused connect) are retried within it on a fresh connection, which
//! is safe because every operation is idempotent for the lease owner (SPEC 10). Connections
//! open on tasks of their own (`connect.rs`): one that takes longer than a call's timeout
//! still lands in the pool for the next call.

mod connect;
mod listener;
mod row;
pub mod sql;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, StoredResponse};
use idemgate_core::rules::{self, Begin, BeginRequest, Write};
use idemgate_core::store::{Store, StoreError};
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use crate::codec::{encode_response, token_bytes};
use row::{Row, db_ms};

/// The `LISTEN`/`NOTIFY` channel.
pub const CHANNEL: &str = "idemgate_records";
/// The most expired rows one sweep statement deletes.
pub const SWEEP_BATCH: i64 = 1000;

/// Runs `$body` with `$c: &mut Client`, a pooled connection, within the store's timeout,
/// retrying connection failures on a fresh connection until the deadline. A connection whose
/// call is cut off by the timeout is closed rather than returned to the pool: its statement may
/// still be running, and the next request must not queue behind it. (A macro rather than a
/// function taking a closure: the body borrows the connection, which closures returning
/// `Send` futures cannot express on stable Rust.)
macro_rules! with_conn {
    ($store:expr, |$c:ident| $body:block) => {{
        let store = $store;
        let deadline = Instant::now() + store.timeout;
        let attempt = async {
            store.migrated.get_or_try_init(|| store.migrate()).await?;
            let mut backoff = Duration::from_millis(10);
            loop {
                let result = match store.pool.get().await {
                    Ok(c) => {
                        let mut conn = Checkout(Some(c));
                        let $c: &mut Client = conn.client();
                        let result: Result<_, StoreError> = async { $body }.await;
                        conn.give_back();
                        result
                    }
                    Err(e) => Err(StoreError::backend(e)),
                };
                match result {
                    Err(StoreError::Backend(e)) if retryable(&*e) && Instant::now() + backoff < deadline => {
                        tracing::debug!(error = %e, "postgres call failed; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_millis(200));
                    }
                    other => break other,
                }
            }
        };
        tokio::time::timeout_at(deadline, attempt)
            .await
            .map_err(|_| StoreError::Timeout)
            .and_then(|r| r)
    }};
}

/// How to reach PostgreSQL.
#[derive(Clone, Debug)]
pub struct PostgresConfig {
    /// `postgres://user[:password]@host[:port]/db[?application_name=…&options=…]`.
    pub url: String,
    /// Bound on every store call, waiting for a pooled connection included.
    pub timeout: Duration,
    /// Connections in the pool.
    pub pool_size: usize,
}

impl PostgresConfig {
    /// Defaults for `url`: timeout 2 s, 16 connections.
    #[must_use]
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            timeout: Duration::from_secs(2),
            pool_size: 16,
        }
    }
}

/// Why a PostgreSQL store could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostgresConfigError {
    #[error("invalid postgres url")]
    Url(#[source] tokio_postgres::Error),
    #[error("cannot build the connection pool")]
    Pool(#[source] deadpool_postgres::BuildError),
}

/// Checks a PostgreSQL URL without connecting (for configuration errors at start).
///
/// # Errors
/// The URL is not a PostgreSQL URL.
pub fn check_url(url: &str) -> Result<(), PostgresConfigError> {
    url.parse::<tokio_postgres::Config>()
        .map(drop)
        .map_err(PostgresConfigError::Url)
}

/// Records in PostgreSQL, shared by every replica pointed at the same database.
pub struct PostgresStore {
    pool: Pool,
    opener: Arc<connect::Opener>,
    migrated: OnceCell<()>,
    timeout: Duration,
    notifier: Arc<Notifier>,
    round_trips: AtomicU64,
    listener: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

type Client = deadpool_postgres::Object;

/// A pooled connection that goes back to the pool only when handed back; dropped mid-call (the
/// call timed out), it is detached from the pool and closed.
struct Checkout(Option<Client>);

impl Checkout {
    fn client(&mut self) -> &mut Client {
        self.0.as_mut().expect("a checked-out connection")
    }

    fn give_back(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            drop(deadpool_postgres::Object::take(c));
        }
    }
}

impl PostgresStore {
    /// Builds the pool and starts the `LISTEN` connection. Connects lazily: PostgreSQL may be
    /// down now. Must run inside a Tokio runtime.
    ///
    /// # Errors
    /// The URL is not a PostgreSQL URL, or the pool cannot be built.
    pub fn new(config: &PostgresConfig) -> Result<Self, PostgresConfigError> {
        let mut pg: tokio_postgres::Config = config.url.parse().map_err(PostgresConfigError::Url)?;
        if pg.get_application_name().is_none() {
            pg.application_name("idemgate");
        }
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(config.timeout);
        }
        // The server gives up on a statement when the gateway does, so a call cut off by the
        // timeout does not keep holding locks (unless the URL's options say otherwise).
        let options = pg.get_options().unwrap_or_default().to_owned();
        if !options.contains("statement_timeout") {
            let ms = config.timeout.as_millis().max(1);
            pg.options(
                format!("{options} -c statement_timeout={ms}")
                    .trim_start()
                    .to_owned(),
            );
        }
        let notifier = Arc::new(Notifier::default());
        let listener = tokio::spawn(listener::run(pg.clone(), notifier.clone(), config.timeout));
        let opener = connect::Opener::new(config.pool_size, config.timeout);
        let manager = Manager::from_connect(
            pg,
            connect::Connector(opener.clone()),
            ManagerConfig {
                // A connection that died (terminated backend) reports itself closed; a query
                // on one that died unnoticed fails and is retried on a fresh one.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.timeout))
            // Load-bearing: it ends a caller's wait for an opening that is given up
            // (`connect.rs` leaves that wait pending, as the caller always has this bound).
            .create_timeout(Some(config.timeout))
            .recycle_timeout(Some(config.timeout))
            .build()
            .map_err(PostgresConfigError::Pool)?;
        Ok(Self {
            pool,
            opener,
            migrated: OnceCell::new(),
            timeout: config.timeout,
            notifier,
            round_trips: AtomicU64::new(0),
            listener,
        })
    }

    /// Statements sent so far (each one round trip once prepared on its connection), for
    /// measuring.
    #[must_use]
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// Deletes up to [`SWEEP_BATCH`] records expired at `now`; returns how many.
    ///
    /// # Errors
    /// PostgreSQL failed or did not answer in time.
    pub async fn sweep(&self, now: Millis) -> Result<usize, StoreError> {
        with_conn!(self, |c| {
            let st = self.prepare(c, sql::SWEEP).await?;
            let n = c.execute(&st, &[&db_ms(now), &SWEEP_BATCH]).await.map_err(pg)?;
            Ok(usize::try_from(n).unwrap_or(usize::MAX))
        })
    }

    /// Sweeps in the background every `every` (and straight again while batches come back
    /// full) until the store is dropped. Also drops the connections that finished opening for
    /// callers that had gone and have waited that long unused (`connect.rs`).
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if let Some(store) = weak.upgrade() {
                    store.opener.prune(every);
                }
                loop {
                    let Some(store) = weak.upgrade() else { return };
                    match store.sweep(idemgate_core::record::now_millis()).await {
                        Ok(n) if n == usize::try_from(SWEEP_BATCH).unwrap_or(0) => {
                            tokio::task::yield_now().await;
                        }
                        Ok(_) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "postgres store sweep failed");
                            break;
                        }
                    }
                }
            }
        })
    }

    /// Applies the pending migrations (once per store; again after a failure).
    ///
    /// # Errors
    /// PostgreSQL failed or did not answer in time.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let run = async {
            let mut client = self.pool.get().await.map_err(StoreError::backend)?;
            let txn = client.transaction().await.map_err(pg)?;
            txn.execute("SELECT pg_advisory_xact_lock($1)", &[&sql::MIGRATION_LOCK])
                .await
                .map_err(pg)?;
            txn.batch_execute(sql::CREATE_MIGRATIONS).await.map_err(pg)?;
            let applied: Vec<i32> = txn
                .query("SELECT version FROM idemgate_migrations", &[])
                .await
                .map_err(pg)?
                .iter()
                .map(|r| r.get(0))
                .collect();
            for (version, script) in sql::MIGRATIONS {
                if applied.contains(version) {
                    continue;
                }
                txn.batch_execute(script).await.map_err(pg)?;
                txn.execute(
                    "INSERT INTO idemgate_migrations (version) VALUES ($1)",
                    &[version],
                )
                .await
                .map_err(pg)?;
                tracing::info!(version, "postgres store migration applied");
            }
            txn.commit().await.map_err(pg)
        };
        tokio::time::timeout(self.timeout.max(Duration::from_secs(10)), run)
            .await
            .map_err(|_| StoreError::Timeout)?
    }

    async fn prepare(&self, c: &Client, query: &str) -> Result<tokio_postgres::Statement, StoreError> {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        c.prepare_cached(query).await.map_err(pg)
    }

    /// The locked path: reads the row `FOR UPDATE`, asks `rule`, writes its answer, commits.
    /// `notify` sends a notification with the write when the row was waited on.
    async fn locked<T>(
        &self,
        key: &str,
        notify: bool,
        rule: impl Fn(Option<&Row>) -> Result<(T, Write, bool), StoreError>,
    ) -> Result<T, StoreError> {
        let rule = &rule;
        with_conn!(self, |c| {
            loop {
                let txn = c.transaction().await.map_err(pg)?;
                self.round_trips.fetch_add(1, Ordering::Relaxed);
                let lock = txn.prepare_cached(sql::LOCK).await.map_err(pg)?;
                self.round_trips.fetch_add(1, Ordering::Relaxed);
                let current = txn.query_opt(&lock, &[&key]).await.map_err(pg)?;
                let current = current.as_ref().map(Row::read).transpose()?;
                let (answer, write, flag) = rule(current.as_ref())?;
                let waited = current.as_ref().is_some_and(|r| r.waiters);
                let mut wrote = true;
                match &write {
                    Write::Keep => wrote = false,
                    Write::Put(rec) if current.is_some() => {
                        let st = txn.prepare_cached(sql::UPDATE).await.map_err(pg)?;
                        self.round_trips.fetch_add(1, Ordering::Relaxed);
                        txn.execute(&st, &row::update_params(key, rec, false).as_params())
                            .await
                            .map_err(pg)?;
                    }
                    Write::Put(rec) => {
                        let st = txn.prepare_cached(sql::INSERT).await.map_err(pg)?;
                        self.round_trips.fetch_add(1, Ordering::Relaxed);
                        let n = txn
                            .execute(&st, &row::insert_params(key, rec).as_params())
                            .await
                            .map_err(pg)?;
                        if n == 0 {
                            // Another request inserted the key since we looked: look again.
                            txn.rollback().await.map_err(pg)?;
                            continue;
                        }
                    }
                    Write::Delete => {
                        self.round_trips.fetch_add(1, Ordering::Relaxed);
                        txn.execute(sql::DELETE, &[&key]).await.map_err(pg)?;
                    }
                }
                if flag && !waited {
                    self.round_trips.fetch_add(1, Ordering::Relaxed);
                    txn.execute(
                        "UPDATE idemgate_records SET waiters = true WHERE key = $1",
                        &[&key],
                    )
                    .await
                    .map_err(pg)?;
                }
                if notify && wrote && waited {
                    self.round_trips.fetch_add(1, Ordering::Relaxed);
                    txn.execute(sql::NOTIFY, &[&key, &CHANNEL]).await.map_err(pg)?;
                }
                self.round_trips.fetch_add(1, Ordering::Relaxed);
                txn.commit().await.map_err(pg)?;
                return Ok(answer);
            }
        })
    }

    /// `begin` through the locked path.
    async fn begin_locked(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        self.locked(key, false, |row| {
            let (answer, write) = rules::begin(row.map(|r| &r.record), req);
            let flag = matches!(answer, Begin::InFlight { .. });
            Ok((answer, write, flag))
        })
        .await
    }
}

/// A `tokio_postgres` error as a store error (keeping it as the source). A statement the
/// server cancelled at `statement_timeout` is the same bound as ours: a timeout.
fn pg(e: tokio_postgres::Error) -> StoreError {
    if e.code() == Some(&SqlState::QUERY_CANCELED) {
        return StoreError::Timeout;
    }
    StoreError::backend(e)
}

/// A closed connection, a terminated backend, a refused connect: another connection may work.
fn retryable(e: &(dyn std::error::Error + 'static)) -> bool {
    if let Some(e) = e.downcast_ref::<tokio_postgres::Error>() {
        return e.is_closed()
            || matches!(
                e.code(),
                Some(c) if *c == SqlState::ADMIN_SHUTDOWN || *c == SqlState::CRASH_SHUTDOWN || *c == SqlState::CANNOT_CONNECT_NOW
            )
            || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>());
    }
    e.downcast_ref::<deadpool_postgres::PoolError>()
        .is_some_and(|e| matches!(e, deadpool_postgres::PoolError::Backend(_)))
}

impl Store for PostgresStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        // The record a first owner writes (rules::begin on an absent key).
        let Write::Put(fresh) = rules::begin(None, req).1 else {
            unreachable!("a begin on an absent key always writes a record")
        };
        let token = token_bytes(req.token);
        let fast = with_conn!(self, |c| {
            let st = self.prepare(c, sql::BEGIN).await?;
            let row = c
                .query_one(
                    &st,
                    &[
                        &key,
                        &token.as_slice(),
                        &row::lease_of(&fresh),
                        &fresh.fingerprint.0.as_slice(),
                        &fresh.route,
                        &fresh.operation_id,
                        &db_ms(fresh.created_at),
                        &db_ms(fresh.expires_at),
                    ],
                )
                .await
                .map_err(pg)?;
            let inserted: i64 = row.get(0);
            if inserted == 1 {
                return Ok(Some((rules::begin(None, req).0, None)));
            }
            Ok(Row::read_at(&row, 1)?.map(|r| (rules::begin(Some(&r.record), req).0, Some(r))))
        })?;
        match fast {
            // Acquired by the insert.
            Some((answer, None)) => Ok(answer),
            Some((answer, Some(current))) => {
                let (_, write) = rules::begin(Some(&current.record), req);
                if write != Write::Keep {
                    // Replace an expired record or take over a dead owner's: locked.
                    return self.begin_locked(key, req).await;
                }
                if let Begin::InFlight { .. } = answer
                    && !current.waiters
                {
                    let owner = token_bytes(current.record.token());
                    let flagged = with_conn!(self, |c| {
                        let st = self.prepare(c, sql::FLAG_WAITERS).await?;
                        c.execute(&st, &[&key, &owner.as_slice()]).await.map_err(pg)
                    })?;
                    if flagged == 0 {
                        // The owner finished meanwhile: decide again under the lock.
                        return self.begin_locked(key, req).await;
                    }
                }
                Ok(answer)
            }
            // The conflicting row was committed after the statement's snapshot.
            None => self.begin_locked(key, req).await,
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
        let tok = token_bytes(token);
        let body = encode_response(response);
        let expires_at = db_ms(now + retention_ms);
        let updated = with_conn!(self, |c| {
            let st = self.prepare(c, sql::COMPLETE).await?;
            let row = c
                .query_one(
                    &st,
                    &[
                        &key,
                        &tok.as_slice(),
                        &body.as_slice(),
                        &expires_at,
                        &db_ms(now),
                        &CHANNEL,
                    ],
                )
                .await
                .map_err(pg)?;
            Ok(row.get::<_, i64>(0))
        })?;
        if updated == 1 {
            return Ok(());
        }
        self.locked(key, true, |row| {
            let write = rules::complete(row.map(|r| &r.record), token, response.clone(), retention_ms, now)?;
            Ok(((), write, false))
        })
        .await
    }

    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        let tok = token_bytes(token);
        let deleted = with_conn!(self, |c| {
            let st = self.prepare(c, sql::RELEASE).await?;
            let row = c
                .query_one(&st, &[&key, &tok.as_slice(), &CHANNEL])
                .await
                .map_err(pg)?;
            Ok(row.get::<_, i64>(0))
        })?;
        if deleted == 1 {
            return Ok(());
        }
        self.locked(key, true, |row| {
            Ok(((), rules::release(row.map(|r| &r.record), token)?, false))
        })
        .await
    }

    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        let tok = token_bytes(token);
        let n = with_conn!(self, |c| {
            let st = self.prepare(c, sql::RENEW).await?;
            c.execute(&st, &[&key, &tok.as_slice(), &db_ms(lease_until)])
                .await
                .map_err(pg)
        })?;
        if n == 1 { Ok(()) } else { Err(rules::Fenced.into()) }
    }

    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        let row = with_conn!(self, |c| {
            let st = self.prepare(c, sql::GET).await?;
            let row = c.query_opt(&st, &[&key]).await.map_err(pg)?;
            row.as_ref().map(Row::read).transpose()
        })?;
        Ok(row.map(|r| r.record).filter(|r| r.is_live(now)))
    }

    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        with_conn!(self, |c| {
            let st = self.prepare(c, sql::PURGE).await?;
            let row = c.query_one(&st, &[&key, &CHANNEL]).await.map_err(pg)?;
            Ok(row.get::<_, i64>(0) > 0)
        })
    }

    async fn ping(&self) -> Result<(), StoreError> {
        with_conn!(self, |c| {
            c.simple_query("SELECT 1").await.map(drop).map_err(pg)
        })
    }

    fn remote(&self) -> bool {
        true
    }

    fn notifier(&self) -> &Arc<Notifier> {
        &self.notifier
    }
}
