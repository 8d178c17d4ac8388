//! API keys: `Authorization: Bearer <key>` or `X-API-Key: <key>`, looked up by SHA-256.
//!
//! Only digests are stored. Every lookup compares the presented key's digest with every entry
//! in constant time and without an early exit, so timing says nothing about which entry (or
//! how much of one) matched. That is linear in the number of keys: fine for the thousands a
//! file holds; a larger registry would index by a keyed hash first.

use std::path::Path;

use http::HeaderMap;
use idemgate_core::namespace::Principal;
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::{Rejected, SetupError, bearer, looks_like_jwt, principal};
use crate::config::identity::ApiKeyEntry;

#[derive(Debug)]
pub struct ApiKeys {
    entries: Vec<([u8; 32], Principal)>,
}

impl ApiKeys {
    /// Reads the key file.
    ///
    /// # Errors
    /// The file cannot be read or parsed, or an entry is invalid.
    pub fn load(path: &Path) -> Result<Self, SetupError> {
        let err = |why: String| SetupError {
            key: "api_keys.file",
            why,
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| err(format!("cannot read {}: {e}", path.display())))?;
        let list: Vec<ApiKeyEntry> =
            serde_yaml_ng::from_str(&text).map_err(|e| err(format!("{}: {e}", path.display())))?;
        let entries = list
            .into_iter()
            .enumerate()
            .map(|(i, e)| {
                let mut digest = [0u8; 32];
                hex::decode_to_slice(e.key_sha256.trim(), &mut digest)
                    .map_err(|_| err(format!("entry {i}: key_sha256 must be 64 hex digits")))?;
                let p = principal(&e.tenant, e.project.as_deref(), &e.subject)
                    .map_err(|r| err(format!("entry {i}: {r}")))?;
                Ok((digest, p))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { entries })
    }

    /// `None` when no API key is presented.
    pub fn resolve(&self, headers: &HeaderMap) -> Option<Result<Principal, Rejected>> {
        let key = match headers.get("x-api-key") {
            Some(v) => v.to_str().ok()?.trim(),
            None => bearer(headers).filter(|t| !looks_like_jwt(t))?,
        };
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let mut found = subtle::Choice::from(0);
        let mut index = 0u64;
        for (i, (d, _)) in self.entries.iter().enumerate() {
            let hit = d.ct_eq(&digest);
            index.conditional_assign(&(i as u64), hit & !found);
            found |= hit;
        }
        Some(if bool::from(found) {
            Ok(self.entries[usize::try_from(index).unwrap_or(0)].1.clone())
        } else {
            Err(Rejected::new("unknown API key"))
        })
    }
}
