//! What a replay allocates in the engine and the memory store (issue: no allocation on the
//! replay path that can be avoided). dhat's testing allocator counts the allocations made
//! during one `Engine::begin` that replays a completed key, and the test holds the count to
//! what is left that the types need: each one is named below. A new copy on this path fails it.

use std::sync::Arc;

use bytes::Bytes;
use idemgate_core::engine::{Engine, Outcome, Policy, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::memory::MemoryStore;
use idemgate_core::record::StoredResponse;

#[global_allocator]
static ALLOCATOR: dhat::Alloc = dhat::Alloc;

/// Allocations made while `f` runs (this test binary runs nothing else meanwhile).
fn counted<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = dhat::HeapStats::get().total_blocks;
    let out = f();
    (out, dhat::HeapStats::get().total_blocks - before)
}

#[test]
fn a_replay_allocates_only_what_its_answer_holds() {
    let _profiler = dhat::Profiler::builder().testing().build();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let engine = Engine::new(Arc::new(MemoryStore::new(1 << 20)));
    let policy = Policy::default();
    let fp = Fingerprint([7; 32]);
    rt.block_on(async {
        let Started::Execute(exec) = engine.begin("t:p:s:k", "orders", fp, &policy).await.unwrap() else {
            panic!("the first request executes");
        };
        let stored = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), Bytes::from_static(b"application/json"))],
            body: Some(Bytes::from_static(b"{\"id\":1}")),
        };
        exec.finish(Outcome::Response(stored)).await.unwrap();
    });

    let (started, allocations) = counted(|| rt.block_on(engine.begin("t:p:s:k", "orders", fp, &policy)));
    let Ok(Started::Replay { response, .. }) = started else {
        panic!("the retry replays: {started:?}");
    };
    assert_eq!(response.body.as_deref(), Some(&b"{\"id\":1}"[..]));
    // What is left, each held by the answer or by the lead while the store is asked:
    // - the key's lead: the key (shared with the lead table) and the leading route;
    // - the decoded record: operation id, route, header vector, header name, header value,
    //   body;
    // - the box `Begin::Replay` keeps the record in.
    // Before the record was taken instead of copied, and the operation id made on the stack,
    // this was 18.
    assert!(allocations <= 9, "a replay allocated {allocations} times");
}
