//! The request fingerprint (SPEC sections 1 and 4.2): what makes a retry "the same request".
//!
//! A [`Fingerprint`] is a SHA-256 over the route id, the method, the normalized path and query
//! and the body, each field length-prefixed. A completed record answers a retry only when the
//! fingerprints match; otherwise the caller reused a key for another request and gets 422.
//!
//! Two kinds of mistakes are possible and they are not equally bad. A false *match* replays a
//! stored response for a request that was never executed (silent data loss); a false *mismatch*
//! answers 422 to an honest retry (loud, and the client can fix it). Normalization here is
//! therefore conservative: it only folds differences that are meaningless by definition (JSON key
//! order and whitespace, query parameter order, an empty `?`), never ones an upstream might read
//! (percent-encoding, trailing slashes, number spelling).

use std::borrow::Cow;
use std::fmt;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

mod canonical;

/// Versions the hashed layout. Fingerprints live in durable records; if the layout ever changes,
/// bumping this makes old and new fingerprints differ instead of colliding by accident.
const DOMAIN: &[u8] = b"idemgate.fingerprint.v1";

/// Tags the body field with how it was hashed, so that a JSON body and a non-JSON body whose raw
/// bytes happen to equal the canonical form (`{"a":1}` sent as `text/plain`) stay different.
const BODY_JSON: &[u8] = b"json";
const BODY_RAW: &[u8] = b"raw";

/// SHA-256 of a request's identity. Compare with [`Fingerprint::ct_eq`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// SHA-256 over length-prefixed fields: route id, method (uppercased), normalized path and
    /// query, body.
    ///
    /// When `content_type` is JSON (`application/json` or any `+json` subtype, parameters
    /// ignored, case-insensitive) and the body parses as JSON, the body is canonicalized first:
    /// object keys sorted by their bytes, no insignificant whitespace. Otherwise the raw bytes
    /// are hashed. Numbers keep their `serde_json` spelling (`1` and `1.0` differ): the upstream
    /// may well treat an integer and a float differently.
    #[must_use]
    pub fn compute(
        route_id: &str,
        method: &str,
        path_and_query: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Self {
        let mut h = Sha256::new();
        field(&mut h, DOMAIN);
        field(&mut h, route_id.as_bytes());
        field(&mut h, uppercase(method).as_bytes());
        field(&mut h, normalize_path_and_query(path_and_query).as_bytes());
        let canonical = content_type
            .filter(|ct| is_json_content_type(ct))
            .and_then(|_| canonical::canonical_json(body));
        if let Some(canonical) = canonical {
            field(&mut h, BODY_JSON);
            field(&mut h, &canonical);
        } else {
            field(&mut h, BODY_RAW);
            field(&mut h, body);
        }
        Fingerprint(h.finalize().into())
    }

    /// Constant-time equality, so that a caller probing with reused keys learns nothing from
    /// timing about how much of a stored fingerprint matched.
    ///
    /// Compared as four 64-bit words: `subtle` pays an optimisation barrier per element, and
    /// byte by byte that was about 600 instructions of every replay (callgrind).
    #[must_use]
    pub fn ct_eq(&self, other: &Self) -> bool {
        let words = |f: &Self| -> [u64; 4] {
            std::array::from_fn(|i| {
                let mut w = [0; 8];
                w.copy_from_slice(&f.0[i * 8..i * 8 + 8]);
                u64::from_ne_bytes(w)
            })
        };
        words(self)[..].ct_eq(&words(other)[..]).into()
    }

    /// The full digest as 64 lowercase hex characters.
    #[must_use]
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Fingerprint {
    /// Short hex: enough to tell fingerprints apart in test output and logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({}…)", hex::encode(&self.0[..8]))
    }
}

/// One field: its length as a u64 big-endian, then its bytes. The prefix keeps field boundaries
/// fixed, so route `ab` + method `C` never hashes like route `a` + method `BC`.
fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// `method` in ASCII uppercase, borrowed when it already is (as methods nearly always are).
fn uppercase(method: &str) -> Cow<'_, str> {
    if method.bytes().any(|b| b.is_ascii_lowercase()) {
        Cow::Owned(method.to_ascii_uppercase())
    } else {
        Cow::Borrowed(method)
    }
}

