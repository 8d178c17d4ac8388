use bytes::Bytes;
use std::future::Future;

use proptest::prelude::*;

use super::entry::{HEADER_NAMES, OP_HYPHENATED_UUID, OP_PREFIXED_UUID};
use super::*;
use crate::fingerprint::Fingerprint;
use crate::record::RecordState;

fn req(token: LeaseToken, now: Millis) -> BeginRequest<'static> {
    BeginRequest {
        fingerprint: Fingerprint([1; 32]),
        route: "r",
        token,
        operation_id: "op",
        lease_ms: 1_000,
        retention_ms: 10_000,
        takeover: true,
        now,
    }
}

#[tokio::test]
async fn a_sweep_removes_exactly_the_records_due() {
    let store = MemoryStore::new(1 << 30);
    // Records expiring every 250 ms over 50 s (retention 10 s from their begin).
    let keys: Vec<(String, Millis)> = (0..200u64)
        .map(|i| (format!("k{i}"), 1_000_000 + i * 250))
        .collect();
    for (key, now) in &keys {
        store.begin(key, &req(LeaseToken::random(), *now)).await.unwrap();
    }
    // One record moves its expiry later (completed 30 s after its begin): its old bucket
    // entry goes stale and must not remove it.
    let (moved, begun) = (&keys[0].0, keys[0].1);
    let token = match store.get(moved, begun).await.unwrap().unwrap().state {
        RecordState::InFlight { token, .. } => token,
        RecordState::Completed { .. } => unreachable!(),
    };
    let ok = StoredResponse {
        status: 200,
        headers: vec![],
        body: Some(Bytes::from_static(b"{}")),
    };
    store
        .complete(moved, token, &ok, 10_000, begun + 5_000)
        .await
        .unwrap();
    let moved_expiry = begun + 15_000;
    for sweep_at in [1_005_000, 1_010_000, 1_010_001, 1_022_222, 1_035_000, 1_060_000] {
        store.sweep(sweep_at);
        for (key, begun) in &keys {
            let expiry = if key == moved {
                moved_expiry
            } else {
                begun + 10_000
            };
            let present = lock(&store.shards[shard_of(store.hash(key.as_bytes()))])
                .find(store.hash(key.as_bytes()), |s| {
                    entry_key(&s.entry) == Some(key.as_bytes())
                })
                .is_some();
            assert_eq!(
                present,
                sweep_at < expiry,
                "{key} (expires {expiry}) after a sweep at {sweep_at}"
            );
        }
    }
    assert!(store.is_empty());
    assert_eq!(store.used_bytes(), 0);
    let indexed: usize = store
        .expiries
        .iter()
        .map(|e| lock(e).values().map(Vec::len).sum::<usize>())
        .sum();
    assert_eq!(indexed, 0, "the index keeps nothing once every record is gone");
}

#[tokio::test]
async fn a_full_store_refuses_new_keys_but_never_evicts_live_ones() {
    let store = MemoryStore::new(1_000);
    let mut held = Vec::new();
    let mut i = 0;
    let refused = loop {
        let key = format!("k{i}");
        match store.begin(&key, &req(LeaseToken::random(), 0)).await {
            Ok(Begin::Acquired { .. }) => held.push(key),
            Err(StoreError::Full) => break key,
            other => panic!("{other:?}"),
        }
        i += 1;
    };
    assert!(!held.is_empty());
    // Every live record is still there, and the refused key left nothing behind.
    for key in &held {
        assert!(store.get(key, 0).await.unwrap().is_some(), "{key} was evicted");
    }
    assert!(store.get(&refused, 0).await.unwrap().is_none());
    // Once records expire and are swept, there is room again.
    assert_eq!(store.sweep(20_000), held.len());
    assert_eq!(store.used_bytes(), 0);
    assert!(matches!(
        store.begin(&refused, &req(LeaseToken::random(), 20_000)).await,
        Ok(Begin::Acquired { .. })
    ));
}

