//! The encoding of one entry: the layout in the [module documentation](super), written by
//! [`write_entry`] and read back by [`decode`], and the completion of an in-flight entry without
//! either ([`Head::read`], [`Head::write_completed`]). Nothing here touches a table or a lock.

use bytes::Bytes;

use super::Routes;
use crate::engine::OperationId;
use crate::fingerprint::Fingerprint;
use crate::record::{LeaseToken, Millis, Record, RecordState, StoredResponse};
use crate::rules::{Acquisition, BeginRequest, Standing};

/// A compression dictionary for stored header names: the storable response headers of
/// [`crate::engine::is_storable_header`] (kept in upstream order there, not here). A name not in
/// it is stored inline, so this list falling behind the allow-list only costs bytes.
pub(super) const HEADER_NAMES: &[&str] = &[
    "content-type",
    "location",
    "etag",
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-location",
    "expires",
    "last-modified",
    "link",
    "retry-after",
    "vary",
    "x-request-id",
];

pub(super) const COMPLETED: u8 = 1;
pub(super) const HAS_BODY: u8 = 1 << 1;
pub(super) const NEVER_EXPIRES: u8 = 1 << 2;
pub(super) const OP_SHIFT: u8 = 3;
pub(super) const OP_MASK: u8 = 0b11 << OP_SHIFT;
pub(super) const OP_RAW: u8 = 0;
pub(super) const OP_PREFIXED_UUID: u8 = 1;
pub(super) const OP_HYPHENATED_UUID: u8 = 2;

/// How an operation id is stored: the gateway's own ids (`op_` and a UUIDv7 in lowercase hex)
/// and hyphenated UUIDs as their 16 bytes, anything else as it is.
pub(super) enum OpId<'a> {
    Raw(&'a str),
    Uuid(u8, [u8; 16]),
}

impl<'a> OpId<'a> {
    pub(super) fn of(s: &'a str) -> Self {
        // Only a form that encodes back to exactly `s` is packed, so every id round-trips.
        let mut buf = uuid::Uuid::encode_buffer();
        if let Some(hex) = s.strip_prefix("op_").filter(|h| h.len() == 32)
            && let Ok(id) = uuid::Uuid::try_parse(hex)
            && id.simple().encode_lower(&mut buf) == hex
        {
            return Self::Uuid(OP_PREFIXED_UUID, id.into_bytes());
        }
        if s.len() == 36
            && let Ok(id) = uuid::Uuid::try_parse(s)
            && id.hyphenated().encode_lower(&mut buf) == s
        {
            return Self::Uuid(OP_HYPHENATED_UUID, id.into_bytes());
        }
        Self::Raw(s)
    }

    pub(super) fn form(&self) -> u8 {
        match self {
            Self::Raw(_) => OP_RAW,
            Self::Uuid(form, _) => *form,
        }
    }
}

/// Where an entry is written: [`Count`] to size it, then a `Vec` to fill it.
pub(super) trait Sink {
    fn put(&mut self, bytes: &[u8]);

    fn byte(&mut self, b: u8);

    /// Byte by byte: an entry has about fifteen varints of one or two bytes, and a
    /// variable-length `put` of each cost a `memcpy` call.
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            #[allow(clippy::cast_possible_truncation)] // the low seven bits
            self.byte((v as u8) | 0x80);
            v >>= 7;
        }
        #[allow(clippy::cast_possible_truncation)] // below 0x80
        self.byte(v as u8);
    }

    fn len(&mut self, n: usize) {
        self.varint(n as u64);
    }

    fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.put(b);
    }
}

struct Count(usize);

impl Sink for Count {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }

    fn byte(&mut self, _: u8) {
        self.0 += 1;
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn byte(&mut self, b: u8) {
        self.push(b);
    }
}

/// Something written as an entry.
pub(super) trait Encode {
    fn write(&self, out: &mut impl Sink);
}

/// What `e` writes, in one exactly sized allocation: it is written twice, once to count and once
/// to fill, because a `Vec` grown and then shrunk with `into_boxed_slice` may keep a larger block
/// than it needs under allocators that shrink in place.
pub(super) fn exact(e: &impl Encode) -> Box<[u8]> {
    let mut count = Count(0);
    e.write(&mut count);
    let mut out = Vec::with_capacity(count.0);
    e.write(&mut out);
    debug_assert_eq!(out.len(), count.0);
    out.into_boxed_slice()
}

