use super::*;
use proptest::prelude::*;
use std::sync::LazyLock;

fn parse_one(v: &str) -> Result<Option<String>, KeyError> {
    parse_header([v.as_bytes()])
}

fn reason(r: Result<impl fmt::Debug, KeyError>) -> KeyReason {
    r.expect_err("expected a refusal").reason
}

/// The parsed key of a single header line that must parse.
fn key(v: &str) -> String {
    parse_one(v).unwrap().expect("one header line gives a key")
}

fn assert_syntax(values: &[&str]) {
    for v in values {
        assert_eq!(reason(parse_one(v)), KeyReason::Syntax, "{v:?}");
    }
}

/// Quotes `s` as an RFC 8941 sf-string.
fn sf_quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

#[test]
fn reason_names_are_stable() {
    assert_eq!(KeyReason::Length.as_str(), "length");
    assert_eq!(KeyReason::Charset.as_str(), "charset");
    assert_eq!(KeyReason::ReservedPrefix.as_str(), "reserved_prefix");
    assert_eq!(KeyReason::Syntax.as_str(), "syntax");
    assert_eq!(KeyReason::ReservedPrefix.to_string(), "reserved_prefix");
}

#[test]
fn default_rules() {
    let rules = KeyRules::default();
    assert_eq!(rules.max_len, 255);
    assert_eq!(rules.pattern.as_str(), DEFAULT_KEY_PATTERN);
    assert_eq!(rules.reserved_prefixes, vec!["t-".to_owned()]);
    let built = KeyRules::new(255, None, vec!["t-".into()]).unwrap();
    assert_eq!(built.pattern.as_str(), DEFAULT_KEY_PATTERN);
}

#[test]
fn accepts_ordinary_keys() {
    let rules = KeyRules::default();
    let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    for k in ["a", uuid, "order.42_retry~1", "t", "tx-1"] {
        assert_eq!(rules.validate(k), Ok(()), "{k}");
    }
    assert_eq!(rules.validate(&"k".repeat(255)), Ok(()));
}

#[test]
fn length_refusals() {
    let rules = KeyRules::default();
    assert_eq!(reason(rules.validate("")), KeyReason::Length);
    assert_eq!(reason(rules.validate(&"k".repeat(256))), KeyReason::Length);
    let short = KeyRules::new(4, None, vec![]).unwrap();
    assert_eq!(reason(short.validate("abcde")), KeyReason::Length);
    assert_eq!(short.validate("abcd"), Ok(()));
    // Length is counted in bytes, and checked before the charset.
    assert_eq!(reason(short.validate("ééé")), KeyReason::Length);
}

#[test]
fn raised_max_len_without_pattern_is_not_capped_at_255() {
    let rules = KeyRules::new(1024, None, vec![]).unwrap();
    assert_eq!(rules.validate(&"k".repeat(1000)), Ok(()));
    assert_eq!(reason(rules.validate(&"k".repeat(1025))), KeyReason::Length);
    assert_eq!(reason(rules.validate("a:b")), KeyReason::Charset);
}

#[test]
fn charset_refusals() {
    let rules = KeyRules::default();
    for k in ["a:b", "a b", "a/b", "é", "a%20", "a*", "\"a\""] {
        assert_eq!(reason(rules.validate(k)), KeyReason::Charset, "{k}");
    }
}

#[test]
fn custom_pattern_is_anchored_and_may_allow_colons() {
    let rules = KeyRules::new(255, Some("[A-Za-z0-9:]+"), vec!["t-".into()]).unwrap();
    assert_eq!(rules.validate("sched:42:1700000000000"), Ok(()));
    // Unanchored, this pattern would have matched the "a" and let the key through.
    assert_eq!(reason(rules.validate("a b")), KeyReason::Charset);
    assert_eq!(reason(rules.validate("a-b")), KeyReason::Charset);
    // An alternation cannot slip out of the anchors.
    let alt = KeyRules::new(255, Some("a|b"), vec![]).unwrap();
    assert_eq!(alt.validate("a"), Ok(()));
    assert_eq!(reason(alt.validate("ab")), KeyReason::Charset);
    assert_eq!(reason(alt.validate("xa")), KeyReason::Charset);
    // A pattern that only compiles once wrapped is refused.
    assert!(KeyRules::new(255, Some("a)|(b"), vec![]).is_err());
    assert!(KeyRules::new(255, Some("("), vec![]).is_err());
}

