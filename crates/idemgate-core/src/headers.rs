//! The response headers idempotency adds, shared by the gateway and the tower layer so both
//! write a replay the same way (SPEC 5): which upstream headers a record keeps, and what a
//! replay carries besides them.

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

/// An instant as an RFC 3339 timestamp, to the second (`2026-11-25T14:05:09Z`).
#[must_use]
pub fn rfc3339(at: Millis) -> HeaderValue {
    let secs = at / 1000;
    let (year, month, day) = civil_from_days(secs / 86_400);
    if year > 9999 {
        // RFC 3339 has four-digit years (and `humantime`, used here before, failed past them).
        return HeaderValue::from_static("9999-12-31T23:59:59Z");
    }
    // Written by hand: through `fmt` it was the largest part of a replay's header work.
    let mut buf = *b"0000-00-00T00:00:00Z";
    let of_day = secs % 86_400;
    for (at, value, width) in [
        (0, year, 4),
        (5, month, 2),
        (8, day, 2),
        (11, of_day / 3600, 2),
        (14, of_day / 60 % 60, 2),
        (17, of_day % 60, 2),
    ] {
        let mut v = value;
        for i in (at..at + width).rev() {
            #[allow(clippy::cast_possible_truncation)] // a decimal digit
            let digit = (v % 10) as u8;
            buf[i] = b'0' + digit;
            v /= 10;
        }
    }
    HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// (year, month, day) of a day counted from 1970-01-01: Howard Hinnant's `civil_from_days`,
/// for days on or after the epoch.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
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

    #[test]
    fn rfc3339_matches_humantime() {
        let fmt = |at: Millis| {
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(at);
            humantime::format_rfc3339_seconds(t).to_string()
        };
        let day = 86_400_000;
        let mut instants = vec![0, 999, 1_000, day - 1, day, 951_782_400_000, 4_107_542_399_999];
        // Leap days, year ends and a spread of ordinary instants up to the year 9999.
        instants.extend((0..4000u64).map(|i| i * 63_113_904_001 % 253_402_300_799_000));
        instants.extend((0..400u64).map(|y| (y * 365 + y / 4) * day + 59 * day));
        for at in instants {
            assert_eq!(rfc3339(at).to_str().unwrap(), fmt(at), "at {at}");
        }
        assert_eq!(rfc3339(Millis::MAX).to_str().unwrap(), "9999-12-31T23:59:59Z");
    }
}
