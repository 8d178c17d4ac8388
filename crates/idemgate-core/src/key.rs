//! Raw idempotency keys, as callers send them (SPEC section 3).
//!
//! This module owns two steps, run in this order by the proxy and the tower layer:
//!
//! 1. [`parse_header`]: turn the `Idempotency-Key` field lines into one raw key. The value is a
//!    bare token or an RFC 8941 sf-string (`"abc"`); anything that is not exactly one value is a
//!    [`KeyReason::Syntax`] refusal.
//! 2. [`KeyRules::validate`]: check the raw key against the route's rules (length, character
//!    set, reserved prefixes).
//!
//! Keys are treated as secret-ish (some clients put account or payment identifiers in them), so
//! no error built here ever contains the key or any part of it: details name the rule that was
//! broken, never the offending input.

use std::fmt;

use regex::Regex;

use crate::namespace::is_unreserved;

/// The default `key_pattern`: the RFC 3986 unreserved set, 1 to 255 characters. Colons are
/// refused by default as a guard against prefix forgery (SPEC section 3).
pub const DEFAULT_KEY_PATTERN: &str = "^[A-Za-z0-9._~-]{1,255}$";

/// The default `max_key_length`, in bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// The default reserved prefix: the one namespaced keys start with.
pub const DEFAULT_RESERVED_PREFIX: &str = "t-";

/// The default character set without the length bound of [`DEFAULT_KEY_PATTERN`]. Used when a
/// route raises `max_key_length` above 255 without its own pattern, so that `max_len` alone
/// governs the length instead of the default pattern silently capping it at 255 (and reporting
/// the long key as a `charset` refusal).
const DEFAULT_CHARSET_PATTERN: &str = "^[A-Za-z0-9._~-]+$";

/// Why a key was refused. The string form is the `reason` of the problem body and the label of
/// `idempotency_key_invalid_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyReason {
    /// Empty, or longer than `max_key_length` bytes.
    Length,
    /// Does not match the route's `key_pattern`.
    Charset,
    /// Starts with a reserved prefix (default `t-`).
    ReservedPrefix,
    /// The header field is not exactly one bare token or sf-string.
    Syntax,
}

impl KeyReason {
    /// The stable, lowercase name used in problem bodies and metric labels.
    #[must_use]
    pub fn as_str(&self) -> &'static str {
        match self {
            KeyReason::Length => "length",
            KeyReason::Charset => "charset",
            KeyReason::ReservedPrefix => "reserved_prefix",
            KeyReason::Syntax => "syntax",
        }
    }
}

impl fmt::Display for KeyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused key. `detail` is written for the client (it goes into the problem body) and never
/// contains the key itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid idempotency key ({reason}): {detail}")]
pub struct KeyError {
    pub reason: KeyReason,
    pub detail: String,
}

impl KeyError {
    fn new(reason: KeyReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }

    fn syntax(detail: &str) -> Self {
        Self::new(KeyReason::Syntax, detail)
    }
}

/// A route's key rules: `max_key_length`, `key_pattern` and the reserved prefixes.
#[derive(Clone, Debug)]
pub struct KeyRules {
    /// Longest accepted key, in bytes.
    pub max_len: usize,
    /// Must match the whole key. Patterns given to [`KeyRules::new`] are anchored there.
    pub pattern: Regex,
    /// Refused key prefixes, compared ASCII case-insensitively.
    pub reserved_prefixes: Vec<String>,
}

impl Default for KeyRules {
    fn default() -> Self {
        Self {
            max_len: DEFAULT_MAX_KEY_LEN,
            pattern: Regex::new(DEFAULT_KEY_PATTERN).expect("the default key pattern compiles"),
            reserved_prefixes: vec![DEFAULT_RESERVED_PREFIX.to_owned()],
        }
    }
}

