//! Model-based test of the record stores: random sequences of store operations run against
//! [`MemoryStore`], [`idemgate_stores::EmbeddedStore`], and (when `IDEMGATE_TEST_REDIS_URL`,
//! `IDEMGATE_TEST_VALKEY_URL` or `IDEMGATE_TEST_PG_URL` are set, with fewer cases) the Redis
//! store on Redis and on Valkey and the PostgreSQL store, every answer compared with a
//! reference model.
//!
//! The model is a `BTreeMap` from key to a small record, and its transitions are written from
//! the documented contract (SPEC sections 4 and 10, the doc comments on `Record`, `Begin`,
//! `BeginRequest`, `Store` and `StoreError`), not by calling `idemgate_core::rules`. Every store
//! applies those rules, so a model that called them would agree with any mistake in them; this
//! one states the semantics a second time, in a different shape, so the two must agree.
//!
//! What the model holds to:
//!
//! - A record exists at `now` while `now < expires_at`; after that it is gone: `begin` and `get`
//!   treat it as absent, and `complete` is fenced (`StoreError::Fenced`: "taken over, purged, or
//!   expired"). Whether a sweep has run yet never changes what those operations answer.
//! - `begin` on an absent key acquires it: generation 1, a lease of `lease_ms`, and a record
//!   that lives `max(lease, retention)` (a dead owner's key stays reserved as long as a completed
//!   one would be kept), or forever when the route refuses takeover (`on_lease_expiry: fail`).
//! - `begin` by the attempt that owns an in-flight record (same token) is that attempt retried
//!   after it took effect, and gets the same `Acquired` answer as the first time.
//! - Otherwise, another fingerprint or route is a `Mismatch` whatever the state; a completed
//!   record replays; a live lease is `InFlight`; an expired lease is taken over (generation + 1,
//!   new token, new operation id) when the route allows it, and `LeaseExpired` when not.
//! - `complete` by the owner stores the response and keeps it `retention` from then; retried, it
//!   changes nothing. `release` by the owner deletes the record; on an absent key it is a no-op.
//!   `renew` by the owner of an in-flight record moves its lease (the record lives at least as
//!   long as the lease). Any other token is fenced.
//! - `purge` removes the record whatever its state and says whether there was one.
//! - A sweep removes exactly the records that are gone at `now`.
//!
//! `release`, `renew` and `purge` take no `now`, so a store cannot tell an expired record that
//! no sweep has removed yet from a live one: for those three the model acts on what is stored,
//! which is why the map keeps expired records until the model's own sweep.
//!
//! Time is explicit: every call gets the model's clock, which only moves by the generated
//! `Advance` steps (and jumps onto a key's deadlines so that `now == lease_until` and
//! `now == expires_at` are hit, not only crossed). With a 1 s lease and 2 s retention, lease
//! expiry and record expiry both happen inside one sequence of 40 operations. Sequences also
//! run each store's own sweep, so that "a sweep has run or not" is one of the interleavings.
//!
//! After every operation the test compares its answer and then reads every key. A failure
//! prints the shrunk sequence; `PROPTEST_CASES=5000 cargo test -p idemgate-stores --test model`
//! runs deeper than the few seconds the default case counts take.

use std::collections::BTreeMap;
use std::future::Future;