/// A record's entry, written from the record.
pub(super) struct Fresh<'a> {
    pub(super) key: &'a str,
    pub(super) rec: &'a Record,
    /// The route's index among the store's interned ones.
    pub(super) route: Option<usize>,
    pub(super) op: OpId<'a>,
}

impl Encode for Fresh<'_> {
    fn write(&self, out: &mut impl Sink) {
        let rec = self.rec;
        write_entry(
            out,
            &Fields {
                key: self.key,
                fingerprint: &rec.fingerprint,
                token: rec.token(),
                generation: rec.generation,
                created_at: rec.created_at,
                expires_at: rec.expires_at,
                op: &self.op,
                route: (self.route, &rec.route),
                tail: match &rec.state {
                    RecordState::InFlight { lease_until, .. } => Tail::Lease(*lease_until),
                    RecordState::Completed { response, .. } => Tail::Response(response),
                },
            },
        );
    }
}

/// A new owner's in-flight entry, written from its request and the rule's terms
/// ([`crate::rules::begin_absent`]): the record [`Acquisition::record`] would build, never built.
pub(super) struct Acquired<'a> {
    pub(super) key: &'a str,
    pub(super) req: &'a BeginRequest<'a>,
    pub(super) terms: &'a Acquisition,
    pub(super) route: Option<usize>,
    pub(super) op: OpId<'a>,
}

impl Encode for Acquired<'_> {
    fn write(&self, out: &mut impl Sink) {
        write_entry(
            out,
            &Fields {
                key: self.key,
                fingerprint: &self.req.fingerprint,
                token: self.req.token,
                generation: self.terms.generation,
                created_at: self.terms.created_at,
                expires_at: self.terms.expires_at,
                op: &self.op,
                route: (self.route, self.req.route),
                tail: Tail::Lease(self.terms.lease_until),
            },
        );
    }
}

/// An entry's fields, borrowed from wherever they are.
struct Fields<'a> {
    key: &'a str,
    fingerprint: &'a Fingerprint,
    token: LeaseToken,
    generation: u64,
    created_at: Millis,
    expires_at: Millis,
    op: &'a OpId<'a>,
    /// The route's index among the interned ones, and its name (written when not interned).
    route: (Option<usize>, &'a str),
    tail: Tail<'a>,
}

/// What follows the route: an in-flight entry's lease end, or a completed one's response.
enum Tail<'a> {
    Lease(Millis),
    Response(&'a StoredResponse),
}

/// An in-flight entry completed, written from its [`Head`].
pub(super) struct Completion<'a> {
    pub(super) head: &'a Head<'a>,
    pub(super) response: &'a StoredResponse,
    pub(super) expires_at: Millis,
}

impl Encode for Completion<'_> {
    fn write(&self, out: &mut impl Sink) {
        self.head.write_completed(out, self.response, self.expires_at);
    }
}

fn write_entry(out: &mut impl Sink, f: &Fields<'_>) {
    out.bytes(f.key.as_bytes());
    let (completed, has_body) = match &f.tail {
        Tail::Lease(_) => (false, false),
        Tail::Response(response) => (true, response.body.is_some()),
    };
    let flags = flags(f.op.form(), completed, has_body, f.expires_at);
    write_times(out, flags, f.created_at, f.expires_at);
    out.put(&f.fingerprint.0);
    out.put(&f.token.0.to_le_bytes());
    out.varint(f.generation);
    match f.op {
        OpId::Raw(s) => out.bytes(s.as_bytes()),
        OpId::Uuid(_, b) => out.put(b),
    }
    match f.route {
        (Some(i), _) => out.len(i + 1),
        (None, name) => {
            out.varint(0);
            out.bytes(name.as_bytes());
        }
    }
    match f.tail {
        Tail::Lease(lease_until) => out.varint(to_delta(f.created_at, lease_until)),
        Tail::Response(response) => write_response(out, response),
    }
}

/// The flags byte's bits for a record's state and expiry, beside its operation id form.
fn flags(op_form: u8, completed: bool, has_body: bool, expires_at: Millis) -> u8 {
    let mut flags = op_form << OP_SHIFT;
    if completed {
        flags |= COMPLETED;
    }
    if has_body {
        flags |= HAS_BODY;
    }
    if expires_at == Millis::MAX {
        flags |= NEVER_EXPIRES;
    }
    flags
}

