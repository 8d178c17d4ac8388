//! Every store runs the same conformance suite.

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
}

/// Redis (`IDEMGATE_TEST_REDIS_URL`), one shared server; keys are unique per test.
mod redis {
    use std::sync::Arc;

    use idemgate_stores::{RedisConfig, RedisStore};

    async fn open() -> Option<Arc<RedisStore>> {
        let Ok(url) = std::env::var("IDEMGATE_TEST_REDIS_URL") else {
            println!("skipped: IDEMGATE_TEST_REDIS_URL not set");
            return None;
        };
        Some(Arc::new(
            RedisStore::new(&RedisConfig::new(url)).expect("redis store"),
        ))
    }

    idemgate_stores::store_conformance!(open());
}

/// PostgreSQL (`IDEMGATE_TEST_PG_URL`), one shared database; keys are unique per test.
mod postgres {
    use std::sync::Arc;

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
}
