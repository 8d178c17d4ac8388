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