/// A completed record as the gateway stores one: a namespaced key, a UUIDv7 operation id,
/// a JSON body and its content type.
fn typical(body: &[u8]) -> (String, Record) {
    let key = "t-*:*:*:order-2f6c1a9e-7b41-4c3e-9d0a-5e8f3b2c1d7a".to_owned();
    let now = 1_767_225_600_000;
    let rec = Record {
        state: RecordState::Completed {
            token: LeaseToken(u128::MAX / 3),
            response: StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), Bytes::from_static(b"application/json"))],
                body: Some(Bytes::copy_from_slice(body)),
            },
        },
        fingerprint: Fingerprint([0xab; 32]),
        route: "orders".into(),
        operation_id: crate::engine::new_operation_id(),
        created_at: now,
        expires_at: now + 86_400_000,
        generation: 1,
    };
    (key, rec)
}

fn round_trip(store: &MemoryStore, key: &str, rec: &Record) -> Result<(), TestCaseError> {
    let entry = store.encode(key, rec);
    prop_assert_eq!(entry_key(&entry), Some(key.as_bytes()));
    prop_assert_eq!(entry_expires_at(&entry), Some(rec.expires_at));
    prop_assert_eq!(&store.decode(&entry).unwrap(), rec);
    // A damaged entry is an error (or, cut inside the body, a shorter body), never a panic.
    for cut in (0..entry.len()).filter(|c| *c < 200 || c % 61 == 0) {
        let _ = store.decode(&entry[..cut]);
        let _ = entry_expires_at(&entry[..cut]);
        let _ = Head::read(&entry[..cut]);
    }
    Ok(())
}

fn uuid_bytes() -> impl Strategy<Value = uuid::Uuid> {
    any::<[u8; 16]>().prop_map(uuid::Uuid::from_bytes)
}

fn operation_id() -> impl Strategy<Value = String> {
    prop_oneof![
        uuid_bytes().prop_map(|u| format!("op_{}", u.simple())),
        uuid_bytes().prop_map(|u| u.hyphenated().to_string()),
        // Near misses that must stay as they are: other case, other forms, other lengths.
        uuid_bytes().prop_map(|u| format!("op_{}", u.simple()).to_uppercase()),
        uuid_bytes().prop_map(|u| format!("op_{}", u.hyphenated())),
        uuid_bytes().prop_map(|u| u.urn().to_string()),
        uuid_bytes().prop_map(|u| u.braced().to_string()),
        uuid_bytes().prop_map(|u| u.hyphenated().to_string().to_uppercase()),
        "op_[0-9a-fA-F]{30,34}",
        "op",
        ".{0,40}",
    ]
}

fn millis() -> impl Strategy<Value = Millis> {
    prop_oneof![
        any::<u64>(),
        Just(0),
        Just(Millis::MAX),
        1_700_000_000_000..1_900_000_000_000u64,
    ]
}

fn response() -> impl Strategy<Value = StoredResponse> {
    let name = prop_oneof![
        proptest::sample::select(HEADER_NAMES).prop_map(str::to_owned),
        "[a-z-]{0,24}",
        ".{0,8}",
    ];
    let value = proptest::collection::vec(any::<u8>(), 0..80).prop_map(Bytes::from);
    let body = proptest::option::of(proptest::collection::vec(any::<u8>(), 0..3000).prop_map(Bytes::from));
    (
        any::<u16>(),
        proptest::collection::vec((name, value), 0..40),
        body,
    )
        .prop_map(|(status, headers, body)| StoredResponse {
            status,
            headers,
            body,
        })
}