/// `application/json`, or any `type/something+json` (`application/problem+json`,
/// `application/vnd.api+json`), parameters such as `; charset=utf-8` ignored, case-insensitive.
fn is_json_content_type(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    let Some((ty, subtype)) = essence.split_once('/') else {
        return false;
    };
    let (ty, subtype) = (ty.trim(), subtype.trim().as_bytes());
    (ty.eq_ignore_ascii_case("application") && subtype.eq_ignore_ascii_case(b"json"))
        || (!ty.is_empty()
            && subtype.len() > b"+json".len()
            && subtype[subtype.len() - b"+json".len()..].eq_ignore_ascii_case(b"+json"))
}

/// Normalizes a request target for the fingerprint.
///
/// The path is kept as given. The query is split on `&` into parameters; empty parameters
/// (`a=1&&b=2`, a trailing `&`) are dropped, and the rest are sorted by (name, value) in byte
/// order, duplicates kept: `a=1&b=2` equals `b=2&a=1`, but `a=1&a=1` does not equal `a=1`. A query
/// left empty is removed, so `/x?` equals `/x`. `a` and `a=` stay different (a missing value is
/// not an empty one to every framework).
///
/// Nothing is percent-decoded: `%2F` and `/`, `+` and `%20`, `%7e` and `~` mean different things
/// to different upstreams, and decoding would fold requests the upstream tells apart into one
/// fingerprint (a false replay). A client that re-encodes its retry differently gets a 422
/// instead, which is the safe failure. No fragment handling either: request targets carry none.
#[must_use]
pub fn normalize_path_and_query(path_and_query: &str) -> Cow<'_, str> {
    let Some((path, query)) = path_and_query.split_once('?') else {
        return Cow::Borrowed(path_and_query);
    };
    let mut params: Vec<(&str, Option<&str>, &str)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((name, value)) => (name, Some(value), p),
            None => (p, None, p),
        })
        .collect();
    if params.is_empty() {
        return Cow::Borrowed(path);
    }
    // `str` orders by bytes; `None` (no `=`) sorts before any value.
    params.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    let mut out = String::with_capacity(path_and_query.len());
    out.push_str(path);
    out.push('?');
    for (i, (_, _, raw)) in params.iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        out.push_str(raw);
    }
    if out == path_and_query {
        Cow::Borrowed(path_and_query)
    } else {
        Cow::Owned(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    const JSON: Option<&str> = Some("application/json");

    fn fp(route: &str, method: &str, pq: &str, ct: Option<&str>, body: &[u8]) -> Fingerprint {
        Fingerprint::compute(route, method, pq, ct, body)
    }

    fn fp_json(body: &str) -> Fingerprint {
        fp("r", "POST", "/x", JSON, body.as_bytes())
    }

    #[test]
    fn stable_known_value() {
        // Pins the layout: a change here invalidates every stored record, so bump DOMAIN.
        let a = fp("orders", "post", "/orders?b=2&a=1", JSON, br#"{"b":1,"a":2}"#);
        let b = fp(
            "orders",
            "POST",
            "/orders?a=1&b=2",
            JSON,
            br#"{ "a": 2, "b": 1 }"#,
        );
        assert_eq!(a, b);
        // SHA-256 of u64be(len)||bytes for "idemgate.fingerprint.v1", "orders", "POST",
        // "/orders?a=1&b=2", "json", {"a":2,"b":1} (checked independently with Python's hashlib).
        let pinned = "2cde5cc55d35b6f365d3e055aa6cd9d777ed76dd1edf7ca3b604a406c39f6c86";
        assert_eq!(a.to_hex(), pinned);
        assert_eq!(a.to_hex(), hex::encode(a.0));
    }

    #[test]
    fn debug_is_short_hex() {
        let f = Fingerprint([0xab; 32]);
        assert_eq!(format!("{f:?}"), "Fingerprint(abababababababab…)");
    }

    #[test]
    fn ct_eq_matches_eq() {
        let a = fp_json("{}");
        let b = fp_json("[]");
        assert!(a.ct_eq(&a));
        assert!(!a.ct_eq(&b));
        // A difference in any bit of any of the four words it compares.
        for bit in 0..256 {
            let mut c = a;
            c.0[bit / 8] ^= 1 << (bit % 8);
            assert!(!a.ct_eq(&c), "bit {bit}");
            assert!(!c.ct_eq(&a), "bit {bit}");
            assert_eq!(a.ct_eq(&c), a == c);
        }
    }

    #[test]
    fn serde_round_trip() {
        let a = fp_json(r#"{"a":1}"#);
        let s = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<Fingerprint>(&s).unwrap(), a);
    }

    #[test]
    fn field_boundaries_cannot_shift() {
        // Same concatenation (after the method is uppercased), different fields.
        assert_ne!(fp("aB", "C", "/", None, b""), fp("a", "BC", "/", None, b""));
        assert_ne!(fp("A", "", "/", None, b""), fp("", "A", "/", None, b""));
        assert_ne!(fp("r", "POST", "", None, b"/"), fp("r", "POST", "/", None, b""));
    }

    #[test]
    fn method_is_case_insensitive() {
        assert_eq!(fp("r", "post", "/", None, b""), fp("r", "POST", "/", None, b""));
        assert_ne!(fp("r", "PUT", "/", None, b""), fp("r", "POST", "/", None, b""));
    }

    #[test]
    fn json_content_types() {
        let yes = "application/json|Application/JSON|application/json; charset=utf-8|\
                   application/json ;charset=UTF-8|application/problem+json|\
                   application/vnd.api+JSON|text/foo+json";
        for ct in yes.split('|') {
            assert!(is_json_content_type(ct), "{ct}");
        }
        let no = "|json|text/plain|application/jsonx|application/json-patch|application/+json|\
                  /json|text/json|application/x-www-form-urlencoded";
        for ct in no.split('|') {
            assert!(!is_json_content_type(ct), "{ct}");
        }
    }

    #[test]
    fn json_bodies_ignore_key_order_and_whitespace() {
        assert_eq!(
            fp_json(r#"{"a":1,"b":{"y":[1,2],"x":null}}"#),
            fp_json("{\n  \"b\" : { \"x\": null, \"y\": [ 1 , 2 ] },\t\"a\": 1\n}\n")
        );
        let plus = fp(
            "r",
            "POST",
            "/x",
            Some("application/merge-patch+json"),
            b"{\"b\":1, \"a\":2}",
        );
        assert_eq!(plus, fp_json(r#"{"a":2,"b":1}"#));
    }

    #[test]
    fn json_bodies_keep_meaningful_differences() {
        assert_ne!(fp_json("[1,2]"), fp_json("[2,1]"));
        assert_ne!(fp_json("1"), fp_json("1.0"));
        assert_ne!(fp_json(r#"{"a":"1"}"#), fp_json(r#"{"a":1}"#));
        // Escapes that mean the same string are the same string.
        assert_eq!(fp_json(r#"{"a":"\u0041"}"#), fp_json(r#"{"a":"A"}"#));
    }

    #[test]
    fn non_json_bodies_are_raw() {
        let text = Some("text/plain");
        assert_ne!(
            fp("r", "POST", "/", text, b"{\"a\":1}"),
            fp("r", "POST", "/", text, b"{ \"a\":1}")
        );
        assert_ne!(
            fp("r", "POST", "/", None, b"{\"a\":1}"),
            fp("r", "POST", "/", None, b"{ \"a\":1}")
        );
        // Same bytes, JSON vs not: different body kinds, different fingerprints.
        assert_ne!(
            fp("r", "POST", "/", text, b"{\"a\":1}"),
            fp("r", "POST", "/", JSON, b"{\"a\":1}")
        );
    }

    #[test]
    fn invalid_json_falls_back_to_raw_bytes() {
        assert_eq!(fp_json("{not json"), fp("r", "POST", "/x", None, b"{not json"));
        assert_ne!(fp_json("{not json"), fp_json("{not  json"));
        assert_eq!(fp_json(""), fp("r", "POST", "/x", None, b""));
    }

    #[test]
    fn normalize_examples() {
        let n = normalize_path_and_query;
        assert_eq!(n("/a"), "/a");
        assert_eq!(n("/a?"), "/a");
        assert_eq!(n("/a?&&"), "/a");
        assert_eq!(n("/a?b=2&a=1"), "/a?a=1&b=2");
        assert_eq!(n("/a?a=2&a=1&a=2"), "/a?a=1&a=2&a=2");
        assert_eq!(n("/a?a=1&&b=2&"), "/a?a=1&b=2");
        assert_eq!(n("/a?a=&a"), "/a?a&a=");
        assert_eq!(n("/a?b&a=x=y"), "/a?a=x=y&b");
        // Sorted by name first: "a" < "a.", although "a=" > "a." as whole strings.
        assert_eq!(n("/a?a.=1&a=1"), "/a?a=1&a.=1");
        // No percent-decoding, no path cleanup.
        assert_eq!(n("/a%2Fb/?x=%20"), "/a%2Fb/?x=%20");
        assert_ne!(n("/a?x=%7e"), n("/a?x=~"));
        assert_ne!(n("/a/"), n("/a"));
        assert_eq!(n(""), "");
        assert_eq!(n("?"), "");
    }

    #[test]
    fn normalize_borrows_when_already_canonical() {
        let n = normalize_path_and_query;
        assert!(matches!(n("/a?a=1&b=2"), Cow::Borrowed("/a?a=1&b=2")));
        assert!(matches!(n("/a?"), Cow::Borrowed("/a")));
        assert!(matches!(n("/a?b=1&a=2"), Cow::Owned(_)));
    }

    // ---- property tests ----

    fn json_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            "[ -~é\u{1F600}\n\"\\\\]{0,8}".prop_map(Value::String),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        json_leaf().prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z\"é]{0,4}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn json_object() -> impl Strategy<Value = Value> {
        proptest::collection::btree_map("[a-z]{0,4}", json_value(), 0..8)
            .prop_map(|m| Value::Object(m.into_iter().collect()))
    }

    /// A seed-dependent pseudo-random number for `item`: used to permute and to pick whitespace.
    fn mix(seed: u64, item: &impl std::hash::Hash) -> u64 {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        BuildHasherDefault::<DefaultHasher>::default().hash_one((seed, item))
    }

    /// Serializes `v` with object keys in a seed-dependent order and whitespace sprinkled between
    /// tokens: the same JSON document, spelled differently.
    fn scramble(v: &Value, seed: u64) -> String {
        let ws = |i: usize| ["", " ", "\n", "\t", "\r\n  "][(mix(seed, &i) % 5) as usize];
        let join = |open: char, items: Vec<String>, close: char| {
            let sep = format!("{},{}", ws(items.len()), ws(items.len() + 1));
            format!("{open}{}{}{}{close}", ws(0), items.join(&sep), ws(1))
        };
        match v {
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_by_key(|(k, _)| mix(seed, k));
                let items = entries.iter().enumerate().map(|(i, (k, v))| {
                    format!(
                        "{}{}:{}{}",
                        Value::from(k.as_str()),
                        ws(i + 2),
                        ws(i + 3),
                        scramble(v, mix(seed, &i))
                    )
                });
                join('{', items.collect(), '}')
            }
            Value::Array(items) => {
                let items = items.iter().enumerate().map(|(i, v)| scramble(v, mix(seed, &i)));
                join('[', items.collect(), ']')
            }
            scalar => scalar.to_string(),
        }
    }

    /// Changes the `index`-th leaf (depth-first, modulo the leaf count) to a different value.
    fn mutate_leaf(v: &mut Value, index: usize) {
        let mut all: Vec<&mut Value> = Vec::new();
        collect_leaves(v, &mut all);
        let n = all.len();
        let leaf = &mut *all[index % n];
        *leaf = match &*leaf {
            Value::Null => Value::Bool(false),
            Value::Bool(b) => Value::Bool(!b),
            Value::Number(n) => json!(n.as_i64().unwrap().wrapping_add(1)),
            Value::String(s) => Value::String(format!("{s}x")),
            Value::Array(_) => json!([null]),
            Value::Object(_) => json!({"": null}),
        };
    }

    /// Leaves include empty arrays and objects, so every document (even `{}`) has one.
    fn collect_leaves<'v>(v: &'v mut Value, acc: &mut Vec<&'v mut Value>) {
        let is_leaf = match &*v {
            Value::Object(m) => m.is_empty(),
            Value::Array(a) => a.is_empty(),
            _ => true,
        };
        if is_leaf {
            acc.push(v);
            return;
        }
        match v {
            Value::Object(m) => m.values_mut().for_each(|c| collect_leaves(c, acc)),
            Value::Array(a) => a.iter_mut().for_each(|c| collect_leaves(c, acc)),
            _ => {}
        }
    }

    fn query_params() -> impl Strategy<Value = Vec<(String, String)>> {
        proptest::collection::vec(("[a-c%2]{0,3}", "[a-c=%+]{0,3}"), 0..6)
    }

    fn join_query(params: &[(String, String)]) -> String {
        params
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("&")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn reordering_keys_and_whitespace_never_change_the_fingerprint(
            doc in json_object(), seed in any::<u64>()
        ) {
            let compact = serde_json::to_string(&doc).unwrap();
            let scrambled = scramble(&doc, seed);
            prop_assert_eq!(fp_json(&compact), fp_json(&scrambled), "{}", scrambled);
        }

        #[test]
        fn changing_any_leaf_changes_the_fingerprint(
            doc in json_object(), index in any::<usize>(), seed in any::<u64>()
        ) {
            let mut changed = doc.clone();
            mutate_leaf(&mut changed, index);
            prop_assert_ne!(fp_json(&doc.to_string()), fp_json(&scramble(&changed, seed)));
        }

        #[test]
        fn changing_route_method_or_path_changes_the_fingerprint(
            r1 in "[a-z_.]{0,6}", r2 in "[a-z_.]{0,6}",
            m1 in "[A-Za-z]{1,7}", m2 in "[A-Za-z]{1,7}",
            p1 in "/[a-z0-9/%]{0,8}", p2 in "/[a-z0-9/%]{0,8}",
            body in proptest::collection::vec(any::<u8>(), 0..32),
        ) {
            let base = fp(&r1, &m1, &p1, None, &body);
            if r1 != r2 {
                prop_assert_ne!(base, fp(&r2, &m1, &p1, None, &body));
            }
            if !m1.eq_ignore_ascii_case(&m2) {
                prop_assert_ne!(base, fp(&r1, &m2, &p1, None, &body));
            }
            if p1 != p2 {
                prop_assert_ne!(base, fp(&r1, &m1, &p2, None, &body));
            }
        }

        #[test]
        fn query_order_never_matters_but_content_does(
            params in query_params(), seed in any::<u64>(), index in any::<usize>()
        ) {
            let body = br#"{"a":1}"#;
            let base = fp("r", "POST", &format!("/p?{}", join_query(&params)), JSON, body);
            // Any permutation is the same request.
            let mut shuffled = params.clone();
            shuffled.sort_by_key(|kv| mix(seed, kv));
            let same = fp("r", "POST", &format!("/p?{}", join_query(&shuffled)), JSON, body);
            prop_assert_eq!(base, same);
            // Adding a parameter is not.
            let mut more = params.clone();
            more.push(("z".into(), "1".into()));
            let added = fp("r", "POST", &format!("/p?{}", join_query(&more)), JSON, body);
            prop_assert_ne!(base, added);
            // Nor is repeating one.
            if let Some(first) = params.first() {
                let mut twice = params.clone();
                twice.push(first.clone());
                let repeated = fp("r", "POST", &format!("/p?{}", join_query(&twice)), JSON, body);
                prop_assert_ne!(base, repeated);
            }
            // Nor is changing a value.
            if !params.is_empty() {
                let mut edited = params.clone();
                let i = index % edited.len();
                edited[i].1.push('q');
                let changed = fp("r", "POST", &format!("/p?{}", join_query(&edited)), JSON, body);
                prop_assert_ne!(base, changed);
            }
        }

        #[test]
        fn normalization_is_idempotent(pq in "/[a-z]{0,3}(\\?[a-c=&%]{0,12})?") {
            let once = normalize_path_and_query(&pq).into_owned();
            prop_assert_eq!(normalize_path_and_query(&once), once.as_str());
        }

        #[test]
        fn compute_never_panics(
            ct in proptest::option::of("[ -~]{0,24}"),
            body in proptest::collection::vec(any::<u8>(), 0..64),
            pq in "[ -~]{0,24}",
        ) {
            let _ = fp("r", "post", &pq, ct.as_deref(), &body);
        }
    }
}