/// The flags, `created_at` and the expiry: the part of an entry between its key and its
/// fingerprint.
fn write_times(out: &mut impl Sink, flags: u8, created_at: Millis, expires_at: Millis) {
    out.byte(flags);
    out.varint(created_at);
    if expires_at != Millis::MAX {
        out.varint(to_delta(created_at, expires_at));
    }
}

/// A completed record's tail: status, headers, body.
fn write_response(out: &mut impl Sink, response: &StoredResponse) {
    out.varint(u64::from(response.status));
    out.len(response.headers.len());
    for (name, value) in &response.headers {
        match HEADER_NAMES.iter().position(|n| n == name) {
            Some(i) => out.len(i),
            None => {
                out.len(HEADER_NAMES.len() + name.len());
                out.put(name.as_bytes());
            }
        }
        out.bytes(value);
    }
    if let Some(body) = &response.body {
        out.put(body);
    }
}

/// An entry read as far as `complete` needs: the record's [`Standing`] and the byte ranges a
/// completed entry copies unchanged, without decoding the operation id, the route or a response.
pub(super) struct Head<'a> {
    /// The key's length and bytes.
    key: &'a [u8],
    flags: u8,
    created_at: Millis,
    /// The fingerprint, token, generation, operation id and route, as stored.
    fields: &'a [u8],
    pub(super) standing: Standing,
}

impl<'a> Head<'a> {
    pub(super) fn read(entry: &'a [u8]) -> Result<Self, Corrupt> {
        let mut r = Reader(entry);
        let key_len = r.len()?;
        r.take(key_len)?;
        let key = &entry[..entry.len() - r.0.len()];
        let (flags, created_at, expires_at) = r.times()?;
        let start = entry.len() - r.0.len();
        r.take(32)?;
        let token = LeaseToken(u128::from_le_bytes(r.array()?));
        r.varint()?;
        match (flags & OP_MASK) >> OP_SHIFT {
            OP_RAW => {
                let n = r.len()?;
                r.take(n)?;
            }
            OP_PREFIXED_UUID | OP_HYPHENATED_UUID => {
                r.take(16)?;
            }
            _ => return Err(Corrupt("operation id form")),
        }
        if r.varint()? == 0 {
            let n = r.len()?;
            r.take(n)?;
        }
        let fields = &entry[start..entry.len() - r.0.len()];
        // An in-flight entry ends with its lease. One that does not is refused here as `decode`
        // refuses it, rather than copied into a completed entry.
        if flags & COMPLETED == 0 {
            r.varint()?;
            if !r.0.is_empty() {
                return Err(Corrupt("trailing bytes"));
            }
        }
        Ok(Self {
            key,
            flags,
            created_at,
            fields,
            standing: Standing {
                token,
                completed: flags & COMPLETED != 0,
                expires_at,
            },
        })
    }

    /// The entry of this record completed with `response` and expiring at `expires_at`: what
    /// [`write_entry`] writes for the record `rules::complete` makes of it.
    pub(super) fn write_completed(&self, out: &mut impl Sink, response: &StoredResponse, expires_at: Millis) {
        out.put(self.key);
        let op_form = (self.flags & OP_MASK) >> OP_SHIFT;
        let flags = flags(op_form, true, response.body.is_some(), expires_at);
        write_times(out, flags, self.created_at, expires_at);
        out.put(self.fields);
        write_response(out, response);
    }
}

/// A time relative to `base`, zigzag-encoded: the times of a record lie a little after its
/// creation, so this is a short varint; wrapping arithmetic keeps every value exact.
#[allow(clippy::cast_possible_wrap, clippy::cast_sign_loss)]
pub(super) fn to_delta(base: Millis, t: Millis) -> u64 {
    let d = t.wrapping_sub(base) as i64;
    ((d << 1) ^ (d >> 63)) as u64
}

#[allow(clippy::cast_possible_wrap, clippy::cast_sign_loss)]
pub(super) fn from_delta(base: Millis, z: u64) -> Millis {
    let d = ((z >> 1) as i64) ^ -((z & 1) as i64);
    base.wrapping_add(d as u64)
}

