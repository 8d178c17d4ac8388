//! Every store runs the same conformance suite; the shared stores (Redis, PostgreSQL) also
//! show what only they can: two handles acting as two replicas, reconnecting after their server
//! restarts or their connections are killed, bounded calls on a paused server, and the round
//! trips a miss costs.

mod support;

mod memory {
    use std::sync::Arc;

    use idemgate_core::MemoryStore;

    idemgate_stores::store_conformance!(async { Some(Arc::new(MemoryStore::new(64 * 1024 * 1024))) });
}

#[cfg(feature = "embedded")]
mod embedded {
    use std::sync::Arc;

    use idemgate_stores::EmbeddedStore;

    async fn open() -> Option<Arc<EmbeddedStore>> {
        // The directory is leaked on purpose: the writer thread may still hold the file while
        // the test's last assertions run; the OS temp dir is cleaned outside the test.
        let dir = std::env::temp_dir().join(format!("idemgate-conf-{}", rand_suffix()));
        Some(Arc::new(EmbeddedStore::open(&dir).expect("open embedded store")))
    }

    fn rand_suffix() -> u128 {
        idemgate_core::LeaseToken::random().0
    }

    idemgate_stores::store_conformance!(open());

    /// The same suite with replies handed out by the answerer task, as the gateway runs it.
    mod answered {
        use std::sync::Arc;

        use idemgate_stores::EmbeddedStore;

        async fn open() -> Option<Arc<EmbeddedStore>> {
            let store = super::open().await?;
            store.spawn_answerer();
            Some(store)
        }

        idemgate_stores::store_conformance!(open());
    }
}

/// Redis (`IDEMGATE_TEST_REDIS_URL`), one shared server; keys are unique per test.
mod redis {
    use std::sync::Arc;
    use std::time::Duration;

    use idemgate_core::record::now_millis;
    use idemgate_core::{Begin, LeaseToken, Store, StoreError};
    use tokio::time::Instant;

    use crate::support::{self, RedisServer, eventually, key, req, response};

    use idemgate_stores::{RedisConfig, RedisStore};

    async fn open() -> Option<Arc<RedisStore>> {
        support::redis_store("IDEMGATE_TEST_REDIS_URL")
    }

    idemgate_stores::store_conformance!(open());

    /// A server of the test's own (to stop, pause or fill), when the suite runs on Redis at all.
    async fn own_server() -> Option<RedisServer> {
        if std::env::var("IDEMGATE_TEST_REDIS_URL").is_err() {
            println!("skipped: IDEMGATE_TEST_REDIS_URL not set");
            return None;
        }
        RedisServer::start().await
    }

    fn on(url: &str, timeout: Duration) -> Arc<RedisStore> {
        let mut config = RedisConfig::new(url);
        config.timeout = timeout;
        Arc::new(RedisStore::new(&config).expect("redis store"))
    }

    /// A store with `timeout` on a server of its own, connected, then paused (`CLIENT PAUSE`)
    /// for `pause_ms`.
    async fn paused(timeout: Duration, pause_ms: &str) -> Option<(RedisServer, Arc<RedisStore>)> {
        let server = own_server().await?;
        let store = on(&server.url(), timeout);
        store.ping().await.unwrap();
        server.command(&["CLIENT", "PAUSE", pause_ms, "ALL"]).await;
        Some((server, store))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_handles_act_as_two_replicas() {
        let (Some(a), Some(b)) = (open().await, open().await) else {
            return;
        };
        support::two_handles_race_and_wake(a, b).await;
    }

    /// A miss is two round trips: begin's `SET NX GET` and the complete script.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_miss_costs_two_round_trips() {
        let Some(store) = open().await else { return };
        // Warm up: connect and load the scripts (EVALSHA, NOSCRIPT, SCRIPT LOAD, EVALSHA).
        let k = key("rt-warm");
        let t = LeaseToken::random();
        store.begin(&k, &req(t, now_millis())).await.unwrap();
        store
            .complete(&k, t, &response(), 60_000, now_millis())
            .await
            .unwrap();
        store
            .begin(&k, &req(LeaseToken::random(), now_millis()))
            .await
            .unwrap();
        let before = store.round_trips();
        let k = key("rt");
        let t = LeaseToken::random();
        store.begin(&k, &req(t, now_millis())).await.unwrap();
        store
            .complete(&k, t, &response(), 60_000, now_millis())
            .await
            .unwrap();
        assert_eq!(store.round_trips() - before, 2);
        let before = store.round_trips();
        let replay = store
            .begin(&k, &req(LeaseToken::random(), now_millis()))
            .await
            .unwrap();
        assert!(matches!(replay, Begin::Replay(_)));
        assert_eq!(store.round_trips() - before, 1, "a replay is one round trip");
    }

