//! A record as one Redis string, so that `begin` on an absent key is a plain
//! `SET key value NX PXAT t GET`: one command, no script.
//!
//! A fixed header comes first, so the scripts read and change single fields with `GETRANGE` and
//! `SETRANGE` without parsing the rest:
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 1 | format, `2` |
//! | 1 | 1 | state: `f` in flight, `c` completed |
//! | 2 | 1 | waiters: `1` once a `begin` answered "in flight" (then `complete`, `release` publish) |
//! | 3 | 20 | expiry (milliseconds, decimal, zero-padded) |
//! | 23 | 20 | lease end |
//! | 43 | 16 | lease token |
//! | 59 | 32 | fingerprint |
//! | 91 | 20 | created |
//! | 111 | 20 | generation |
//! | 131 | 5 + 5 | lengths of route and operation id (decimal) |
//! | 141 | … | route, operation id, then the encoded response (completed records only) |
//!
//! Numbers are fixed-width decimals: Lua compares them with `tonumber` and the scripts write
//! values the gateway formatted, never their own. State, waiters and expiry are adjacent, so
//! `complete` rewrites all three with one `SETRANGE`.

use idemgate_core::record::{Record, RecordState};
use idemgate_core::store::StoreError;

use crate::codec::{corrupt, decode_response, encode_response, fingerprint_from, token_bytes, token_from};

const FORMAT: u8 = b'2';
/// The part of the header every script reads (`GETRANGE key 0 130`): any change to a record
/// (complete, renew, a waiter, a new owner) changes it, so it also serves as a version. It
/// leaves out the route, which is safe because a token is random per attempt: two records with
/// one header are one attempt's.
pub const HEADER: usize = 131;
const LENGTHS: usize = 10;
const BODY: usize = HEADER + LENGTHS;
const MAX_TEXT: usize = 99_999;

/// A decoded record, with what the rules do not model.
#[derive(Debug)]
pub struct Stored {
    pub record: Record,
    /// Someone waits on it: a `begin` answered "in flight" already marked it.
    pub waiters: bool,
}

/// A number in decimal without `fmt` (which cost 5.7k instructions per `begin`, a quarter of
/// the store's own work): 20 zero-padded digits, room for `u64::MAX`.
pub struct Decimal([u8; 20]);

impl Decimal {
    #[must_use]
    pub fn new(mut n: u64) -> Self {
        let mut digits = [b'0'; 20];
        for d in digits.iter_mut().rev() {
            // `n % 10` is below 10: the cast cannot truncate.
            #[allow(clippy::cast_possible_truncation)]
            let digit = (n % 10) as u8;
            *d = b'0' + digit;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        Self(digits)
    }

    /// Zero-padded to 20 digits, as the header keeps numbers.
    #[must_use]
    pub fn padded(&self) -> &[u8] {
        &self.0
    }

    /// Without leading zeros (`0` for zero).
    #[must_use]
    pub fn plain(&self) -> &[u8] {
        let start = self.0.iter().position(|&d| d != b'0').unwrap_or(19);
        &self.0[start..]
    }
}

/// Encodes a record. The waiter flag starts clear.
///
/// # Errors
/// A route or operation id too long for its length field.
pub fn encode(record: &Record) -> Result<Vec<u8>, StoreError> {
    let (state, token, lease, response) = match &record.state {
        RecordState::InFlight { token, lease_until } => (b'f', token, *lease_until, None),
        RecordState::Completed { token, response } => (b'c', token, 0, Some(encode_response(response))),
    };
    let (route, op) = (record.route.as_bytes(), record.operation_id.as_bytes());
    if route.len() > MAX_TEXT || op.len() > MAX_TEXT {
        return Err(corrupt("route or operation id too long for the redis layout"));
    }
    let mut out = Vec::with_capacity(BODY + route.len() + op.len() + response.as_ref().map_or(0, Vec::len));
    out.extend_from_slice(&[FORMAT, state, b'0']);
    out.extend_from_slice(Decimal::new(record.expires_at).padded());
    out.extend_from_slice(Decimal::new(lease).padded());
    out.extend_from_slice(&token_bytes(*token));
    out.extend_from_slice(&record.fingerprint.0);
    for n in [record.created_at, record.generation] {
        out.extend_from_slice(Decimal::new(n).padded());
    }
    for len in [route.len(), op.len()] {
        // At most MAX_TEXT: five digits.
        out.extend_from_slice(&Decimal::new(u64::try_from(len).unwrap_or(u64::MAX)).padded()[15..]);
    }
    out.extend_from_slice(route);
    out.extend_from_slice(op);
    if let Some(r) = response {
        out.extend_from_slice(&r);
    }
    Ok(out)
}

/// What `complete.lua` writes over the in-flight value `flight` of its own attempt: completed,
/// nobody marked as waiting, the new expiry (20 padded digits), the rest as it was, then the
/// encoded response. Written here for `SET … IFEQ`, which must produce the script's bytes.
#[must_use]
pub fn completed(flight: &[u8], expires_at: &[u8], response: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(flight.len() + response.len());
    out.extend_from_slice(&[flight[0], b'c', b'0']);
    out.extend_from_slice(expires_at);
    out.extend_from_slice(&flight[23..]);
    out.extend_from_slice(response);
    out
}

/// What `renew.lua` writes over the in-flight value `flight` of its own attempt: the new lease
/// end `lease_until` (20 padded digits), and the same as the expiry when the lease passes it (a
/// record lives at least as long as its lease). Written here for `SET … IFEQ`, which must
/// produce the script's bytes.
#[must_use]
pub fn renewed(flight: &[u8], lease_until: &[u8], past_expiry: bool) -> Vec<u8> {
    let mut out = flight.to_vec();
    out[23..43].copy_from_slice(lease_until);
    if past_expiry {
        out[3..23].copy_from_slice(lease_until);
    }
    out
}

/// Decodes a value written by [`encode`] and the scripts.
///
/// # Errors
/// [`StoreError::Corrupt`] for anything else.
pub fn decode(raw: &[u8]) -> Result<Stored, StoreError> {
    if raw.len() < BODY || raw[0] != FORMAT {
        return Err(corrupt("not a record of the redis layout"));
    }
    let num = |at: usize, len: usize| -> Result<u64, StoreError> {
        std::str::from_utf8(&raw[at..at + len])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt("bad number in a redis record"))
    };
    let token = token_from(&raw[43..59])?;
    let lease_until = num(23, 20)?;
    let len = |at: usize| num(at, 5).map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    let (route_len, op_len) = (len(131)?, len(136)?);
    let rest = &raw[BODY..];
    if rest.len() < route_len.saturating_add(op_len) {
        return Err(corrupt("short redis record"));
    }
    let (route, rest) = rest.split_at(route_len);
    let (op, response) = rest.split_at(op_len);
    let state = match raw[1] {
        b'f' => RecordState::InFlight { token, lease_until },
        b'c' => RecordState::Completed {
            token,
            response: decode_response(response)?,
        },
        _ => return Err(corrupt("unknown record state")),
    };
    let text = |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| corrupt("text field is not utf-8"));
    Ok(Stored {
        record: Record {
            state,
            fingerprint: fingerprint_from(&raw[59..91])?,
            route: text(route)?,
            operation_id: text(op)?,
            created_at: num(91, 20)?,
            expires_at: num(3, 20)?,
            generation: num(111, 20)?,
        },
        waiters: raw[2] == b'1',
    })
}