#[test]
fn reserved_prefix_refusals() {
    let rules = KeyRules::default();
    assert_eq!(reason(rules.validate("t-acme")), KeyReason::ReservedPrefix);
    assert_eq!(reason(rules.validate("T-acme")), KeyReason::ReservedPrefix);
    assert_eq!(reason(rules.validate("t-")), KeyReason::ReservedPrefix);
    assert_eq!(rules.validate("tt-acme"), Ok(()));
    let custom = KeyRules::new(255, None, vec!["sys.".into(), String::new()]).unwrap();
    assert_eq!(custom.reserved_prefixes, vec!["sys.".to_owned()]);
    assert_eq!(reason(custom.validate("sys.x")), KeyReason::ReservedPrefix);
    assert_eq!(custom.validate("t-acme"), Ok(()));
}

#[test]
fn validation_order_is_length_charset_prefix() {
    let rules = KeyRules::default();
    // Too long *and* bad charset *and* reserved: length wins.
    let long = format!("t-:{}", "x".repeat(300));
    assert_eq!(reason(rules.validate(&long)), KeyReason::Length);
    // Bad charset and reserved: charset wins.
    assert_eq!(reason(rules.validate("t-a:b")), KeyReason::Charset);
}

#[test]
fn errors_never_echo_the_key() {
    let rules = KeyRules::new(8, None, vec!["t-".into()]).unwrap();
    let secret = "SECRETxyz";
    for k in [
        format!("{secret}{secret}"),
        format!("{secret}:"),
        format!("t-{secret}"),
    ] {
        let e = rules.validate(&k).unwrap_err();
        assert!(!e.to_string().contains(secret), "{e}");
        assert!(!format!("{e:?}").contains(secret), "{e:?}");
    }
    for v in [
        format!("{secret},{secret}"),
        format!("\"{secret}\";a=1"),
        format!("\"{secret}"),
        format!("{secret} {secret}"),
    ] {
        let e = parse_one(&v).unwrap_err();
        assert!(!e.to_string().contains(secret), "{e}");
    }
}

#[test]
fn absent_header_is_none() {
    assert_eq!(parse_header(std::iter::empty::<&[u8]>()), Ok(None));
}

#[test]
fn bare_and_quoted_are_equal() {
    assert_eq!(key("abc-123"), "abc-123");
    assert_eq!(key("\"abc-123\""), "abc-123");
}

#[test]
fn optional_whitespace_is_trimmed() {
    assert_eq!(key("  abc\t"), "abc");
    assert_eq!(key("\t\"abc\"  "), "abc");
    // Whitespace inside quotes is part of the key (validate refuses it by default).
    assert_eq!(key("\" a b \""), " a b ");
}