    /// Redis killed (`kill -9`) and restarted on the same port: calls fail within their bound
    /// while it is down, then work again on the same store value, and waiters are woken by
    /// pub/sub again (the subscriber re-subscribed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reconnects_after_the_server_restarts() {
        let Some(mut server) = own_server().await else {
            return;
        };
        let timeout = Duration::from_millis(500);
        let (a, b) = (on(&server.url(), timeout), on(&server.url(), timeout));
        let k = key("restart");
        let t = LeaseToken::random();
        a.begin(&k, &req(t, now_millis())).await.unwrap();
        a.complete(&k, t, &response(), 60_000, now_millis())
            .await
            .unwrap();
        server.kill9();
        let started = Instant::now();
        let down = a.begin(&k, &req(LeaseToken::random(), now_millis())).await;
        assert!(down.is_err(), "{down:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "bounded while down");
        server.restart().await;
        // The append-only file kept the record; the same store value reconnects.
        let replay = eventually(Duration::from_secs(10), || async {
            a.begin(&k, &req(LeaseToken::random(), now_millis())).await
        })
        .await;
        assert!(matches!(replay, Begin::Replay(_)), "{replay:?}");
        eventually(Duration::from_secs(10), || b.ping()).await;
        support::waiter_woken_across(a, b, Duration::from_secs(10)).await;
    }

