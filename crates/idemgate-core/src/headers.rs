//! The response headers idempotency adds, shared by the gateway and the tower layer so both
//! write a replay the same way (SPEC 5): which upstream headers a record keeps, and what a
//! replay carries besides them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::engine::is_storable_header;
use crate::record::Millis;

/// `x-operation-id`: the record's id, identical on the first response and every replay.
pub const OPERATION_ID: HeaderName = HeaderName::from_static("x-operation-id");
/// `Idempotency-Expires`: when the stored outcome stops being replayed (RFC 3339).
pub const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");
/// `Idempotency-Status`: `processing` while a recovered key is still in flight, or a created
/// resource's asynchronous state (SPEC 5, 8).
pub const IDEMPOTENCY_STATUS: HeaderName = HeaderName::from_static("idempotency-status");

/// The headers of an upstream response that its record keeps for replays.
#[must_use]
pub fn storable(h: &HeaderMap) -> Vec<(String, Bytes)> {
    h.iter()
        .filter(|(n, _)| is_storable_header(n.as_str()))
        .map(|(n, v)| (n.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())))
        .collect()
}

/// Writes a replay's headers into `h`: the stored ones (a name or value that no longer parses is
/// left out), the replay marker `replayed`, the operation id and `Idempotency-Expires`.
pub fn write_replay(
    h: &mut HeaderMap,
    stored: Vec<(String, Bytes)>,
    replayed: &HeaderName,
    operation_id: &str,
    expires_at: Millis,
) {
    for (name, value) in stored {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            h.append(n, v);
        }
    }
    h.insert(replayed.clone(), HeaderValue::from_static("true"));
    h.insert(OPERATION_ID, value(operation_id));
    h.insert(IDEMPOTENCY_EXPIRES, rfc3339(expires_at));
}

/// A header value from text the gateway holds (an operation id, a key, an address); text that
/// is not a valid header value becomes `invalid` rather than failing the response.
#[must_use]
pub fn value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// An instant as an RFC 3339 timestamp, to the second.
#[must_use]
pub fn rfc3339(at: Millis) -> HeaderValue {
    use std::io::Write as _;
    let t = UNIX_EPOCH + Duration::from_millis(at);
    // Written on the stack: a `String` first was one more allocation per replay.
    let mut buf = [0u8; 32];
    let mut out = &mut buf[..];
    let _ = write!(
        out,
        "{}",
        humantime::format_rfc3339_seconds(t.max(SystemTime::UNIX_EPOCH))
    );
    let len = 32 - out.len();
    HeaderValue::from_bytes(&buf[..len]).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_carries_the_stored_headers_and_the_ones_idempotency_adds() {
        let mut h = HeaderMap::new();
        let stored = vec![
            ("content-type".to_owned(), Bytes::from_static(b"application/json")),
            ("location".to_owned(), Bytes::from_static(b"/orders/1")),
            ("bad name".to_owned(), Bytes::from_static(b"x")),
            ("etag".to_owned(), Bytes::from_static(b"bad\nvalue")),
        ];
        let marker = HeaderName::from_static("x-replayed");
        write_replay(&mut h, stored, &marker, "op_1", 1_700_000_000_000);
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["location"], "/orders/1");
        assert!(!h.contains_key("etag"));
        assert_eq!(h.len(), 5);
        assert_eq!(h["x-replayed"], "true");
        assert_eq!(h[OPERATION_ID], "op_1");
        assert_eq!(h[IDEMPOTENCY_EXPIRES], "2023-11-14T22:13:20Z");
    }

    #[test]
    fn only_storable_headers_are_kept() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("text/plain"));
        h.insert("set-cookie", HeaderValue::from_static("s=1"));
        h.insert("connection", HeaderValue::from_static("close"));
        assert_eq!(
            storable(&h),
            vec![("content-type".to_owned(), Bytes::from_static(b"text/plain"))]
        );
    }

    #[test]
    fn text_that_is_no_header_value_becomes_invalid() {
        assert_eq!(value("op_1"), "op_1");
        assert_eq!(value("a\r\nb"), "invalid");
    }
}
