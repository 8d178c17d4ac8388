//! API keys: `Authorization: Bearer <key>` or `X-API-Key: <key>`, looked up by SHA-256.
//!
//! Only digests are stored. Every lookup compares the presented key's digest with every entry
//! in constant time and without an early exit, so timing says nothing about which entry (or
//! how much of one) matched. That is linear in the number of keys: fine for the thousands a
//! file holds; a larger registry would index by a keyed hash first.

use std::path::{Path, PathBuf};
use std::sync::{PoisonError, RwLock};

use http::HeaderMap;
use idemgate_core::namespace::Principal;
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::{Rejected, SetupError, bearer, looks_like_jwt, principal};
use crate::config::identity::ApiKeyEntry;

#[derive(Debug)]
pub struct ApiKeys {
    path: PathBuf,
    // A std RwLock: lookups are short and never await; provisioning writes are rare.
    entries: RwLock<Vec<([u8; 32], Principal)>>,
}

/// One key as the admin API shows and takes it: never the key itself.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyView {
    pub key_sha256: String,
    pub tenant: String,
    pub project: Option<String>,
    pub subject: String,
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
        Ok(Self {
            path: path.to_owned(),
            entries: RwLock::new(entries),
        })
    }

    /// The provisioned keys (digests and principals).
    #[must_use]
    pub fn list(&self) -> Vec<ApiKeyView> {
        let entries = self.entries.read().unwrap_or_else(PoisonError::into_inner);
        entries.iter().map(|(d, p)| view(d, p)).collect()
    }

    /// Adds or replaces a key and rewrites the key file, so it survives a restart.
    ///
    /// # Errors
    /// An invalid entry, or the file cannot be written (nothing changes then).
    pub fn upsert(&self, v: &ApiKeyView) -> Result<(), Rejected> {
        let mut digest = [0u8; 32];
        hex::decode_to_slice(v.key_sha256.trim(), &mut digest)
            .map_err(|_| Rejected::new("key_sha256 must be 64 hex digits"))?;
        let p = principal(&v.tenant, v.project.as_deref(), &v.subject)?;
        self.change(|entries| {
            entries.retain(|(d, _)| *d != digest);
            entries.push((digest, p));
            true
        })
        .map(drop)
    }

    /// Removes a key by digest; `Ok(false)` when there was none.
    ///
    /// # Errors
    /// The file cannot be written (nothing changes then).
    pub fn remove(&self, key_sha256: &str) -> Result<bool, Rejected> {
        let mut digest = [0u8; 32];
        if hex::decode_to_slice(key_sha256.trim(), &mut digest).is_err() {
            return Ok(false);
        }
        self.change(|entries| {
            let before = entries.len();
            entries.retain(|(d, _)| *d != digest);
            entries.len() != before
        })
    }

    /// Applies `edit` to a copy, writes the file atomically (temp file + rename), then swaps it
    /// in: the file and the table never disagree.
    fn change(&self, edit: impl FnOnce(&mut Vec<([u8; 32], Principal)>) -> bool) -> Result<bool, Rejected> {
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        let mut next = entries.clone();
        if !edit(&mut next) {
            return Ok(false);
        }
        let views: Vec<ApiKeyView> = next.iter().map(|(d, p)| view(d, p)).collect();
        let yaml = serde_yaml_ng::to_string(&views).map_err(|e| Rejected::new(e.to_string()))?;
        let tmp = self.path.with_extension("yaml.tmp");
        std::fs::write(&tmp, yaml)
            .and_then(|()| std::fs::rename(&tmp, &self.path))
            .map_err(|e| Rejected::new(format!("cannot write the key file: {e}")))?;
        *entries = next;
        Ok(true)
    }

    /// `None` when no API key is presented.
    pub fn resolve(&self, headers: &HeaderMap) -> Option<Result<Principal, Rejected>> {
        let key = match headers.get("x-api-key") {
            Some(v) => v.to_str().ok()?.trim(),
            None => bearer(headers).filter(|t| !looks_like_jwt(t))?,
        };
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let entries = self.entries.read().unwrap_or_else(PoisonError::into_inner);
        let mut found = subtle::Choice::from(0);
        let mut index = 0u64;
        for (i, (d, _)) in entries.iter().enumerate() {
            let hit = d.ct_eq(&digest);
            index.conditional_assign(&(i as u64), hit & !found);
            found |= hit;
        }
        Some(if bool::from(found) {
            Ok(entries[usize::try_from(index).unwrap_or(0)].1.clone())
        } else {
            Err(Rejected::new("unknown API key"))
        })
    }
}

fn view(digest: &[u8; 32], p: &Principal) -> ApiKeyView {
    ApiKeyView {
        key_sha256: hex::encode(digest),
        tenant: p.tenant.clone(),
        project: Some(p.project.clone()),
        subject: p.subject.clone(),
    }
}