    /// The subscriber's connection killed (`CLIENT KILL TYPE pubsub`) just before the owner
    /// completes: it comes back and wakes every waiter to re-check, so a completion published
    /// while it was away still ends the wait at once rather than at the owner's 30 s lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_subscription_only_delays_waiters() {
        let Some(server) = own_server().await else {
            return;
        };
        let timeout = Duration::from_millis(500);
        let (a, b) = (on(&server.url(), timeout), on(&server.url(), timeout));
        eventually(Duration::from_secs(5), || b.ping()).await;
        // Right before the owner completes, the subscriber is cut off and cannot come back
        // (a password it does not know; connections already open stay authenticated), so the
        // completion is published to nobody. 300 ms later it may reconnect again.
        let admin = redis::Client::open(server.url()).unwrap();
        let mut admin = admin.get_multiplexed_async_connection().await.unwrap();
        let cut_off = async || {
            let mut cmd = redis::cmd("CONFIG");
            cmd.arg("SET").arg("requirepass").arg("not-known-to-the-store");
            let _: () = cmd.query_async(&mut admin).await.unwrap();
            let _: redis::Value = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("pubsub")
                .query_async(&mut admin)
                .await
                .unwrap();
            let mut admin = admin.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let mut cmd = redis::cmd("CONFIG");
                cmd.arg("SET").arg("requirepass").arg("");
                let _: () = cmd.query_async(&mut admin).await.unwrap();
            });
        };
        support::waiter_woken_across_with(a, b, Duration::from_secs(10), cut_off).await;
    }

    /// A full Redis (`maxmemory` reached under `noeviction`) refuses `SET` even where it would
    /// only read. A `begin` then still answers what a read can: a replay, a key in flight, a
    /// mismatch. Only a new reservation is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_server_still_answers_replays() {
        let Some(server) = own_server().await else {
            return;
        };
        let store = on(&server.url(), Duration::from_secs(2));
        let now = now_millis();
        let (done, flying) = (key("full-done"), key("full-flying"));
        let owner = LeaseToken::random();
        store.begin(&done, &req(owner, now)).await.unwrap();
        store
            .complete(&done, owner, &response(), 60_000, now)
            .await
            .unwrap();
        store
            .begin(&flying, &req(LeaseToken::random(), now))
            .await
            .unwrap();
        server
            .command(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
            .await;
        server.command(&["CONFIG", "SET", "maxmemory", "1"]).await;
        let refused = store
            .begin(&key("full-new"), &req(LeaseToken::random(), now))
            .await;
        assert!(matches!(refused, Err(StoreError::Backend(_))), "{refused:?}");
        let replay = store.begin(&done, &req(LeaseToken::random(), now)).await.unwrap();
        assert!(matches!(replay, Begin::Replay(_)), "{replay:?}");
        let waiting = store
            .begin(&flying, &req(LeaseToken::random(), now))
            .await
            .unwrap();
        assert!(matches!(waiting, Begin::InFlight { .. }), "{waiting:?}");
        let mut other = req(LeaseToken::random(), now);
        other.fingerprint = support::fp(2);
        let mismatch = store.begin(&done, &other).await.unwrap();
        assert!(matches!(mismatch, Begin::Mismatch { .. }), "{mismatch:?}");
    }

    /// A reply slower than redis-rs's own default bound (500 ms) but within the configured
    /// timeout is waited for: one attempt, answered (the client's default once failed every
    /// such attempt at 500 ms and retried it until the deadline).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_reply_within_the_timeout_is_waited_for() {
        let Some((_server, store)) = paused(Duration::from_secs(5), "900").await else {
            return;
        };
        let (started, before) = (Instant::now(), store.round_trips());
        let r = store
            .begin(&key("slow"), &req(LeaseToken::random(), now_millis()))
            .await;
        assert!(matches!(r, Ok(Begin::Acquired { .. })), "{r:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(700),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(store.round_trips() - before, 1, "one attempt");
    }

    /// `CLIENT PAUSE` longer than the timeout: calls end in `Timeout` at the bound.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_server_gives_bounded_timeouts() {
        let Some((_server, store)) = paused(Duration::from_millis(300), "2000").await else {
            return;
        };
        let started = Instant::now();
        let r = store
            .begin(&key("paused"), &req(LeaseToken::random(), now_millis()))
            .await;
        assert!(matches!(r, Err(StoreError::Timeout)), "{r:?}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
            "{took:?}"
        );
        // The maintenance sweep is bounded the same way (the pause lasts 2 s).
        let started = Instant::now();
        let r = store.sweep(now_millis()).await;
        assert!(matches!(r, Err(StoreError::Timeout)), "{r:?}");
        assert!(
            started.elapsed() < Duration::from_millis(1200),
            "{:?}",
            started.elapsed()
        );
    }

    /// The maintenance sweep deletes the records expired at the given instant, and only those.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sweep_removes_expired_records_only() {
        let Some(server) = own_server().await else {
            return;
        };
        let store = on(&server.url(), Duration::from_secs(2));
        let now = now_millis();
        let (short, long) = (key("sweep-short"), key("sweep-long"));
        for (k, retention) in [(&short, 1_000), (&long, 3_600_000)] {
            let t = LeaseToken::random();
            store.begin(k, &req(t, now)).await.unwrap();
            store.complete(k, t, &response(), retention, now).await.unwrap();
        }
        assert_eq!(store.sweep(now).await.unwrap(), 0, "nothing expired yet");
        assert_eq!(store.sweep(now + 10_000).await.unwrap(), 1);
        assert!(
            store.get(&short, now).await.unwrap().is_none(),
            "the expired record is gone"
        );
        assert!(
            store.get(&long, now).await.unwrap().is_some(),
            "the live one stays"
        );
    }
}

/// PostgreSQL (`IDEMGATE_TEST_PG_URL`), one shared database; keys are unique per test.
mod postgres {
    use std::sync::Arc;
    use std::time::Duration;

    use idemgate_core::record::now_millis;
    use idemgate_core::{Begin, LeaseToken, Store, StoreError};
    use tokio::time::Instant;

    use crate::support::{self, eventually, key, req, response};

    use idemgate_stores::{PostgresConfig, PostgresStore};

    async fn open() -> Option<Arc<PostgresStore>> {
        let Ok(url) = std::env::var("IDEMGATE_TEST_PG_URL") else {
            println!("skipped: IDEMGATE_TEST_PG_URL not set");
            return None;
        };
        let mut config = PostgresConfig::new(url);
        config.pool_size = 4;
        Some(Arc::new(PostgresStore::new(&config).expect("postgres store")))
    }

    idemgate_stores::store_conformance!(open());

    fn url() -> Option<String> {
        let url = std::env::var("IDEMGATE_TEST_PG_URL").ok();
        if url.is_none() {
            println!("skipped: IDEMGATE_TEST_PG_URL not set");
        }
        url
    }