#[cfg(test)]
mod tests {
    use idemgate_core::Fingerprint;
    use idemgate_core::record::{LeaseToken, Millis, StoredResponse};

    use super::*;

    fn record(state: RecordState) -> Record {
        Record {
            state,
            fingerprint: Fingerprint([7; 32]),
            route: "orders".into(),
            operation_id: "op-1".into(),
            created_at: 1_700_000_000_000,
            expires_at: Millis::MAX,
            generation: 3,
        }
    }

    #[test]
    fn records_round_trip_in_both_states() {
        let token = LeaseToken(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        let flight = record(RecordState::InFlight {
            token,
            lease_until: 1_700_000_030_000,
        });
        let raw = encode(&flight).unwrap();
        assert_eq!(raw.len(), BODY + "orders".len() + "op-1".len());
        let back = decode(&raw).unwrap();
        assert_eq!(back.record, flight);
        assert!(!back.waiters);

        let done = record(RecordState::Completed {
            token,
            response: StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: Some(b"{\"id\":1}".to_vec().into()),
            },
        });
        let mut raw = encode(&done).unwrap();
        raw[2] = b'1';
        let back = decode(&raw).unwrap();
        assert_eq!(back.record, done);
        assert!(back.waiters);
    }

    #[test]
    fn header_fields_sit_where_the_scripts_read_them() {
        let raw = encode(&record(RecordState::InFlight {
            token: LeaseToken(1),
            lease_until: 42,
        }))
        .unwrap();
        // Lua's 1-based string.sub(4, 23) and (24, 43): expiry and lease.
        assert_eq!(&raw[3..23], b"18446744073709551615");
        assert_eq!(&raw[23..43], b"00000000000000000042");
        assert_eq!(&raw[43..59], &1u128.to_be_bytes());
        assert_eq!(&raw[111..131], b"00000000000000000003");
        assert_eq!(&raw[131..141], b"0000600004");
    }

    #[test]
    fn completed_is_the_completed_record() {
        let token = LeaseToken(9);
        let flight = encode(&record(RecordState::InFlight {
            token,
            lease_until: 1_700_000_030_000,
        }))
        .unwrap();
        let response = StoredResponse {
            status: 200,
            headers: vec![],
            body: Some(b"{}".to_vec().into()),
        };
        let exp = Decimal::new(1_700_086_400_000);
        let raw = completed(&flight, exp.padded(), &encode_response(&response));
        let mut done = record(RecordState::Completed { token, response });
        done.expires_at = 1_700_086_400_000;
        // Byte for byte what `encode` gives the completed record (its lease field aside, which
        // the script leaves as it was and `decode` does not read for a completed record).
        let back = decode(&raw).unwrap();
        assert_eq!(back.record, done);
        assert!(!back.waiters);
        let mut encoded = encode(&done).unwrap();
        encoded[23..43].copy_from_slice(&flight[23..43]);
        assert_eq!(raw, encoded);
    }

    #[test]
    fn decimals_padded_and_plain() {
        for (n, plain) in [
            (0, "0"),
            (7, "7"),
            (1_700_000_000_123, "1700000000123"),
            (u64::MAX, "18446744073709551615"),
        ] {
            let d = Decimal::new(n);
            assert_eq!(d.plain(), plain.as_bytes());
            assert_eq!(d.padded(), format!("{n:020}").as_bytes());
        }
    }

    #[test]
    fn anything_else_is_corrupt() {
        let good = encode(&record(RecordState::InFlight {
            token: LeaseToken(1),
            lease_until: 42,
        }))
        .unwrap();
        for bad in [
            &b""[..],
            &good[..HEADER],
            &good[..good.len() - 1],
            &[b'1'; 160][..],
        ] {
            assert!(matches!(decode(bad), Err(StoreError::Corrupt(_))), "{bad:?}");
        }
        let mut state = good.clone();
        state[1] = b'x';
        assert!(decode(&state).is_err());
    }
}