use idemgate_core::{
    Begin, BeginRequest, Fingerprint, LeaseToken, MemoryStore, Millis, Record, RecordState, Store,
    StoreError, StoredResponse,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

const LEASE_MS: u64 = 1_000;
const RETENTION_MS: u64 = 2_000;
const KEYS: [&str; 3] = ["tenant/k0", "tenant/k1", "tenant/k2"];
const TOKENS: usize = 4;
const FINGERPRINTS: usize = 2;
const ROUTES: [&str; 2] = ["route-a", "route-b"];
/// The clock's start: an ordinary wall-clock instant, far from zero. (Redis runs from the
/// real clock instead: it drops keys by its own clock once their expiry plus a grace period
/// has passed, so its records must expire in the future.)
const START: Millis = 1_700_000_000_000;

fn token(i: usize) -> LeaseToken {
    LeaseToken(0x7000_0000_0000_0000_0000_0000_0000_0000 + i as u128)
}

fn fingerprint(i: usize) -> Fingerprint {
    Fingerprint([0x10 + i as u8; 32])
}

/// The response stored by the `complete` at operation index `id`: unique per operation, so a
/// replay shows which completion it came from. Every fifth one has no body (over the limit).
fn response(id: usize) -> StoredResponse {
    StoredResponse {
        status: 200 + (id % 3) as u16,
        headers: vec![("x-op".into(), id.to_string().into())],
        body: (!id.is_multiple_of(5)).then(|| format!("body of op {id}").into()),
    }
}

/// Which token an owner-only operation names.
#[derive(Clone, Copy, Debug)]
enum Who {
    /// The token of the key's stored record (token 0 if there is none): the owner, or the last
    /// one, so that completions, renewals and releases mostly succeed and reach deep states.
    Holder,
    /// Token `i` of the pool, the owner or not.
    Token(usize),
}

/// One step of a generated sequence. Indices pick from the small pools above.
#[derive(Clone, Debug)]
enum Op {
    Begin {
        key: usize,
        token: usize,
        fp: usize,
        route: usize,
        takeover: bool,
    },
    Complete {
        key: usize,
        who: Who,
    },
    Release {
        key: usize,
        who: Who,
    },
    Renew {
        key: usize,
        who: Who,
    },
    Purge {
        key: usize,
    },
    Get {
        key: usize,
    },
    Advance {
        ms: u64,
    },
    /// Moves the clock to `offset` ms from one of the key's deadlines (its lease end when
    /// `lease` and it is in flight, else its expiry), if that is not in the past.
    AdvanceToDeadline {
        key: usize,
        lease: bool,
        offset: i8,
    },
    /// Runs the store's expiry sweep at `now`.
    Sweep,
}

fn op() -> impl Strategy<Value = Op> {
    // Most operations on one key, so that its record goes through many states in a sequence;
    // the others check that keys do not interfere.
    let key = prop_oneof![4 => Just(0), 1 => 1..KEYS.len()];
    let who = prop_oneof![1 => Just(Who::Holder), 1 => (0..TOKENS).prop_map(Who::Token)];
    // Lean towards the first fingerprint and route so that most begins on a used key meet a
    // matching record (replay, in flight, takeover) rather than a mismatch.
    let fp = prop_oneof![5 => Just(0), 1 => Just(FINGERPRINTS - 1)];
    let route = prop_oneof![5 => Just(0), 1 => Just(ROUTES.len() - 1)];
    prop_oneof![
        8 => (key.clone(), 0..TOKENS, fp, route, any::<bool>()).prop_map(
            |(key, token, fp, route, takeover)| Op::Begin { key, token, fp, route, takeover }
        ),
        4 => (key.clone(), who.clone()).prop_map(|(key, who)| Op::Complete { key, who }),
        2 => (key.clone(), who.clone()).prop_map(|(key, who)| Op::Release { key, who }),
        2 => (key.clone(), who).prop_map(|(key, who)| Op::Renew { key, who }),
        1 => key.clone().prop_map(|key| Op::Purge { key }),
        2 => key.clone().prop_map(|key| Op::Get { key }),
        // Short steps as often as long ones, so several operations fit inside one lease.
        2 => (0..300u64).prop_map(|ms| Op::Advance { ms }),
        2 => (0..3_000u64).prop_map(|ms| Op::Advance { ms }),
        2 => (key, any::<bool>(), -1i8..=1).prop_map(|(key, lease, offset)| {
            Op::AdvanceToDeadline { key, lease, offset }
        }),
        1 => Just(Op::Sweep),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..=40)
}

/// Where a model record is in its life.
#[derive(Clone, Copy, Debug)]
enum Phase {
    Running {
        lease_until: Millis,
    },
    /// Completed with the response of operation `response`.
    Done {
        response: usize,
    },
}

/// The model's record: indices into the pools instead of values.
#[derive(Clone, Debug)]
struct Entry {
    owner: usize,
    fp: usize,
    route: usize,
    operation_id: String,
    created_at: Millis,
    expires_at: Millis,
    generation: u64,
    /// Whether this owner got the key by taking over an expired lease.
    took_over: bool,
    phase: Phase,
}

impl Entry {
    /// The [`Record`] a store must hold for this entry.
    fn record(&self) -> Record {
        Record {
            state: match self.phase {
                Phase::Running { lease_until } => RecordState::InFlight {
                    token: token(self.owner),
                    lease_until,
                },
                Phase::Done { response: id } => RecordState::Completed {
                    token: token(self.owner),
                    response: response(id),
                },
            },
            fingerprint: fingerprint(self.fp),
            route: ROUTES[self.route].to_owned(),
            operation_id: self.operation_id.clone(),
            created_at: self.created_at,
            expires_at: self.expires_at,
            generation: self.generation,
        }
    }
}

/// The answer to an operation that names a lease token.
#[derive(Debug, PartialEq, Eq)]
enum Ack {
    Ok,
    Fenced,
}

/// The reference: the stored records (expired ones too, until swept) and the clock.
struct Model {
    now: Millis,
    records: BTreeMap<usize, Entry>,
}

impl Model {
    fn new(start: Millis) -> Self {
        Self {
            now: start,
            records: BTreeMap::new(),
        }
    }

    /// The key's record if it still exists at `now`.
    fn live(&self, key: usize) -> Option<&Entry> {
        self.records.get(&key).filter(|e| self.now < e.expires_at)
    }

    /// `begin` by attempt `tok` for request (`fp`, `route`).
    fn begin(
        &mut self,
        key: usize,
        tok: usize,
        (fp, route): (usize, usize),
        takeover: bool,
        operation_id: String,
    ) -> Begin {
        let now = self.now;
        let new_owner = |generation, took_over| Entry {
            owner: tok,
            fp,
            route,
            operation_id: operation_id.clone(),
            created_at: now,
            // SPEC 4: with `on_lease_expiry: fail` a dead owner's key is outcome-unknown "until
            // an operator purges the record", so such a record has no end.
            expires_at: if takeover {
                now + LEASE_MS.max(RETENTION_MS)
            } else {
                u64::MAX
            },
            generation,
            took_over,
            phase: Phase::Running {
                lease_until: now + LEASE_MS,
            },
        };
        let Some(current) = self.live(key).cloned() else {
            // Never used, released, purged or expired: a first owner.
            self.records.insert(key, new_owner(1, false));
            return Begin::Acquired {
                operation_id,
                generation: 1,
                took_over: false,
            };
        };
        let same_attempt = current.owner == tok && matches!(current.phase, Phase::Running { .. });
        let same_request = current.fp == fp && current.route == route;
        if same_attempt {
            return Begin::Acquired {
                operation_id: current.operation_id,
                generation: current.generation,
                took_over: current.took_over,
            };
        }
        if !same_request {
            return Begin::Mismatch {
                operation_id: current.operation_id,
            };
        }
        match current.phase {
            Phase::Done { .. } => Begin::Replay(Box::new(current.record())),
            Phase::Running { lease_until } if now < lease_until => Begin::InFlight {
                operation_id: current.operation_id,
                lease_until,
            },
            Phase::Running { .. } if takeover => {
                let generation = current.generation + 1;
                self.records.insert(key, new_owner(generation, true));
                Begin::Acquired {
                    operation_id,
                    generation,
                    took_over: true,
                }
            }
            Phase::Running { .. } => Begin::LeaseExpired {
                operation_id: current.operation_id,
            },
        }
    }

    fn complete(&mut self, key: usize, tok: usize, id: usize) -> Ack {
        let now = self.now;
        let Some(entry) = self.records.get_mut(&key) else {
            return Ack::Fenced;
        };
        if now >= entry.expires_at || entry.owner != tok {
            return Ack::Fenced;
        }
        if let Phase::Running { .. } = entry.phase {
            entry.phase = Phase::Done { response: id };
            entry.expires_at = now + RETENTION_MS;
        }
        // Already done by this owner: a retry, nothing changes.
        Ack::Ok
    }

    fn release(&mut self, key: usize, tok: usize) -> Ack {
        match self.records.get(&key) {
            None => Ack::Ok,
            Some(e) if e.owner == tok && matches!(e.phase, Phase::Running { .. }) => {
                self.records.remove(&key);
                Ack::Ok
            }
            Some(_) => Ack::Fenced,
        }
    }

    fn renew(&mut self, key: usize, tok: usize, until: Millis) -> Ack {
        match self.records.get_mut(&key) {
            Some(e) if e.owner == tok && matches!(e.phase, Phase::Running { .. }) => {
                e.phase = Phase::Running { lease_until: until };
                e.expires_at = e.expires_at.max(until);
                Ack::Ok
            }
            _ => Ack::Fenced,
        }
    }

    fn sweep(&mut self) -> usize {
        let before = self.records.len();
        let now = self.now;
        self.records.retain(|_, e| now < e.expires_at);
        before - self.records.len()
    }

    fn token_of(&self, key: usize, who: Who) -> usize {
        match who {
            Who::Holder => self.records.get(&key).map_or(0, |e| e.owner),
            Who::Token(i) => i,
        }
    }

    fn advance_to_deadline(&mut self, key: usize, lease: bool, offset: i8) {
        let Some(e) = self.records.get(&key) else {
            return;
        };
        let deadline = match e.phase {
            Phase::Running { lease_until } if lease => lease_until,
            // A record that never expires (`on_lease_expiry: fail`) has no deadline to jump to.
            _ if e.expires_at == u64::MAX => return,
            _ => e.expires_at,
        };
        let target = deadline.saturating_add_signed(offset.into());
        self.now = self.now.max(target);
    }
}

/// A store under test, plus its sweep (not part of the [`Store`] trait).
trait Swept: Store {
    fn sweep_at(&self, now: Millis) -> impl Future<Output = Result<usize, StoreError>>;
}

impl Swept for MemoryStore {
    async fn sweep_at(&self, now: Millis) -> Result<usize, StoreError> {
        Ok(self.sweep(now))
    }
}

#[cfg(feature = "embedded")]
impl Swept for idemgate_stores::EmbeddedStore {
    async fn sweep_at(&self, now: Millis) -> Result<usize, StoreError> {
        self.sweep(now).await
    }
}

fn ack(i: usize, result: Result<(), StoreError>) -> Result<Ack, TestCaseError> {
    match result {
        Ok(()) => Ok(Ack::Ok),
        Err(StoreError::Fenced(_)) => Ok(Ack::Fenced),
        Err(e) => Err(store_failed(i, &e)),
    }
}

fn store_failed(i: usize, e: &StoreError) -> TestCaseError {
    TestCaseError::fail(format!("op {i}: unexpected store error: {e:?}"))
}

/// Runs `ops` against `store` and the model, comparing every answer, then the whole state.
async fn check<S: Swept>(store: &S, ops: &[Op], start: Millis) -> Result<(), TestCaseError> {
    let mut model = Model::new(start);
    for (i, op) in ops.iter().enumerate() {
        let now = model.now;
        let at = format!("op {i} {op:?} at +{}ms", now - start);
        match *op {
            Op::Begin {
                key,
                token: tok,
                fp,
                route,
                takeover,
            } => {
                let operation_id = format!("op-{i}");
                let req = BeginRequest {
                    fingerprint: fingerprint(fp),
                    route: ROUTES[route],
                    token: token(tok),
                    operation_id: &operation_id,
                    lease_ms: LEASE_MS,
                    retention_ms: RETENTION_MS,
                    takeover,
                    now,
                };
                let got = store
                    .begin(KEYS[key], &req)
                    .await
                    .map_err(|e| store_failed(i, &e))?;
                let want = model.begin(key, tok, (fp, route), takeover, operation_id.clone());
                prop_assert_eq!(got, want, "{}", at);
            }
            Op::Complete { key, who } => {
                let tok = model.token_of(key, who);
                let got = store
                    .complete(KEYS[key], token(tok), &response(i), RETENTION_MS, now)
                    .await;
                let want = model.complete(key, tok, i);
                prop_assert_eq!(ack(i, got)?, want, "{}", at);
            }
            Op::Release { key, who } => {
                let tok = model.token_of(key, who);
                let got = store.release(KEYS[key], token(tok)).await;
                let want = model.release(key, tok);
                prop_assert_eq!(ack(i, got)?, want, "{}", at);
            }
            Op::Renew { key, who } => {
                let tok = model.token_of(key, who);
                let until = now + LEASE_MS;
                let got = store.renew(KEYS[key], token(tok), until).await;
                let want = model.renew(key, tok, until);
                prop_assert_eq!(ack(i, got)?, want, "{}", at);
            }
            Op::Purge { key } => {
                let got = store.purge(KEYS[key]).await.map_err(|e| store_failed(i, &e))?;
                let want = model.records.remove(&key).is_some();
                prop_assert_eq!(got, want, "{}", at);
            }
            Op::Get { key } => {
                let got = store.get(KEYS[key], now).await.map_err(|e| store_failed(i, &e))?;
                prop_assert_eq!(got, model.live(key).map(Entry::record), "{}", at);
            }
            Op::Advance { ms } => model.now = model.now.saturating_add(ms),
            Op::AdvanceToDeadline { key, lease, offset } => {
                model.advance_to_deadline(key, lease, offset);
            }
            Op::Sweep => {
                let got = store.sweep_at(now).await.map_err(|e| store_failed(i, &e))?;
                let want = model.sweep();
                prop_assert_eq!(got, want, "{}", at);
            }
        }
        // Whatever the operation, every key must now read as the model says.
        for (key, name) in KEYS.iter().enumerate() {
            let got = store
                .get(name, model.now)
                .await
                .map_err(|e| store_failed(i, &e))?;
            let want = model.live(key).map(Entry::record);
            prop_assert_eq!(got, want, "state of {} after {}", name, at);
        }
    }
    Ok(())
}

fn block_on<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(f)
}

