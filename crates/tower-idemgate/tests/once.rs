//! `once` (case C): at most one run per token under concurrency, stored values returned to later
//! calls, failures and panics release the token, a dropped caller does not lose the outcome.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Counter, Gate, within};
use idemgate_core::MemoryStore;
use idemgate_core::engine::Concurrency;
use idemgate_core::store::Store;
use tower_idemgate::once::{Namespace, Once, OnceError, fingerprint, once};
use tower_idemgate::{Principal, Scope};

#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
struct Receipt {
    run: u64,
}

/// Twenty concurrent calls with one token: the closure runs once, everyone gets its value.
async fn concurrent_calls_run_once<St: Store>(store: Arc<St>) {
    let runs = Arc::new(Counter::default());
    let gate = Gate::closed();
    let ns = Namespace::global("send-receipt");
    let token = common::key("receipt");
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let (store, ns, token, runs, gate) = (
                store.clone(),
                ns.clone(),
                token.clone(),
                runs.clone(),
                gate.clone(),
            );
            tokio::spawn(async move {
                let work = async move {
                    let run = runs.bump();
                    gate.pass().await;
                    Ok::<_, String>(Receipt { run })
                };
                once(&store, &ns, &token, fingerprint(&"order-1"), work).await
            })
        })
        .collect();
    runs.reaches(1).await;
    gate.open();
    for call in calls {
        assert_eq!(within("a call", call).await.unwrap().unwrap(), Receipt { run: 1 });
    }
    assert_eq!(runs.get(), 1);
}

/// A failing closure releases the token; the next call runs; then the value sticks.
async fn a_failure_releases_the_token<St: Store>(store: Arc<St>) {
    let ns = Namespace::global("charge");
    let token = common::key("charge");
    let fp = fingerprint(&("inv-1", 100));
    let failed = once(&store, &ns, &token, fp, async {
        Err::<Receipt, _>("gateway down")
    })
    .await;
    assert!(matches!(failed, Err(OnceError::Failed("gateway down"))));
    let ok = once(&store, &ns, &token, fp, async {
        Ok::<_, &str>(Receipt { run: 2 })
    })
    .await;
    assert_eq!(ok.unwrap(), Receipt { run: 2 });
    let later = once(&store, &ns, &token, fp, async {
        Ok::<_, &str>(Receipt { run: 3 })
    })
    .await;
    assert_eq!(later.unwrap(), Receipt { run: 2 });
}

/// A panicking closure releases the token too (and the panic reaches the caller).
async fn a_panic_releases_the_token<St: Store>(store: Arc<St>) {
    let ns = Namespace::global("panics");
    let token = common::key("panic");
    let fp = fingerprint(&1);
    let caller = {
        let (store, ns, token) = (store.clone(), ns.clone(), token.clone());
        tokio::spawn(async move {
            once(&store, &ns, &token, fp, async {
                if true {
                    panic!("boom (on purpose)");
                }
                Ok::<Receipt, String>(Receipt { run: 0 })
            })
            .await
        })
    };
    let joined = within("the panicking call", caller).await;
    assert!(joined.unwrap_err().is_panic(), "the panic reaches the caller");
    let retry = once(&store, &ns, &token, fp, async {
        Ok::<_, String>(Receipt { run: 7 })
    })
    .await;
    assert_eq!(retry.unwrap(), Receipt { run: 7 });
}

/// The same token for another input is a mismatch, never the stored value.
async fn another_input_is_a_mismatch<St: Store>(store: Arc<St>) {
    let ns = Namespace::global("refund");
    let token = common::key("refund");
    once(&store, &ns, &token, fingerprint(&100), async {
        Ok::<_, String>(Receipt { run: 1 })
    })
    .await
    .unwrap();
    let other = once(&store, &ns, &token, fingerprint(&999), async {
        Ok::<_, String>(Receipt { run: 2 })
    })
    .await;
    assert!(matches!(other, Err(OnceError::Mismatch { .. })), "{other:?}");
}

