//! The one place where signatures are computed and compared: HMAC with every secret of an
//! entry, compared with every signature the delivery offers, in constant time and without an
//! early exit, so the work done depends on the request and the number of secrets, never on
//! which secret or which candidate matched, or on whether the webhook id was known (an unknown
//! id is checked against a dummy secret through this same code; see [`Keys::work`]).

use std::cell::Cell;
use std::fmt;

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256, Sha512};
use subtle::{Choice, ConstantTimeEq};

use crate::config::webhooks::HmacAlgorithm;

/// A signing secret as key bytes (already decoded where the provider encodes it). Its `Debug`
/// never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub(crate) Vec<u8>);

impl Secret {
    #[must_use]
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Base64 that accepts the padded and the unpadded form (Standard Webhooks secrets are written
/// both ways).
pub const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_encode_padding(true)
        .with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// An entry's secrets while one delivery is checked, counting the MACs computed.
///
/// Every check computes one MAC (or digest) per *slot*, not per secret: the registry's largest
/// number of secrets per entry. Slots beyond an entry's own secrets are filled with a dummy key
/// whose result is discarded, so a delivery costs the same whether its id has one secret, two
/// during a rotation, or none at all (unknown).
pub struct Keys<'a> {
    secrets: &'a [Secret],
    slots: usize,
    filler: Option<&'a Secret>,
    work: Cell<usize>,
}

impl<'a> Keys<'a> {
    /// Exactly `secrets`, no padding.
    #[must_use]
    pub fn new(secrets: &'a [Secret]) -> Self {
        Self {
            secrets,
            slots: secrets.len(),
            filler: None,
            work: Cell::new(0),
        }
    }

    /// `secrets`, padded with `filler` up to `slots` keys.
    #[must_use]
    pub fn padded(secrets: &'a [Secret], slots: usize, filler: &'a Secret) -> Self {
        Self {
            secrets,
            slots: slots.max(secrets.len()),
            filler: Some(filler),
            work: Cell::new(0),
        }
    }

    /// MACs and digests computed so far: the timing-relevant work of a check. The unknown-id path
    /// and the bad-signature path are compared on it in the unit tests.
    #[must_use]
    pub fn work(&self) -> usize {
        self.work.get()
    }