#[test]
fn sf_string_escapes() {
    assert_eq!(key(r#""a\"b\\c""#), r#"a"b\c"#);
    // Only \" and \\ are escapes; a lone or trailing backslash is malformed.
    assert_syntax(&[r#""a\nb""#, r#""abc\""#, r#""abc\"#]);
}

#[test]
fn bare_keys_keep_base64_and_colons() {
    assert_eq!(key("ab+/c=="), "ab+/c==");
    assert_eq!(key("sched:42:1700000000000"), "sched:42:1700000000000");
}

#[test]
fn two_header_lines_are_refused() {
    let r = parse_header([b"abc".as_slice(), b"abc".as_slice()]);
    assert_eq!(reason(r), KeyReason::Syntax);
    let r = parse_header([b"abc".as_slice(), b"".as_slice()]);
    assert_eq!(reason(r), KeyReason::Syntax);
}

#[test]
fn lists_are_refused() {
    assert_syntax(&["a,b", "a, b", "a,", ",a", "\"a\", \"b\"", "\"a\",b", "a ,b"]);
    // A comma inside quotes is one value; the charset check refuses it later by default.
    assert_eq!(key("\"a,b\""), "a,b");
    let r = KeyRules::default().validate("a,b");
    assert_eq!(reason(r), KeyReason::Charset);
}

#[test]
fn empty_values_are_refused() {
    assert_syntax(&["", " ", "\t \t", "\"\"", "  \"\"  "]);
}

#[test]
fn parameters_are_refused() {
    assert_syntax(&["\"abc\";a=1", "\"abc\" ;a=1", "\"abc\";a", "abc;a=1"]);
}

#[test]
fn malformed_values_are_refused() {
    // Unterminated, trailing garbage, two strings, stray quote, inner whitespace.
    assert_syntax(&["\"abc", "\"abc\"def", "\"abc\"\"def\"", "ab\"c", "a b", "a\tb"]);
}

#[test]
fn non_visible_ascii_is_refused() {
    let values: [&[u8]; 9] = [
        b"ab\x00c",
        b"ab\x7fc",
        b"ab\x1bc",
        b"\x0cab",
        b"\xff",
        "\u{e9}".as_bytes(),
        b"\"ab\x00c\"",
        b"\"ab\tc\"",
        "\"\u{e9}\"".as_bytes(),
    ];
    for v in values {
        assert_eq!(reason(parse_header([v])), KeyReason::Syntax, "{v:?}");
    }
}

#[test]
fn default_patterns_are_checked_without_the_regex() {
    assert_eq!(default_pattern_bound(&KeyRules::default().pattern), Some(255));
    let raised = KeyRules::new(1024, None, vec![]).unwrap();
    assert_eq!(default_pattern_bound(&raised.pattern), Some(usize::MAX));
    let custom = KeyRules::new(255, Some("[A-Za-z0-9._~-]{1,255}"), vec![]).unwrap();
    assert_eq!(default_pattern_bound(&custom.pattern), None);
}

/// Keys near the edges of the default patterns: around 255 bytes, non-ASCII, and bytes just
/// outside the class (`/`, `:`, `@`, `[`, `` ` ``, `{`, `}`, DEL).
fn edge_key() -> impl Strategy<Value = String> {
    prop_oneof![
        "[A-Za-z0-9._~-]{0,300}",
        "[A-Za-z0-9._~/:@\\[`{}\x7f -]{0,260}",
        "[a-z\\u{80}-\\u{10ffff}]{0,130}",
        any::<String>(),
    ]
}

/// Each default pattern with its length bound, and as custom rules that say the same in other
/// words (so that `validate` runs the regex for them). Compiled once for all cases.
static DEFAULTS: LazyLock<[(Regex, usize, KeyRules); 2]> = LazyLock::new(|| {
    let rules = |p| KeyRules::new(0, Some(p), vec!["t-".into()]).unwrap();
    [
        (
            Regex::new(DEFAULT_KEY_PATTERN).unwrap(),
            DEFAULT_MAX_KEY_LEN,
            rules("[A-Za-z0-9._~-]{1,255}"),
        ),
        (
            Regex::new(DEFAULT_CHARSET_PATTERN).unwrap(),
            usize::MAX,
            rules("[A-Za-z0-9._~-]+"),
        ),
    ]
});

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn byte_check_agrees_with_the_default_regexes(key in edge_key()) {
        for (regex, bound, _) in DEFAULTS.iter() {
            prop_assert_eq!(
                matches_default_pattern(*bound, &key),
                regex.is_match(&key),
                "{} {:?}",
                regex.as_str(),
                key
            );
        }
    }

    #[test]
    fn validate_agrees_with_running_the_regex(key in edge_key(), max_len in 0usize..300) {
        for (regex, _, same) in DEFAULTS.iter() {
            let fast = KeyRules {
                max_len,
                pattern: regex.clone(),
                reserved_prefixes: vec!["t-".into()],
            };
            let slow = KeyRules { max_len, ..same.clone() };
            prop_assert_eq!(
                fast.validate(&key).map_err(|e| e.reason),
                slow.validate(&key).map_err(|e| e.reason)
            );
        }
    }
}

proptest! {
    #[test]
    fn valid_tokens_parse_to_themselves(key in "[A-Za-z0-9._~-]{1,255}") {
        let rules = KeyRules::default();
        let bare = parse_one(&key).unwrap();
        let quoted = parse_one(&sf_quote(&key)).unwrap();
        let padded = parse_one(&format!(" \t{key} ")).unwrap();
        prop_assert_eq!(bare.as_deref(), Some(key.as_str()));
        prop_assert_eq!(&bare, &quoted);
        prop_assert_eq!(&bare, &padded);
        let reserved = key.len() >= 2 && key[..2].eq_ignore_ascii_case("t-");
        prop_assert_eq!(rules.validate(&key).is_ok(), !reserved);
    }

    #[test]
    fn any_printable_ascii_round_trips_through_an_sf_string(key in "[ -~]{1,64}") {
        prop_assert_eq!(parse_one(&sf_quote(&key)).unwrap(), Some(key));
    }

    #[test]
    fn parsing_never_panics(values in proptest::collection::vec(
        proptest::collection::vec(any::<u8>(), 0..40), 0..3)) {
        let r = parse_header(values.iter().map(Vec::as_slice));
        match values.len() {
            0 => prop_assert_eq!(r, Ok(None)),
            1 => {
                if let Ok(Some(k)) = r {
                    prop_assert!(!k.is_empty());
                    prop_assert!(k.bytes().all(|b| (0x20..0x7f).contains(&b)));
                }
            }
            _ => prop_assert_eq!(reason(r), KeyReason::Syntax),
        }
    }

    #[test]
    fn validate_never_panics(key in any::<String>(), max in 0usize..300) {
        let rules = KeyRules::new(max, None, vec!["t-".into()]).unwrap();
        if let Err(e) = rules.validate(&key) {
            prop_assert!(!e.detail.is_empty());
        }
    }
}