/// A stored entry that does not decode: a bug in this file, reported as [`StoreError::Corrupt`].
#[derive(Debug, thiserror::Error)]
#[error("memory store entry does not decode: {0}")]
pub(super) struct Corrupt(pub(super) &'static str);

pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], Corrupt> {
        if n > self.0.len() {
            return Err(Corrupt("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], Corrupt> {
        self.take(N)?.try_into().map_err(|_| Corrupt("truncated"))
    }

    pub(super) fn byte(&mut self) -> Result<u8, Corrupt> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn varint(&mut self) -> Result<u64, Corrupt> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(Corrupt("varint overflow"));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Corrupt("varint too long"))
    }

    pub(super) fn len(&mut self) -> Result<usize, Corrupt> {
        usize::try_from(self.varint()?).map_err(|_| Corrupt("length"))
    }

    pub(super) fn string(&mut self) -> Result<String, Corrupt> {
        let n = self.len()?;
        utf8(self.take(n)?)
    }

    /// The flags, `created_at` and the expiry, read as [`write_times`] wrote them.
    fn times(&mut self) -> Result<(u8, Millis, Millis), Corrupt> {
        let flags = self.byte()?;
        let created_at = self.varint()?;
        let expires_at = if flags & NEVER_EXPIRES == 0 {
            from_delta(created_at, self.varint()?)
        } else {
            Millis::MAX
        };
        Ok((flags, created_at, expires_at))
    }

    pub(super) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

pub(super) fn utf8(b: &[u8]) -> Result<String, Corrupt> {
    String::from_utf8(b.to_vec()).map_err(|_| Corrupt("utf-8"))
}

/// The record an entry holds, its route looked up in the store's interned ones.
pub(super) fn decode(entry: &[u8], routes: &Routes) -> Result<Record, Corrupt> {
    let mut r = Reader(entry);
    let key_len = r.len()?;
    r.take(key_len)?;
    let (flags, created_at, expires_at) = r.times()?;
    let fingerprint = Fingerprint(r.array()?);
    let token = LeaseToken(u128::from_le_bytes(r.array()?));
    let generation = r.varint()?;
    let operation_id = match (flags & OP_MASK) >> OP_SHIFT {
        OP_RAW => r.string()?,
        OP_PREFIXED_UUID => OperationId::of(uuid::Uuid::from_bytes(r.array()?))
            .as_str()
            .to_owned(),
        OP_HYPHENATED_UUID => uuid::Uuid::from_bytes(r.array()?).hyphenated().to_string(),
        _ => return Err(Corrupt("operation id form")),
    };
    let route = match r.varint()? {
        0 => r.string()?,
        i => routes
            .name(usize::try_from(i - 1).map_err(|_| Corrupt("route index"))?)
            .ok_or(Corrupt("route index"))?
            .to_owned(),
    };
    let state = if flags & COMPLETED == 0 {
        RecordState::InFlight {
            token,
            lease_until: from_delta(created_at, r.varint()?),
        }
    } else {
        let status = u16::try_from(r.varint()?).map_err(|_| Corrupt("status"))?;
        let count = r.len()?;
        // Each header takes at least two bytes, so a corrupt count cannot reserve much.
        let mut headers = Vec::with_capacity(count.min(r.0.len() / 2));
        for _ in 0..count {
            let code = r.len()?;
            let name = match HEADER_NAMES.get(code) {
                Some(name) => (*name).to_owned(),
                None => utf8(r.take(code - HEADER_NAMES.len())?)?,
            };
            let value_len = r.len()?;
            headers.push((name, Bytes::copy_from_slice(r.take(value_len)?)));
        }
        let body = (flags & HAS_BODY != 0).then(|| Bytes::copy_from_slice(r.rest()));
        RecordState::Completed {
            token,
            response: StoredResponse {
                status,
                headers,
                body,
            },
        }
    };
    if !r.0.is_empty() {
        return Err(Corrupt("trailing bytes"));
    }
    Ok(Record {
        state,
        fingerprint,
        route,
        operation_id,
        created_at,
        expires_at,
        generation,
    })
}

/// The key an entry starts with; `None` only for an entry `encode` did not write.
pub(super) fn entry_key(entry: &[u8]) -> Option<&[u8]> {
    let mut r = Reader(entry);
    let n = r.len().ok()?;
    r.take(n).ok()
}

/// When an entry's record expires, read without decoding the rest.
pub(super) fn entry_expires_at(entry: &[u8]) -> Option<Millis> {
    let mut r = Reader(entry);
    let n = r.len().ok()?;
    r.take(n).ok()?;
    r.times().ok().map(|(_, _, expires_at)| expires_at)
}
