//! Operation ids: the `x-operation-id` of a record, identical on every replay.

use crate::record::{Millis, now_millis};

/// A new operation id: a UUIDv7, time-ordered so ids sort by creation (to the millisecond).
///
/// The random bits come from the thread's CSPRNG (`rand`, seeded once from the OS): `now_v7`
/// asks the kernel for them, one `getrandom` system call per request.
#[must_use]
pub fn new_operation_id() -> String {
    OperationId::fresh(now_millis()).as_str().to_owned()
}

/// An operation id of the usual form, `op_` and the 32 lower-case hex digits of a UUID, held on
/// the stack: `begin` needs a fresh one for every request, but only a request that executes
/// keeps it (a replay, the usual retry, allocated it for nothing), and the memory store writes
/// stored ids back in this form.
pub(crate) struct OperationId([u8; OperationId::LEN]);

impl OperationId {
    const LEN: usize = 3 + uuid::fmt::Simple::LENGTH;

    pub(super) fn fresh(now: Millis) -> Self {
        Self::of(uuid::Builder::from_unix_timestamp_millis(now, &rand::random()).into_uuid())
    }

    pub(crate) fn of(id: uuid::Uuid) -> Self {
        let mut buf = [0; Self::LEN];
        buf[..3].copy_from_slice(b"op_");
        id.simple().encode_lower(&mut buf[3..]);
        Self(buf)
    }

    pub(crate) fn as_str(&self) -> &str {
        // `op_` and lower-case hex digits: ASCII.
        std::str::from_utf8(&self.0).unwrap_or("op_")
    }
}