impl KeyRules {
    /// Builds the rules of a route.
    ///
    /// A custom `pattern` must match the *whole* key: it is compiled on its own first (so a
    /// pattern like `a)|(b` cannot escape the wrapper) and then anchored as `^(?:pattern)$`.
    /// An operator who writes `[A-Za-z0-9:]+` means "only these characters", not "contains one
    /// of these characters", and an unanchored pattern would quietly accept anything.
    ///
    /// Without a pattern the default character set applies; its length bound follows `max_len`.
    /// Empty reserved prefixes are dropped: they would refuse every key.
    ///
    /// # Errors
    ///
    /// The pattern does not compile.
    pub fn new(
        max_len: usize,
        pattern: Option<&str>,
        reserved_prefixes: Vec<String>,
    ) -> Result<Self, regex::Error> {
        let pattern = match pattern {
            Some(p) => {
                Regex::new(p)?;
                Regex::new(&format!("^(?:{p})$"))?
            }
            None if max_len <= DEFAULT_MAX_KEY_LEN => Regex::new(DEFAULT_KEY_PATTERN)?,
            None => Regex::new(DEFAULT_CHARSET_PATTERN)?,
        };
        let reserved_prefixes = reserved_prefixes.into_iter().filter(|p| !p.is_empty()).collect();
        Ok(Self {
            max_len,
            pattern,
            reserved_prefixes,
        })
    }

    /// Checks a raw key. The order is fixed (length, then charset, then reserved prefix) so that
    /// a given key always reports the same reason in metrics.
    ///
    /// # Errors
    ///
    /// A [`KeyError`] whose reason is the first rule broken.
    pub fn validate(&self, raw: &str) -> Result<(), KeyError> {
        if raw.is_empty() {
            return Err(KeyError::new(KeyReason::Length, "the key is empty"));
        }
        if raw.len() > self.max_len {
            return Err(KeyError::new(
                KeyReason::Length,
                format!(
                    "the key is {} bytes long; the limit is {} bytes",
                    raw.len(),
                    self.max_len
                ),
            ));
        }
        let default_bound = default_pattern_bound(&self.pattern);
        let matches = match default_bound {
            Some(bound) => matches_default_pattern(bound, raw),
            None => self.pattern.is_match(raw),
        };
        if !matches {
            let detail = if default_bound.is_some() {
                "the key may only contain A-Z, a-z, 0-9, '.', '_', '~' and '-'"
            } else {
                "the key does not match the route's key pattern"
            };
            return Err(KeyError::new(KeyReason::Charset, detail));
        }
        // Case-insensitive on purpose: `T-...` reads as a namespaced key to a human scanning
        // records or logs just as `t-...` does, and no honest client needs either.
        if let Some(prefix) = self
            .reserved_prefixes
            .iter()
            .find(|p| starts_with_ignore_ascii_case(raw, p))
        {
            return Err(KeyError::new(
                KeyReason::ReservedPrefix,
                format!("keys may not start with the reserved prefix {prefix:?}"),
            ));
        }
        Ok(())
    }
}

/// The length bound (in characters) of a default pattern: [`DEFAULT_KEY_PATTERN`] is bounded at
/// 255, [`DEFAULT_CHARSET_PATTERN`] not at all. `None` for any other pattern.
///
/// Told apart by their source text, which is what defines a pattern, so this stays right even
/// for rules built by hand with the public fields.
fn default_pattern_bound(pattern: &Regex) -> Option<usize> {
    match pattern.as_str() {
        DEFAULT_KEY_PATTERN => Some(DEFAULT_MAX_KEY_LEN),
        DEFAULT_CHARSET_PATTERN => Some(usize::MAX),
        _ => None,
    }
}

/// Whether `raw` matches a default pattern whose length bound is `bound`, without running the
/// regex (the largest cost of validating a key): both defaults are one class of ASCII bytes
/// repeated 1 to `bound` times, and as every byte of a match is ASCII, its characters are its
/// bytes.
fn matches_default_pattern(bound: usize, raw: &str) -> bool {
    (1..=bound).contains(&raw.len()) && raw.bytes().all(is_unreserved)
}

fn starts_with_ignore_ascii_case(s: &str, prefix: &str) -> bool {
    s.len() >= prefix.len() && s.as_bytes()[..prefix.len()].eq_ignore_ascii_case(prefix.as_bytes())
}