    /// `url` with its own `application_name` (so a test can terminate only its connections)
    /// and, when `schema` is given, its own `search_path`.
    fn tagged(url: &str, name: &str, schema: Option<&str>) -> String {
        let sep = if url.contains('?') { '&' } else { '?' };
        let mut out = format!("{url}{sep}application_name={name}");
        if let Some(schema) = schema {
            out.push_str(&format!("&options=-c%20search_path%3D{schema}"));
        }
        out
    }

    fn on(url: &str, timeout: Duration, pool_size: usize) -> Arc<PostgresStore> {
        let mut config = PostgresConfig::new(url);
        config.timeout = timeout;
        config.pool_size = pool_size;
        Arc::new(PostgresStore::new(&config).expect("postgres store"))
    }

    async fn session(url: &str) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        client
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_handles_act_as_two_replicas() {
        let (Some(a), Some(b)) = (open().await, open().await) else {
            return;
        };
        support::two_handles_race_and_wake(a, b).await;
    }

    /// A miss is two statements (begin, complete) once they are prepared on the connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_miss_costs_two_round_trips() {
        let Some(url) = url() else { return };
        let store = on(&url, Duration::from_secs(5), 1);
        let k = key("rt-warm");
        let t = LeaseToken::random();
        store.begin(&k, &req(t, now_millis())).await.unwrap();
        store
            .complete(&k, t, &response(), 60_000, now_millis())
            .await
            .unwrap();
        store
            .begin(&k, &req(LeaseToken::random(), now_millis()))
            .await
            .unwrap();
        let before = store.round_trips();
        let k = key("rt");
        let t = LeaseToken::random();
        store.begin(&k, &req(t, now_millis())).await.unwrap();
        store
            .complete(&k, t, &response(), 60_000, now_millis())
            .await
            .unwrap();
        assert_eq!(store.round_trips() - before, 2);
        let before = store.round_trips();
        let replay = store
            .begin(&k, &req(LeaseToken::random(), now_millis()))
            .await
            .unwrap();
        assert!(matches!(replay, Begin::Replay(_)));
        assert_eq!(store.round_trips() - before, 1, "a replay is one round trip");
    }

    /// Every connection of the store (pool and LISTEN) terminated by `pg_terminate_backend`:
    /// the next calls work on fresh connections, and waiters are woken by NOTIFY again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reconnects_after_its_connections_are_terminated() {
        let Some(base) = url() else { return };
        let name = format!("idemgate-conf-{:x}", LeaseToken::random().0 >> 64);
        let url = tagged(&base, &name, None);
        let (a, b) = (
            on(&url, Duration::from_secs(2), 4),
            on(&url, Duration::from_secs(2), 4),
        );
        let admin = session(&base).await;
        let k = key("terminated");
        let t = LeaseToken::random();
        a.begin(&k, &req(t, now_millis())).await.unwrap();
        b.ping().await.unwrap();
        let terminated = admin
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&name],
            )
            .await
            .unwrap()
            .len();
        assert!(terminated >= 2, "terminated {terminated} connections");
        // The owner's complete lands on a fresh connection: the operation is not lost.
        a.complete(&k, t, &response(), 60_000, now_millis())
            .await
            .unwrap();
        let replay = b
            .begin(&k, &req(LeaseToken::random(), now_millis()))
            .await
            .unwrap();
        assert!(matches!(replay, Begin::Replay(_)), "{replay:?}");
        // Both LISTEN connections come back (a waiter is woken well before the 30 s lease).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let listening: i64 = admin
                .query_one("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND (query LIKE 'LISTEN%' OR query LIKE '%idemgate-listen%')", &[&name])
                .await
                .unwrap()
                .get(0);
            if listening >= 2 {
                break;
            }
            assert!(Instant::now() < deadline, "LISTEN connections did not come back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        support::waiter_woken_across(a, b, Duration::from_secs(10)).await;
    }

    /// A table locked by someone else (a hung database, as far as the store can tell): calls
    /// end in `Timeout` at the bound. In a schema of its own, so other tests do not stall.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_database_gives_bounded_timeouts() {
        let Some(base) = url() else { return };
        let schema = format!("idemgate_stall_{:x}", LeaseToken::random().0 >> 64);
        let mut admin = session(&base).await;
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .await
            .unwrap();
        let store = on(
            &tagged(&base, "idemgate-stall", Some(&schema)),
            Duration::from_millis(300),
            2,
        );
        eventually(Duration::from_secs(10), || store.ping()).await;
        let txn = admin.transaction().await.unwrap();
        txn.batch_execute(&format!(
            "LOCK TABLE {schema}.idemgate_records IN ACCESS EXCLUSIVE MODE"
        ))
        .await
        .unwrap();
        let started = Instant::now();
        let r = store
            .begin(&key("stalled"), &req(LeaseToken::random(), now_millis()))
            .await;
        let took = started.elapsed();
        txn.rollback().await.unwrap();
        assert!(matches!(r, Err(StoreError::Timeout)), "{r:?}");
        // The connection cut off by the timeout was closed, not pooled: the next call is fine.
        let next = store
            .begin(&key("after-stall"), &req(LeaseToken::random(), now_millis()))
            .await;
        assert!(matches!(next, Ok(Begin::Acquired { .. })), "{next:?}");
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
            "{took:?}"
        );
        drop(store);
        admin
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .unwrap();
    }

    /// The documented row-level security: once enabled, a role that does not own the table
    /// sees only the records of the tenant its session names, and nothing without one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn row_level_security_confines_a_tenant() {
        let Some(base) = url() else { return };
        let suffix = format!("{:x}", LeaseToken::random().0 >> 64);
        let (schema, role) = (
            format!("idemgate_rls_{suffix}"),
            format!("idemgate_rls_reader_{suffix}"),
        );
        let admin = session(&base).await;
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .await
            .unwrap();
        let store = on(
            &tagged(&base, "idemgate-rls", Some(&schema)),
            Duration::from_secs(5),
            1,
        );
        for key in [
            "t-acme:p:user%3A1:k1",
            "t-acme:_tenant:*:k2",
            "t-globex:p:user%3A2:k3",
            "t-*:*:*:k4",
        ] {
            let b = store
                .begin(key, &req(LeaseToken::random(), now_millis()))
                .await
                .unwrap();
            assert!(matches!(b, Begin::Acquired { .. }));
        }
        admin
            .batch_execute(&format!(
                "ALTER TABLE {schema}.idemgate_records ENABLE ROW LEVEL SECURITY;
                 CREATE ROLE {role};
                 GRANT USAGE ON SCHEMA {schema} TO {role};
                 GRANT SELECT ON {schema}.idemgate_records TO {role};"
            ))
            .await
            .unwrap();
        let visible = |tenant: Option<&'static str>| {
            let (admin, schema, role) = (&admin, &schema, &role);
            async move {
                let set = tenant.map_or_else(String::new, |t| format!("SET LOCAL idemgate.tenant = '{t}';"));
                admin
                    .batch_execute(&format!("BEGIN; SET LOCAL ROLE {role}; {set}"))
                    .await
                    .unwrap();
                let keys: Vec<String> = admin
                    .query(
                        &format!("SELECT key FROM {schema}.idemgate_records ORDER BY key"),
                        &[],
                    )
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                admin.batch_execute("ROLLBACK").await.unwrap();
                keys
            }
        };
        assert_eq!(
            visible(Some("acme")).await,
            ["t-acme:_tenant:*:k2", "t-acme:p:user%3A1:k1"]
        );
        assert_eq!(visible(Some("globex")).await, ["t-globex:p:user%3A2:k3"]);
        assert!(visible(None).await.is_empty(), "no tenant, no rows");
        // The gateway's role owns the table and still serves every tenant.
        assert!(
            store
                .get("t-globex:p:user%3A2:k3", now_millis())
                .await
                .unwrap()
                .is_some()
        );
        drop(store);
        admin
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE; DROP ROLE {role};"))
            .await
            .unwrap();
    }

    /// Two stores migrating the same fresh schema at once apply each version once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_migrations_apply_once() {
        let Some(base) = url() else { return };
        let schema = format!("idemgate_migrate_{:x}", LeaseToken::random().0 >> 64);
        let admin = session(&base).await;
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .await
            .unwrap();
        let url = tagged(&base, "idemgate-migrate", Some(&schema));
        let stores: Vec<_> = (0..4).map(|_| on(&url, Duration::from_secs(10), 1)).collect();
        let runs: Vec<_> = stores
            .iter()
            .map(|s| {
                let s = s.clone();
                tokio::spawn(async move { s.migrate().await })
            })
            .collect();
        for r in runs {
            r.await.unwrap().unwrap();
        }
        let versions: Vec<i32> = admin
            .query(
                &format!("SELECT version FROM {schema}.idemgate_migrations ORDER BY version"),
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(versions, vec![1, 2]);
        drop(stores);
        admin
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .unwrap();
    }
}
