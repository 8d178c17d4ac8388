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
    const NOT_VISIBLE: &str = "the key may only contain visible ASCII characters";
    for &b in value {
        match b {
            b';' => return Err(PARAMS),
            b'"' => return Err("a quotation mark may only open or close a quoted string"),
            b' ' | b'\t' => return Err("an unquoted key may not contain whitespace"),
            0x21..=0x7e => {}
            _ => return Err(NOT_VISIBLE),
        }
    }
    // Checked first, copied whole: pushed a char at a time, the copy cost a miss about 300
    // instructions.
    String::from_utf8(value.to_vec()).map_err(|_| NOT_VISIBLE)
}

#[cfg(test)]
mod tests;