/// Parses the header field values (all occurrences of the Idempotency-Key header, as raw bytes)
/// into the raw key.
///
/// `Ok(None)` when there is no occurrence. A bare token or an RFC 8941 sf-string (`"abc"`, with
/// `\"` and `\\` escapes): quotes stripped. Leading and trailing optional whitespace (SP, HTAB)
/// is trimmed. Refused with [`KeyReason::Syntax`]: more than one value (two header lines, or a
/// comma-separated list), an empty value (including `""`), bytes that are not visible ASCII, an
/// unterminated or malformed sf-string, and sf-parameters (`"abc";a=1`).
///
/// A bare value is taken verbatim as long as it is one run of visible ASCII without `,` (a list),
/// `;` (parameters) or `"` (broken quoting). This is looser than an RFC 8941 sf-token on purpose:
/// real clients send UUIDs, base64 (`+/=`) and scheduler keys (`sched:1:2`) unquoted, and the
/// route's `key_pattern` is the real gate on what a key may contain.
///
/// # Errors
///
/// A [`KeyError`] with [`KeyReason::Syntax`], as listed above.
pub fn parse_header<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Result<Option<String>, KeyError> {
    let mut values = values.into_iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::syntax("the Idempotency-Key header must appear once"));
    }
    let value = trim_ows(first);
    let key = match value.first() {
        None => Err(EMPTY),
        Some(b'"') => parse_sf_string(value),
        Some(_) => parse_bare(value),
    }
    .map_err(KeyError::syntax)?;
    if key.is_empty() {
        return Err(KeyError::syntax(EMPTY));
    }
    Ok(Some(key))
}

// Syntax details shared by both spellings of a value.
const EMPTY: &str = "the Idempotency-Key header is empty";
const LIST: &str = "the header must hold one value, not a list";
const PARAMS: &str = "parameters are not allowed on the key";

fn is_ows(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// Trims optional whitespace (SP, HTAB) only: `trim_ascii` would also eat bytes such as form feed
/// that must be refused as non-visible.
fn trim_ows(v: &[u8]) -> &[u8] {
    let start = v.iter().position(|&b| !is_ows(b)).unwrap_or(v.len());
    let end = v.iter().rposition(|&b| !is_ows(b)).map_or(start, |i| i + 1);
    &v[start..end]
}

/// `value` starts with `"`. RFC 8941 section 4.2.5: printable ASCII inside, `\` escapes only
/// `"` and `\`, and nothing may follow the closing quote in a single-item header.
fn parse_sf_string(value: &[u8]) -> Result<String, &'static str> {
    let mut out = String::with_capacity(value.len());
    let mut i = 1;
    loop {
        let &b = value.get(i).ok_or("unterminated quoted string")?;
        i += 1;
        match b {
            b'"' => break,
            b'\\' => match value.get(i) {
                Some(&c @ (b'"' | b'\\')) => {
                    out.push(char::from(c));
                    i += 1;
                }
                _ => return Err("in a quoted string a backslash may only escape '\"' or '\\'"),
            },
            0x20..=0x7e => out.push(char::from(b)),
            _ => return Err("a quoted string may only contain printable ASCII"),
        }
    }
    match trim_ows(&value[i..]).first() {
        None => Ok(out),
        Some(b';') => Err(PARAMS),
        Some(b',') => Err(LIST),
        Some(_) => Err("unexpected characters after the quoted string"),
    }
}

fn parse_bare(value: &[u8]) -> Result<String, &'static str> {
    // A comma anywhere makes this a list, whatever else is wrong with it: check it first so the
    // detail names the likely mistake (two keys joined by a proxy).
    if value.contains(&b',') {
        return Err(LIST);
    }
    let mut out = String::with_capacity(value.len());
    for &b in value {
        match b {
            b';' => return Err(PARAMS),
            b'"' => return Err("a quotation mark may only open or close a quoted string"),
            b' ' | b'\t' => return Err("an unquoted key may not contain whitespace"),
            0x21..=0x7e => out.push(char::from(b)),
            _ => return Err("the key may only contain visible ASCII characters"),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
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
}
