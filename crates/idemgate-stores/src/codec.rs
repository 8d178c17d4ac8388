//! Encodings shared by the networked stores: a [`StoredResponse`] as one opaque value, and the
//! 128-bit [`LeaseToken`] as bytes.
//!
//! The response is the one part of a record that a store never inspects, so Redis and
//! PostgreSQL keep it as a single binary value (postcard, behind a format byte so the encoding
//! can change without a migration) instead of spreading status, headers and body over fields.
//! Everything a store must compare (state, token, lease, expiry, fingerprint, route) stays in
//! its own field or column.

use idemgate_core::record::{LeaseToken, StoredResponse};
use idemgate_core::store::StoreError;

/// Format byte in front of every encoded response.
const FORMAT: u8 = 1;

/// Encodes a response for storage.
#[must_use]
pub fn encode_response(response: &StoredResponse) -> Vec<u8> {
    let mut out = vec![FORMAT];
    // Serializing plain structs into a Vec cannot fail.
    out.extend(postcard::to_stdvec(response).unwrap_or_default());
    out
}

/// Decodes a response written by [`encode_response`].
///
/// # Errors
/// [`StoreError::Corrupt`] for an unknown format or undecodable bytes.
pub fn decode_response(bytes: &[u8]) -> Result<StoredResponse, StoreError> {
    match bytes.split_first() {
        Some((&FORMAT, rest)) => postcard::from_bytes(rest).map_err(|e| StoreError::Corrupt(Box::new(e))),
        _ => Err(StoreError::Corrupt("unknown response format".into())),
    }
}

/// A token as 16 big-endian bytes.
#[must_use]
pub fn token_bytes(token: LeaseToken) -> [u8; 16] {
    token.0.to_be_bytes()
}

/// A token from 16 big-endian bytes.
///
/// # Errors
/// [`StoreError::Corrupt`] when the value is not 16 bytes long.
pub fn token_from(bytes: &[u8]) -> Result<LeaseToken, StoreError> {
    <[u8; 16]>::try_from(bytes)
        .map(|b| LeaseToken(u128::from_be_bytes(b)))
        .map_err(|_| corrupt("lease token is not 16 bytes"))
}

/// A fingerprint from 32 bytes.
///
/// # Errors
/// [`StoreError::Corrupt`] when the value is not 32 bytes long.
pub fn fingerprint_from(bytes: &[u8]) -> Result<idemgate_core::Fingerprint, StoreError> {
    <[u8; 32]>::try_from(bytes)
        .map(idemgate_core::Fingerprint)
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))
}

/// A corrupt-record error with a static reason.
#[must_use]
pub fn corrupt(why: &'static str) -> StoreError {
    StoreError::Corrupt(why.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_and_tokens_round_trip() {
        let r = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Some(b"{}".to_vec().into()),
        };
        assert_eq!(decode_response(&encode_response(&r)).unwrap(), r);
        assert!(matches!(decode_response(&[7, 0]), Err(StoreError::Corrupt(_))));
        let t = LeaseToken(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(token_from(&token_bytes(t)).unwrap(), t);
        assert!(token_from(&[1, 2]).is_err());
    }
}