fn record() -> impl Strategy<Value = Record> {
    let state = prop_oneof![
        (any::<u128>(), millis()).prop_map(|(t, lease_until)| RecordState::InFlight {
            token: LeaseToken(t),
            lease_until
        }),
        (any::<u128>(), response()).prop_map(|(t, response)| RecordState::Completed {
            token: LeaseToken(t),
            response
        }),
    ];
    let route = prop_oneof!["[a-z]{1,6}", ".{0,20}"];
    (
        state,
        any::<[u8; 32]>(),
        route,
        operation_id(),
        (millis(), millis(), any::<u64>()),
    )
        .prop_map(
            |(state, fp, route, operation_id, (created_at, expires_at, generation))| Record {
                state,
                fingerprint: Fingerprint(fp),
                route,
                operation_id,
                created_at,
                expires_at,
                generation,
            },
        )
}

proptest! {
    #[test]
    fn every_record_round_trips_through_its_entry(key in ".{0,300}", rec in record()) {
        let store = MemoryStore::new(usize::MAX);
        round_trip(&store, &key, &rec)?;
    }

    #[test]
    fn records_share_one_store_s_route_table(recs in proptest::collection::vec((".{0,20}", record()), 1..20)) {
        let store = MemoryStore::new(usize::MAX);
        let entries: Vec<_> = recs.iter().map(|(k, r)| store.encode(k, r)).collect();
        for ((key, rec), entry) in recs.iter().zip(&entries) {
            prop_assert_eq!(entry_key(entry), Some(key.as_bytes()));
            prop_assert_eq!(&store.decode(entry).unwrap(), rec);
        }
    }
}

/// What `complete` must do to `rec`, written out from SPEC's rules rather than taken from
/// `rules`, so the property below also checks the rule: `None` fenced, `Some(None)` nothing to
/// write (a retry after it took effect), `Some(Some(record))` the completed record.
fn expected_completion(
    rec: &Record,
    token: LeaseToken,
    response: &StoredResponse,
    retention_ms: u64,
    now: Millis,
) -> Option<Option<Record>> {
    if now >= rec.expires_at {
        return None;
    }
    match &rec.state {
        RecordState::InFlight { token: t, .. } if *t == token => Some(Some(Record {
            state: RecordState::Completed {
                token,
                response: response.clone(),
            },
            expires_at: now + retention_ms,
            ..rec.clone()
        })),
        RecordState::Completed { token: t, .. } if *t == token => Some(None),
        _ => None,
    }
}

proptest! {
    /// `complete` rewrites an entry from its head: it must decide as the rules say and write,
    /// byte for byte, the entry of the completed record.
    #[test]
    fn completing_in_place_writes_what_the_rule_would(
        key in ".{0,40}",
        rec in record(),
        response in response(),
        owner in any::<bool>(),
        (when, now) in (0..3u8, 0..u64::MAX / 2),
        retention_ms in 0..1u64 << 40,
        inline_route in any::<bool>(),
    ) {
        let store = MemoryStore::new(usize::MAX);
        if inline_route {
            // A full table of interned routes: this record's route is stored inline.
            for i in 0..ROUTE_SLOTS {
                store.routes.intern(&format!("\u{0}filler-{i}"));
            }
        }
        let entry = store.encode(&key, &rec);
        let token = if owner { rec.token() } else { LeaseToken(rec.token().0 ^ 1) };
        // Either side of the record's expiry, or any time.
        let now = match when {
            0 => rec.expires_at.saturating_sub(1),
            1 => rec.expires_at,
            _ => now,
        }
        .min(u64::MAX / 2);
        let expected = expected_completion(&rec, token, &response, retention_ms, now);
        let head = Head::read(&entry).unwrap();
        prop_assert_eq!(head.standing, rec.standing());
        match (expected, rules::completion(head.standing, token, retention_ms, now)) {
            (None, Err(_)) | (Some(None), Ok(None)) => {}
            (Some(Some(done)), Ok(Some(expires_at))) => {
                let written = exact(&Completion { head: &head, response: &response, expires_at });
                prop_assert_eq!(&written, &store.encode(&key, &done));
                prop_assert_eq!(&store.decode(&written).unwrap(), &done);
            }
            (expected, decided) => prop_assert!(false, "expected {expected:?}, decided {decided:?}"),
        }
    }
}