/// The caller's future is dropped mid-run: the closure finishes and its value is stored.
async fn a_dropped_caller_still_records<St: Store>(store: Arc<St>) {
    let ns = Namespace::global("dropped");
    let token = common::key("dropped");
    let (runs, finished, gate) = (
        Arc::new(Counter::default()),
        Arc::new(Counter::default()),
        Gate::closed(),
    );
    let caller = {
        let (store, ns, token, runs, finished, gate) = (
            store.clone(),
            ns.clone(),
            token.clone(),
            runs.clone(),
            finished.clone(),
            gate.clone(),
        );
        tokio::spawn(async move {
            once(&store, &ns, &token, fingerprint(&0), async move {
                let run = runs.bump();
                gate.pass().await;
                finished.bump();
                Ok::<_, String>(Receipt { run })
            })
            .await
        })
    };
    runs.reaches(1).await;
    caller.abort();
    gate.open();
    finished.reaches(1).await;
    // Waits (by notification) for the record if it is not written yet, then returns the value.
    let again = once(&store, &ns, &token, fingerprint(&0), async {
        Ok::<_, String>(Receipt { run: 99 })
    })
    .await;
    assert_eq!(again.unwrap(), Receipt { run: 1 });
    assert_eq!(runs.get(), 1);
}

/// Scoped namespaces keep principals apart; `reject` refuses a concurrent call at once.
async fn scopes_and_reject<St: Store>(store: Arc<St>) {
    let alice = Namespace::scoped("export", Scope::Subject, Principal::new("t", "p", "user:alice"));
    let bob = Namespace::scoped("export", Scope::Subject, Principal::new("t", "p", "user:bob"));
    let token = common::key("export");
    let a = once(&store, &alice, &token, fingerprint(&0), async {
        Ok::<_, String>(1)
    })
    .await
    .unwrap();
    let b = once(&store, &bob, &token, fingerprint(&0), async {
        Ok::<_, String>(2)
    })
    .await
    .unwrap();
    assert_eq!((a, b), (1, 2));

    let runner = Once::new(store)
        .concurrent(Concurrency::Reject)
        .wait_timeout(Duration::from_secs(5));
    let gate = Gate::closed();
    let entered = Arc::new(Counter::default());
    let token = common::key("busy");
    let first = {
        let (runner, ns, token, gate, entered) = (
            runner.clone(),
            alice.clone(),
            token.clone(),
            gate.clone(),
            entered.clone(),
        );
        tokio::spawn(async move {
            runner
                .run(&ns, &token, fingerprint(&0), async move {
                    entered.bump();
                    gate.pass().await;
                    Ok::<_, String>(1)
                })
                .await
        })
    };
    entered.reaches(1).await;
    let busy = runner
        .run(&alice, &token, fingerprint(&0), async { Ok::<_, String>(2) })
        .await;
    assert!(matches!(busy, Err(OnceError::InFlight { .. })), "{busy:?}");
    gate.open();
    assert_eq!(within("the first call", first).await.unwrap().unwrap(), 1);
}

macro_rules! suite {
    ($($store:ident),*) => {$(
        mod $store {
            suite!(@cases $store: concurrent_calls_run_once, a_failure_releases_the_token,
                a_panic_releases_the_token, another_input_is_a_mismatch, a_dropped_caller_still_records,
                scopes_and_reject);
        }
    )*};
    (@cases $store:ident: $($case:ident),*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            let Some(store) = crate::common::$store().await else { return };
            crate::common::within(stringify!($case), crate::$case(store)).await;
        }
    )*};
}

suite!(memory, embedded, redis, postgres);

#[tokio::test]
async fn values_over_the_limit_are_not_retained() {
    let runner = Once::new(Arc::new(MemoryStore::new(1 << 20))).max_value_bytes(8);
    let ns = Namespace::global("big");
    let first = runner
        .run(&ns, "t", fingerprint(&0), async {
            Ok::<_, String>("x".repeat(100))
        })
        .await;
    assert_eq!(first.unwrap().len(), 100, "the first caller gets its value");
    let again = runner
        .run(&ns, "t", fingerprint(&0), async {
            Ok::<_, String>(String::new())
        })
        .await;
    assert!(matches!(again, Err(OnceError::NotRetained { .. })), "{again:?}");
}