/// `cases` unless `PROPTEST_CASES` asks for another number (a deeper run).
fn config(cases: u32) -> ProptestConfig {
    let cases = if std::env::var_os("PROPTEST_CASES").is_some() {
        ProptestConfig::default().cases
    } else {
        cases
    };
    ProptestConfig {
        cases,
        // A failure prints its shrunk sequence; no regression file is written into the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn memory_store_matches_model(ops in ops()) {
        let store = MemoryStore::new(1 << 30);
        block_on(check(&store, &ops, START))?;
    }
}

/// A directory removed when the case ends, pass or fail.
#[cfg(feature = "embedded")]
struct TempDir(std::path::PathBuf);

#[cfg(feature = "embedded")]
impl TempDir {
    fn new() -> Self {
        let name = format!(
            "idemgate-model-{}-{:x}",
            std::process::id(),
            LeaseToken::random().0
        );
        Self(std::env::temp_dir().join(name))
    }
}

#[cfg(feature = "embedded")]
impl Drop for TempDir {
    fn drop(&mut self) {
        // Best effort: a leftover directory in the temp dir harms nothing.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(feature = "embedded")]
proptest! {
    // Every mutation is an fsync'd commit, so fewer cases than the memory store.
    #![proptest_config(config(24))]

    #[test]
    fn embedded_store_matches_model(ops in ops()) {
        let dir = TempDir::new();
        let store = idemgate_stores::EmbeddedStore::open(&dir.0).expect("open embedded store");
        block_on(check(&store, &ops, START))?;
    }
}

#[cfg(feature = "redis")]
impl Swept for idemgate_stores::RedisStore {
    async fn sweep_at(&self, now: Millis) -> Result<usize, StoreError> {
        self.sweep(now).await
    }
}

/// One case on the Redis-protocol server at the URL in `var`, under a prefix of its own (a fresh
/// key space, and a sweep that sees only it).
#[cfg(feature = "redis")]
fn redis_case(var: &str, ops: &[Op]) -> Result<(), TestCaseError> {
    let Ok(url) = std::env::var(var) else {
        println!("skipped: {var} not set");
        return Ok(());
    };
    block_on(async {
        let mut config = idemgate_stores::RedisConfig::new(url);
        config.prefix = format!("idemgate-model-{:x}", LeaseToken::random().0);
        let store = idemgate_stores::RedisStore::new(&config).expect("redis store");
        let result = check(&store, ops, idemgate_core::record::now_millis()).await;
        for key in KEYS {
            let _ = store.purge(key).await;
        }
        result
    })
}

#[cfg(feature = "redis")]
proptest! {
    // A round trip per operation and per read-back to a real server: few cases.
    #![proptest_config(config(8))]

    #[test]
    fn redis_store_matches_model(ops in ops()) {
        redis_case("IDEMGATE_TEST_REDIS_URL", &ops)?;
    }

    /// On Valkey 8.1+, where `complete` and `renew` replace the value this replica last wrote
    /// with `SET … IFEQ`.
    #[test]
    fn valkey_store_matches_model(ops in ops()) {
        redis_case("IDEMGATE_TEST_VALKEY_URL", &ops)?;
    }
}

#[cfg(feature = "postgres")]
impl Swept for idemgate_stores::PostgresStore {
    async fn sweep_at(&self, now: Millis) -> Result<usize, StoreError> {
        self.sweep(now).await
    }
}

#[cfg(feature = "postgres")]
proptest! {
    #![proptest_config(config(8))]

    #[test]
    fn postgres_store_matches_model(ops in ops()) {
        let Ok(url) = std::env::var("IDEMGATE_TEST_PG_URL") else {
            println!("skipped: IDEMGATE_TEST_PG_URL not set");
            return Ok(());
        };
        block_on(async {
            // A schema of its own per case: a fresh table, and a sweep that sees only it.
            let schema = format!("idemgate_model_{:x}", LeaseToken::random().0 >> 64);
            let (admin, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.expect("connect");
            tokio::spawn(conn);
            admin.batch_execute(&format!("CREATE SCHEMA {schema}")).await.expect("schema");
            let sep = if url.contains('?') { '&' } else { '?' };
            let scoped = format!("{url}{sep}options=-c%20search_path%3D{schema}");
            let mut config = idemgate_stores::PostgresConfig::new(scoped);
            config.pool_size = 2;
            config.timeout = std::time::Duration::from_secs(10);
            let store = idemgate_stores::PostgresStore::new(&config).expect("postgres store");
            let result = check(&store, &ops, START).await;
            drop(store);
            let _ = admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await;
            result
        })?;
    }
}