    /// Each slot's key, and whether its result counts (a filler's never does).
    fn slots(&self) -> impl Iterator<Item = (&'a [u8], Choice)> + '_ {
        (0..self.slots).filter_map(move |i| match self.secrets.get(i) {
            Some(s) => Some((s.0.as_slice(), Choice::from(1))),
            None => self.filler.map(|f| (f.0.as_slice(), Choice::from(0))),
        })
    }

    /// Whether the HMAC of any of `messages` (each given as pieces that are concatenated) under
    /// any secret equals any of `candidates`.
    #[must_use]
    pub fn any_mac_matches(&self, alg: HmacAlgorithm, messages: &[&[&[u8]]], candidates: &[Vec<u8>]) -> bool {
        let mut found = Choice::from(0);
        for (key, counts) in self.slots() {
            for message in messages {
                let mac = hmac(alg, key, message);
                self.work.set(self.work.get() + 1);
                for c in candidates {
                    found |= mac.as_slice().ct_eq(c.as_slice()) & counts;
                }
            }
        }
        found.into()
    }

    /// Whether a presented token equals any secret (GitLab). Both sides are hashed first so the
    /// comparison takes the same time whatever the lengths.
    #[must_use]
    pub fn any_secret_equals(&self, token: &[u8]) -> bool {
        let presented = Sha256::digest(token);
        let mut found = Choice::from(0);
        for (key, counts) in self.slots() {
            let expected = Sha256::digest(key);
            self.work.set(self.work.get() + 1);
            found |= presented[..].ct_eq(&expected[..]) & counts;
        }
        found.into()
    }
}

/// HMAC of the concatenation of `pieces`.
#[must_use]
pub fn hmac(alg: HmacAlgorithm, key: &[u8], pieces: &[&[u8]]) -> Vec<u8> {
    fn run<M: Mac + hmac::digest::KeyInit>(key: &[u8], pieces: &[&[u8]]) -> Vec<u8> {
        // HMAC takes keys of any length, so this cannot fail.
        let mut mac = <M as hmac::digest::KeyInit>::new_from_slice(key).expect("HMAC takes any key length");
        for p in pieces {
            mac.update(p);
        }
        mac.finalize().into_bytes().to_vec()
    }
    match alg {
        HmacAlgorithm::Sha256 => run::<Hmac<Sha256>>(key, pieces),
        HmacAlgorithm::Sha1 => run::<Hmac<sha1::Sha1>>(key, pieces),
        HmacAlgorithm::Sha512 => run::<Hmac<Sha512>>(key, pieces),
    }
}

/// A hex signature's bytes (either case); `None` when it is not hex.
#[must_use]
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    hex::decode(s.trim()).ok()
}

/// A base64 signature's bytes; `None` when it is not base64.
#[must_use]
pub fn from_base64(s: &str) -> Option<Vec<u8>> {
    BASE64.decode(s.trim()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let mac = hmac(
            HmacAlgorithm::Sha256,
            b"Jefe",
            &[b"what do ya want ", b"for nothing?"],
        );
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let mac = hmac(HmacAlgorithm::Sha512, b"Jefe", &[b"what do ya want for nothing?"]);
        assert!(hex::encode(mac).starts_with("164b7a7bfcf819e2e395fbe73b56e0a387bd64222e831fd6"));
        // RFC 2202 test case 2 (HMAC-SHA1).
        let mac = hmac(HmacAlgorithm::Sha1, b"Jefe", &[b"what do ya want for nothing?"]);
        assert_eq!(hex::encode(mac), "effcdf6ae5eb2fa2d27416d5f184df9c259a7c79");
    }

    #[test]
    fn every_secret_is_tried_and_counted() {
        let secrets = [Secret::new("old"), Secret::new("new")];
        let keys = Keys::new(&secrets);
        let good = hmac(HmacAlgorithm::Sha256, b"new", &[b"m"]);
        assert!(keys.any_mac_matches(HmacAlgorithm::Sha256, &[&[b"m"]], &[vec![0; 32], good]));
        assert_eq!(keys.work(), 2, "no early exit on the first secret");
        assert!(!keys.any_mac_matches(HmacAlgorithm::Sha256, &[&[b"x"]], &[vec![0; 32]]));
        assert!(keys.any_secret_equals(b"old"));
        assert!(!keys.any_secret_equals(b"ol"));
        // Padded: the filler costs a MAC but never matches.
        let filler = Secret::new("filler");
        let one = [Secret::new("new")];
        let keys = Keys::padded(&one, 3, &filler);
        let by_filler = hmac(HmacAlgorithm::Sha256, b"filler", &[b"m"]);
        assert!(!keys.any_mac_matches(HmacAlgorithm::Sha256, &[&[b"m"]], &[by_filler]));
        assert!(!keys.any_secret_equals(b"filler"));
        assert!(keys.any_secret_equals(b"new"));
        assert_eq!(keys.work(), 9);
        let none = Keys::padded(&[], 3, &filler);
        assert!(!none.any_secret_equals(b"filler"));
        assert_eq!(none.work(), 3);
        assert_eq!(format!("{:?}", secrets[0]), "Secret(..)");
    }

    #[test]
    fn base64_takes_padded_and_unpadded() {
        assert_eq!(from_base64("YQ==").unwrap(), b"a");
        assert_eq!(from_base64("YQ").unwrap(), b"a");
        assert!(from_base64("*").is_none());
        assert_eq!(from_hex("0A").unwrap(), vec![10]);
    }
}
