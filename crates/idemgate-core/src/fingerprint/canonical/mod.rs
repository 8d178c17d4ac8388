//! The canonical form of a JSON body: object keys sorted by their bytes, no insignificant
//! whitespace, every number and string spelled the way `serde_json` writes it.
//!
//! The form is defined by the original implementation, [`via_value`]: parse into a
//! `serde_json::Value`, write it back with the keys sorted. Fingerprints live in durable records,
//! so that definition is frozen byte for byte. [`canonical_json`] gets the same bytes without the
//! `Value` tree for the bodies clients actually send: a single pass ([`Canon`]) copies tokens
//! straight from the input, and while the input is already canonical it copies nothing at all
//! and hands back a slice of the body. Anything the pass is not sure about (escaped or duplicate
//! keys, deep nesting, anything malformed) goes to [`via_value`], which decides.
//!
//! Where the pass does respell a token (a float, a big integer, an escaped string), it asks
//! `serde_json` for the spelling, so the result follows whatever `serde_json` does, features
//! included (`arbitrary_precision`, `float_roundtrip`), exactly as the `Value` path does.

use std::borrow::Cow;

use serde_json::Value;

/// The canonical form of a JSON body, or `None` when it does not parse (the caller then hashes
/// the raw bytes: a client that sends broken JSON twice still gets a stable fingerprint).
pub(super) fn canonical_json(body: &[u8]) -> Option<Cow<'_, [u8]>> {
    Canon::run(body).or_else(|| via_value(body).map(Cow::Owned))
}

/// The original definition: parse into a `Value`, write it with object keys sorted.
pub(super) fn via_value(body: &[u8]) -> Option<Vec<u8>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let mut out = Vec::with_capacity(body.len());
    write_value(&value, &mut out).ok()?;
    Some(out)
}

/// Writes `value` compactly with object keys sorted.
///
/// The keys are sorted here rather than by relying on `serde_json`'s default `BTreeMap`: cargo
/// unifies features across the whole build, so any crate in a user's tree that enables
/// `serde_json/preserve_order` would silently turn the map into an insertion-ordered one and make
/// fingerprints depend on key order. Recursion is bounded by `serde_json`'s parse depth limit
/// (128).
fn write_value(value: &Value, out: &mut Vec<u8>) -> serde_json::Result<()> {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, k)?;
                out.push(b':');
                write_value(v, out)?;
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(v, out)?;
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar)?,
    }
    Ok(())
}

/// Deepest nesting the single pass handles; deeper documents go to [`via_value`], whose parser
/// owns the real limit (128). Also bounds the pass's own recursion.
const MAX_DEPTH: usize = 64;

/// Integers of at most this many digits fit both `u64` and `i64`, so `serde_json` writes them
/// back exactly as they were spelled (JSON forbids leading zeros; `-0` is checked apart).
const SHORT_INT_DIGITS: usize = 18;

/// Room for `serde_json`'s spelling of a number: a float takes at most 24 bytes, a 64-bit integer
/// 20. A longer one (only possible with `arbitrary_precision`) makes the pass give up.
const NUMBER_SPELLING: usize = 32;

/// An object member: its key (unescaped, so these are the key's bytes) and where `"key":value`
/// is in the output.
struct Member<'a> {
    key: &'a [u8],
    out: (usize, usize),
}

/// The single pass. Reading `input` from `pos`, it keeps the output equal to
/// `input[start..pos]` for as long as it can (`out` is `None`); the first time the two differ
/// (whitespace dropped, a token respelled, members reordered) it copies that prefix into `out`
/// and writes there from then on.
///
/// Every method returns `None` to give up, which sends the body to [`via_value`]: giving up is
/// always safe, answering is only allowed when the answer is the one [`via_value`] would give.
struct Canon<'a> {
    input: &'a [u8],
    pos: usize,
    start: usize,
    out: Option<Vec<u8>>,
    /// The members of the objects being read, innermost last.
    members: Vec<Member<'a>>,
}