proptest! {
    /// `begin` on a key with no record writes its in-flight entry straight from the request:
    /// it must answer as `rules::begin` does and write, byte for byte, the entry of the record
    /// that rule puts.
    #[test]
    fn a_first_begin_writes_the_record_the_rule_would(
        key in ".{0,40}",
        (fp, token) in (any::<[u8; 32]>(), any::<u128>()),
        route in prop_oneof!["[a-z]{1,6}", ".{0,20}"],
        operation_id in operation_id(),
        (lease_ms, retention_ms, now) in (0..1u64 << 40, 0..1u64 << 40, 0..1u64 << 60),
        takeover in any::<bool>(),
        inline_route in any::<bool>(),
    ) {
        let store = MemoryStore::new(usize::MAX);
        if inline_route {
            for i in 0..ROUTE_SLOTS {
                store.routes.intern(&format!("\u{0}filler-{i}"));
            }
        }
        let req = BeginRequest {
            fingerprint: Fingerprint(fp),
            route: &route,
            token: LeaseToken(token),
            operation_id: &operation_id,
            lease_ms,
            retention_ms,
            takeover,
            now,
        };
        let (expected, write) = rules::begin(None, &req);
        let Write::Put(rec) = write else {
            return Err(TestCaseError::fail("the rule puts a record for a new key"));
        };
        // The memory store decides without awaiting anything: one poll answers.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let std::task::Poll::Ready(answer) = std::pin::pin!(store.begin(&key, &req)).poll(&mut cx) else {
            return Err(TestCaseError::fail("the memory store's begin is pending"));
        };
        let answer = answer.unwrap();
        prop_assert_eq!(answer, expected);
        let (hash, table) = store.shard(&key);
        let written = &table.find(hash, |s| s.is(hash, &key)).unwrap().entry;
        prop_assert_eq!(written, &store.encode(&key, &rec));
    }
}

/// `complete` copies an in-flight entry's bytes into the completed one, so its reader refuses an
/// entry `decode` refuses for its tail: without its lease, or with bytes after it.
#[test]
fn completion_refuses_an_in_flight_entry_with_a_damaged_tail() {
    let store = MemoryStore::new(usize::MAX);
    let (key, mut rec) = typical(b"{}");
    rec.state = RecordState::InFlight {
        token: rec.token(),
        lease_until: rec.created_at + 30_000,
    };
    let entry = store.encode(&key, &rec);
    assert!(Head::read(&entry).is_ok());
    let cut = &entry[..entry.len() - 1];
    let mut longer = entry.to_vec();
    longer.push(0);
    for damaged in [cut, &longer[..]] {
        assert!(store.decode(damaged).is_err());
        assert!(Head::read(damaged).is_err(), "{damaged:?}");
    }
}

#[test]
fn gateway_operation_ids_are_packed_and_others_kept_verbatim() {
    let id = crate::engine::new_operation_id();
    assert!(matches!(OpId::of(&id), OpId::Uuid(OP_PREFIXED_UUID, _)));
    let hyphenated = uuid::Uuid::now_v7().hyphenated().to_string();
    assert!(matches!(OpId::of(&hyphenated), OpId::Uuid(OP_HYPHENATED_UUID, _)));
    for other in [
        id.to_uppercase(),
        format!("{id}0"),
        id[..34].to_owned(),
        hyphenated.to_uppercase(),
        String::new(),
    ] {
        assert!(matches!(OpId::of(&other), OpId::Raw(_)), "{other}");
    }
}

#[test]
fn routes_past_the_interned_table_are_stored_inline() {
    let store = MemoryStore::new(usize::MAX);
    let (key, mut rec) = typical(b"{}");
    let mut entries = Vec::new();
    for i in 0..ROUTE_SLOTS + 10 {
        rec.route = format!("route-{i}");
        entries.push((store.encode(&key, &rec), rec.clone()));
    }
    assert_eq!(store.routes.len.load(Ordering::Relaxed), ROUTE_SLOTS);
    for (entry, rec) in &entries {
        assert_eq!(&store.decode(entry).unwrap(), rec);
    }
    // An interned route costs one byte; an inline one its name.
    let interned = store.encode(&key, &entries[0].1).len();
    let inline = store.encode(&key, &entries[ROUTE_SLOTS + 9].1).len();
    assert_eq!(inline, interned + 1 + "route-264".len());
}

