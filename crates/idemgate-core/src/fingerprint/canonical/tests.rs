use super::*;
use crate::fingerprint::{
    BODY_JSON, BODY_RAW, DOMAIN, Fingerprint, field, is_json_content_type, normalize_path_and_query,
};
use proptest::prelude::*;
use proptest::sample::{Index, select};
use sha2::{Digest, Sha256};

/// `Fingerprint::compute` as it was before the single pass: the reference the current one
/// must equal byte for byte, since stored records hold fingerprints computed this way.
fn reference_fingerprint(
    route_id: &str,
    method: &str,
    path_and_query: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> Fingerprint {
    let mut h = Sha256::new();
    field(&mut h, DOMAIN);
    field(&mut h, route_id.as_bytes());
    field(&mut h, method.to_ascii_uppercase().as_bytes());
    field(&mut h, normalize_path_and_query(path_and_query).as_bytes());
    let canonical = content_type
        .filter(|ct| is_json_content_type(ct))
        .and_then(|_| via_value(body));
    if let Some(canonical) = canonical {
        field(&mut h, BODY_JSON);
        field(&mut h, &canonical);
    } else {
        field(&mut h, BODY_RAW);
        field(&mut h, body);
    }
    Fingerprint(h.finalize().into())
}

fn assert_same_as_reference(body: &[u8]) {
    assert_eq!(
        canonical_json(body).map(Cow::into_owned),
        via_value(body),
        "{}",
        String::from_utf8_lossy(body)
    );
}

#[test]
fn canonical_form() {
    let c = canonical_json(br#" { "b" : [ {"d":1,"c":2} ], "a" : "\u00e9\n" } "#).unwrap();
    assert_eq!(&*c, r#"{"a":"é\n","b":[{"c":2,"d":1}]}"#.as_bytes());
}

#[test]
fn canonical_bodies_are_borrowed() {
    for body in [
        r#"{"amount":100,"currency":"eur"}"#,
        " [1,\"a\\n\\\"b\",{\"a\":{},\"b\":[]},true,null,-5]\r\n",
        "\"é\"",
    ] {
        let c = canonical_json(body.as_bytes()).unwrap();
        assert!(matches!(c, Cow::Borrowed(_)), "{body}");
        assert_eq!(&*c, body.trim().as_bytes());
    }
}

#[test]
fn respelled_tokens_match_the_reference() {
    for body in [
        "1.0",
        "1E2",
        "1e-7",
        "-0",
        "-0.0",
        "0.1e1",
        "1e400",
        "-1e-400",
        "123456789012345678",
        "1234567890123456789",
        "-1234567890123456789",
        "9223372036854775808",
        "-9223372036854775808",
        "-9223372036854775809",
        "18446744073709551615",
        "18446744073709551616",
        "01",
        "1.",
        ".5",
        "+1",
        "-",
        r#""\/\u0041\u00e9""#,
        r#""\ud83d\ude00""#,
        r#""\ud83d""#,
        r#""\u001f\u007f""#,
        r#""\x""#,
        "\"a\u{1}\"",
        r#"{"b":1,"a":2,"b":3}"#,
        r#"{"a":1,"a":1}"#,
        r#"{"\u0062":1,"a":2}"#,
        r#"{"b\"":1,"b!":2}"#,
        r#"{"é":1,"z":2,"":3}"#,
        r#"{"a":1,}"#,
        "[1,]",
        "[1 2]",
        "{\"a\" 1}",
        "nul",
        "truex",
        "[] []",
        "\u{feff}{}",
        "",
        " ",
        "{}",
        "[]",
    ] {
        assert_same_as_reference(body.as_bytes());
    }
    assert_same_as_reference(b"\"\xff\"");
    assert_same_as_reference(b"{\"\xc3\":1}");
}

#[test]
fn deep_nesting_matches_the_reference() {
    for depth in [1, 63, 64, 65, 66, 126, 127, 128, 129, 300] {
        let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        let objects = format!("{}1{}", r#"{"b":0,"a":"#.repeat(depth), "}".repeat(depth));
        assert_same_as_reference(arrays.as_bytes());
        assert_same_as_reference(objects.as_bytes());
    }
}

// ---- property tests: random JSON texts, spelled every way ----

fn ws() -> impl Strategy<Value = String> {
    prop_oneof![6 => Just(String::new()), 1 => "[ \t\r\n]{1,3}"]
}

fn number() -> impl Strategy<Value = String> {
    let odd = vec![
        "-0",
        "-0.0",
        "0e0",
        "1E400",
        "-1e-400",
        "01",
        "1.",
        ".5",
        "-",
        "1e",
        "+1",
        "1e+",
        "9223372036854775807",
        "9223372036854775808",
        "-9223372036854775808",
        "-9223372036854775809",
        "18446744073709551615",
        "18446744073709551616",
    ];
    prop_oneof![
        4 => "-?(0|[1-9][0-9]{0,3})",
        2 => "-?(0|[1-9][0-9]{15,24})",
        3 => "-?(0|[1-9][0-9]{0,3})(\\.[0-9]{1,8})?([eE][+-]?[0-9]{1,3})?",
        1 => any::<f64>().prop_map(|f| if f.is_finite() { format!("{f:e}") } else { "0".into() }),
        1 => any::<f64>().prop_map(|f| if f.is_finite() { f.to_string() } else { "0".into() }),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => select(odd).prop_map(str::to_owned),
    ]
}

fn string(plain: &'static str) -> impl Strategy<Value = String> {
    let short = vec!["\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"];
    let invalid = vec!["\\x", "\\", "\u{1}", "\n", "\\u12", "\\U0041"];
    let piece = prop_oneof![
        12 => plain,
        4 => select(short).prop_map(str::to_owned),
        2 => "\\\\u00[0-9a-fA-F]{2}",
        2 => "\\\\u[0-9a-fA-F]{4}",
        1 => "\\\\u[dD][89abAB][0-9a-fA-F]{2}\\\\u[dD][c-fC-F][0-9a-fA-F]{2}",
        1 => "\\\\u[dD][89a-fA-F][0-9a-fA-F]{2}",
        1 => select(invalid).prop_map(str::to_owned),
    ];
    proptest::collection::vec(piece, 0..4).prop_map(|p| format!("\"{}\"", p.concat()))
}

/// A JSON text (or nearly: a few pieces are invalid on purpose). Keys come from a tiny
/// alphabet so that objects often have unsorted and duplicate keys.
fn json_text() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        select(vec!["null", "true", "false"]).prop_map(str::to_owned),
        number(),
        string("[a-zA-Z0-9 é\u{1F600}\u{7f}/]{1,4}"),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        let item = (ws(), inner.clone(), ws()).prop_map(|(a, v, b)| format!("{a}{v}{b}"));
        let key = prop_oneof![
            6 => "[abé]{0,2}".prop_map(|k| format!("\"{k}\"")),
            1 => string("[ab\u{1F600}]{1,2}"),
        ];
        let member = (ws(), key, ws(), ws(), inner, ws())
            .prop_map(|(a, k, b, c, v, d)| format!("{a}{k}{b}:{c}{v}{d}"));
        prop_oneof![
            (proptest::collection::vec(item, 0..6), ws())
                .prop_map(|(items, w)| format!("[{w}{}]", items.join(","))),
            (proptest::collection::vec(member, 0..6), ws())
                .prop_map(|(members, w)| format!("{{{w}{}}}", members.join(","))),
        ]
    })
}

/// Request bodies: JSON texts with whitespace around them, some with one byte changed or
/// cut short, and plain random bytes.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let doc = (ws(), json_text(), ws())
        .prop_map(|(a, t, b)| format!("{a}{t}{b}").into_bytes())
        .boxed();
    prop_oneof![
        12 => doc.clone(),
        2 => (doc.clone(), any::<Index>(), any::<u8>()).prop_map(|(mut d, i, b)| {
            if !d.is_empty() {
                let i = i.index(d.len());
                d[i] = b;
            }
            d
        }),
        1 => (doc, any::<Index>()).prop_map(|(mut d, i)| {
            d.truncate(i.index(d.len() + 1));
            d
        }),
        1 => proptest::collection::vec(any::<u8>(), 0..32),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn canonical_json_equals_the_value_path(body in body()) {
        prop_assert_eq!(
            canonical_json(&body).map(Cow::into_owned),
            via_value(&body),
            "{}",
            String::from_utf8_lossy(&body)
        );
    }

    #[test]
    fn fingerprint_equals_the_reference(
        body in body(),
        method in "[pP][oO][sS][tT]|GET|patch",
        ct in proptest::option::of(select(vec![
            "application/json", "application/problem+json; charset=utf-8", "text/plain",
        ])),
        pq in "/[a-z]{0,3}(\\?[ab=&]{0,6})?",
    ) {
        prop_assert_eq!(
            Fingerprint::compute("r", &method, &pq, ct, &body),
            reference_fingerprint("r", &method, &pq, ct, &body)
        );
    }
}