impl<'a> Canon<'a> {
    fn run(input: &'a [u8]) -> Option<Cow<'a, [u8]>> {
        let mut c = Canon {
            input,
            pos: 0,
            start: 0,
            out: None,
            members: Vec::new(),
        };
        // Leading and trailing whitespace only move the ends of the borrowed slice.
        c.pos = c.whitespace_end();
        c.start = c.pos;
        c.value(0)?;
        let end = c.pos;
        c.pos = c.whitespace_end();
        if c.pos != input.len() {
            return None;
        }
        Some(match c.out {
            Some(out) => Cow::Owned(out),
            None => Cow::Borrowed(&input[c.start..end]),
        })
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    /// Where the output currently ends, in output offsets.
    fn out_len(&self) -> usize {
        self.out.as_ref().map_or(self.pos - self.start, Vec::len)
    }

    /// Switches from mirroring the input to writing `out`.
    fn diverge(&mut self) -> &mut Vec<u8> {
        let (input, start, pos) = (self.input, self.start, self.pos);
        self.out.get_or_insert_with(|| {
            let mut out = Vec::with_capacity(input.len() - start);
            out.extend_from_slice(&input[start..pos]);
            out
        })
    }

    /// Writes `input[pos..end]` as it is.
    fn copy_to(&mut self, end: usize) {
        if let Some(out) = &mut self.out {
            out.extend_from_slice(&self.input[self.pos..end]);
        }
        self.pos = end;
    }

    /// Writes `spelling` in place of `input[pos..end]`.
    fn replace_to(&mut self, end: usize, spelling: &[u8]) {
        if spelling == &self.input[self.pos..end] {
            self.copy_to(end);
        } else {
            self.diverge().extend_from_slice(spelling);
            self.pos = end;
        }
    }

    fn whitespace_end(&self) -> usize {
        let rest = &self.input[self.pos..];
        let n = rest
            .iter()
            .position(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
            .unwrap_or(rest.len());
        self.pos + n
    }

    fn skip_whitespace(&mut self) {
        let end = self.whitespace_end();
        if end > self.pos {
            self.diverge();
            self.pos = end;
        }
    }

    /// Copies the expected byte `b`, after any whitespace.
    fn punct(&mut self, b: u8) -> Option<()> {
        self.skip_whitespace();
        (self.peek()? == b).then(|| self.copy_to(self.pos + 1))
    }

    /// A value nested `depth` containers deep.
    fn value(&mut self, depth: usize) -> Option<()> {
        self.skip_whitespace();
        match self.peek()? {
            b'[' | b'{' if depth >= MAX_DEPTH => None,
            b'[' => {
                self.sequence(b']', |c| c.value(depth + 1))?;
                self.copy_to(self.pos + 1);
                Some(())
            }
            b'{' => {
                let base = self.members.len();
                self.sequence(b'}', |c| c.member(depth + 1))?;
                self.sort_members(base)?;
                self.members.truncate(base);
                self.copy_to(self.pos + 1);
                Some(())
            }
            b'"' => self.string(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.pos + word.len();
        (self.input.get(self.pos..end)? == word).then(|| self.copy_to(end))
    }

    /// The opening bracket at `pos`, then `item`s separated by commas, up to (not past) the
    /// `close` bracket.
    fn sequence(&mut self, close: u8, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.copy_to(self.pos + 1);
        self.skip_whitespace();
        if self.peek()? == close {
            return Some(());
        }
        loop {
            item(self)?;
            self.skip_whitespace();
            match self.peek()? {
                b',' => self.copy_to(self.pos + 1),
                b if b == close => return Some(()),
                _ => return None,
            }
        }
    }

    /// An object member, `"key":value`, recorded for [`Canon::sort_members`].
    fn member(&mut self, depth: usize) -> Option<()> {
        self.skip_whitespace();
        let start = self.out_len();
        let key = self.key()?;
        self.punct(b':')?;
        self.value(depth)?;
        let out = (start, self.out_len());
        self.members.push(Member { key, out });
        Some(())
    }

    /// Puts the members from `base` on (the current object's) in key order. Gives up on a
    /// duplicate key: `via_value` keeps the last value, which is not worth doing twice.
    fn sort_members(&mut self, base: usize) -> Option<()> {
        let members = &mut self.members[base..];
        if members.is_sorted_by(|a, b| a.key < b.key) {
            return Some(());
        }
        let unsorted = members.first()?.out.0;
        members.sort_unstable_by(|a, b| a.key.cmp(b.key));
        if members.windows(2).any(|w| w[0].key == w[1].key) {
            return None;
        }
        // The members are written again, in order, after the unsorted ones; those then go.
        self.diverge();
        let out = self.out.as_mut()?;
        let end = out.len();
        for (i, m) in self.members[base..].iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_within(m.out.0..m.out.1);
        }
        out.drain(unsorted..end);
        Some(())
    }

    /// The end of the string token at `pos` and whether it holds a backslash. `None` when the
    /// string is not terminated, holds a raw control character or is not UTF-8, none of which
    /// JSON allows.
    fn scan_string(&self) -> Option<(usize, bool)> {
        let (mut escaped, mut ascii) = (false, true);
        let mut i = self.pos + 1;
        loop {
            match *self.input.get(i)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    i += 1;
                }
                0..0x20 => return None,
                0x80.. => ascii = false,
                _ => {}
            }
            i += 1;
        }
        if !ascii {
            std::str::from_utf8(&self.input[self.pos + 1..i]).ok()?;
        }
        Some((i + 1, escaped))
    }

    /// An object key, copied as it is; gives up on escapes (the sort order is that of the
    /// unescaped bytes). Returns the key's bytes.
    fn key(&mut self) -> Option<&'a [u8]> {
        if self.peek()? != b'"' {
            return None;
        }
        let (end, escaped) = self.scan_string()?;
        if escaped {
            return None;
        }
        let key = &self.input[self.pos + 1..end - 1];
        self.copy_to(end);
        Some(key)
    }

    /// A string value. `serde_json` writes `"`, `\` and the control characters with the short
    /// escapes `\" \\ \b \f \n \r \t` (and `\u00XX` for the other control characters), and
    /// everything else as it is; a string whose escapes are all short ones is therefore already
    /// canonical. Others (`\/`, `\u0041`) are respelled by `serde_json` itself.
    fn string(&mut self) -> Option<()> {
        let (end, escaped) = self.scan_string()?;
        let token = &self.input[self.pos..end];
        let short_escapes_only = || {
            let mut bytes = token.iter();
            while let Some(&b) = bytes.next() {
                if b == b'\\'
                    && !matches!(
                        bytes.next(),
                        Some(b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't')
                    )
                {
                    return false;
                }
            }
            true
        };
        if !escaped || short_escapes_only() {
            self.copy_to(end);
            return Some(());
        }
        let s: String = serde_json::from_slice(token).ok()?;
        let spelling = serde_json::to_vec(&s).ok()?;
        self.replace_to(end, &spelling);
        Some(())
    }

    /// A number, checked against the JSON grammar. Short integers are kept as spelled; others
    /// are respelled by `serde_json` (`1E2` becomes `100.0`, `-0` becomes `-0.0`, an integer
    /// too big for 64 bits becomes a float, one too big for a float is an error).
    fn number(&mut self) -> Option<()> {
        let input = self.input;
        let digits = |from: usize| {
            from + input[from..]
                .iter()
                .position(|b| !b.is_ascii_digit())
                .unwrap_or(input.len() - from)
        };
        let sign = usize::from(input[self.pos] == b'-');
        let int_start = self.pos + sign;
        let mut end = match input.get(int_start)? {
            b'0' => int_start + 1,
            b'1'..=b'9' => digits(int_start),
            _ => return None,
        };
        let int_digits = end - int_start;
        let mut integer = true;
        if input.get(end) == Some(&b'.') {
            let fraction = digits(end + 1);
            if fraction == end + 1 {
                return None;
            }
            (end, integer) = (fraction, false);
        }
        if matches!(input.get(end), Some(b'e' | b'E')) {
            let exp_start = end + 1 + usize::from(matches!(input.get(end + 1), Some(b'+' | b'-')));
            let exponent = digits(exp_start);
            if exponent == exp_start {
                return None;
            }
            (end, integer) = (exponent, false);
        }
        let token = &input[self.pos..end];
        if integer && int_digits <= SHORT_INT_DIGITS && token != b"-0" {
            self.copy_to(end);
            return Some(());
        }
        let n: serde_json::Number = serde_json::from_slice(token).ok()?;
        let mut spelling = [0; NUMBER_SPELLING];
        let mut rest = &mut spelling[..];
        serde_json::to_writer(&mut rest, &n).ok()?;
        let len = NUMBER_SPELLING - rest.len();
        self.replace_to(end, &spelling[..len]);
        Some(())
    }
}

#[cfg(test)]
mod tests;