#[test]
fn a_typical_completed_record_fits_its_body_plus_256_bytes() {
    let store = MemoryStore::new(usize::MAX);
    let body = br#"{"ok":true,"id":"ord_1"}"#;
    let (key, rec) = typical(body);
    let entry = store.encode(&key, &rec);
    // 51 key bytes, 32 fingerprint, 16 token, 16 operation id, 16 content type, the body,
    // and about twenty bytes of lengths, flags, times, status and indexes.
    assert!(
        entry.len() <= key.len() + body.len() + 32 + 16 + 16 + 16 + 24,
        "{}",
        entry.len()
    );
    assert!(cost(&entry) <= body.len() + 256, "{}", cost(&entry));
}

#[tokio::test]
async fn used_bytes_follow_every_write() {
    let store = MemoryStore::new(usize::MAX);
    let (key, done) = typical(br#"{"ok":true}"#);
    let RecordState::Completed { token, response } = &done.state else {
        unreachable!()
    };
    let now = done.created_at;
    let begin = BeginRequest {
        fingerprint: done.fingerprint,
        route: "orders",
        token: *token,
        operation_id: &done.operation_id,
        lease_ms: 30_000,
        retention_ms: 86_400_000,
        takeover: true,
        now,
    };
    let entry_cost = |store: &MemoryStore, key: &str, now| {
        let (hash, table) = store.shard(key);
        let rec = store.find(&table, hash, key).unwrap().unwrap();
        assert!(rec.is_live(now));
        cost(&table.find(hash, |s| s.is(hash, key)).unwrap().entry)
    };

    assert!(matches!(
        store.begin(&key, &begin).await,
        Ok(Begin::Acquired { .. })
    ));
    let in_flight = entry_cost(&store, &key, now);
    assert_eq!(store.used_bytes(), in_flight);
    // A retried begin and a renewal rewrite the record in place: still one record's bytes.
    assert!(matches!(
        store.begin(&key, &begin).await,
        Ok(Begin::Acquired { .. })
    ));
    store.renew(&key, *token, now + 60_000).await.unwrap();
    assert_eq!(store.used_bytes(), entry_cost(&store, &key, now));

    store
        .complete(&key, *token, response, 86_400_000, now)
        .await
        .unwrap();
    let completed = entry_cost(&store, &key, now);
    assert_eq!(store.used_bytes(), completed);
    assert!(completed > in_flight);
    assert!(completed <= response.body.as_ref().unwrap().len() + 256);

    // A second key adds its own bytes; purging and releasing take them back exactly.
    let other = LeaseToken(7);
    let req2 = BeginRequest {
        token: other,
        ..begin.clone()
    };
    store.begin("second", &req2).await.unwrap();
    assert_eq!(store.used_bytes(), completed + entry_cost(&store, "second", now));
    store.release("second", other).await.unwrap();
    assert_eq!(store.used_bytes(), completed);
    assert!(store.purge(&key).await.unwrap());
    assert!(!store.purge(&key).await.unwrap());
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());

    // Many records: the count is the sum of their costs, and sweeping them returns it to 0.
    for i in 0..1_000 {
        let req = BeginRequest {
            token: LeaseToken(i),
            ..begin.clone()
        };
        store.begin(&format!("bulk-{i}"), &req).await.unwrap();
    }
    assert_eq!(store.len(), 1_000);
    let per_record = store.used_bytes() / 1_000;
    assert!((100..200).contains(&per_record), "{per_record}");
    assert_eq!(store.sweep(now + 86_400_000), 1_000);
    assert_eq!(store.used_bytes(), 0);
}
