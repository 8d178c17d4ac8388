//! The webhook registry: opaque ids (`wh_` + 128 random bits as 32 lowercase hex digits) mapped
//! to a tenant, a project, a provider and one or more signing secrets.
//!
//! Entries come from two sources that never overwrite each other: the registry file
//! (`webhooks.registry`), re-read without a restart when it changes, and entries provisioned at
//! run time ([`Registry::upsert`], for the admin API). A lookup checks the file's modification
//! stamp at most once per [`CHECK_EVERY`]; secrets are read from their environment variables at
//! each (re)load, so the registry holds key bytes, never variable names resolved later. A reload
//! that fails (unreadable file, bad YAML, a bad entry, an unset variable) keeps the previous
//! entries and logs a warning once per change of the file; only the first load is fatal.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime};

use idemgate_core::namespace::PROJECT_TENANT;

use super::crypto::{BASE64, Secret};
use crate::config::webhooks::{Provider, RegistryEntry};

use base64::Engine as _;

/// How often a lookup may look at the registry file's modification stamp.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// A registered webhook endpoint, with its secrets resolved to key bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub id: String,
    pub tenant: String,
    /// The registry's project, or [`PROJECT_TENANT`] when the entry names none.
    pub project: String,
    pub provider: Provider,
    /// Every secret verifies (rotation: old and new at once). Never empty.
    pub secrets: Vec<Secret>,
}

/// Why the registry, or one of its entries, cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a YAML list of webhook entries: {why}")]
    Parse { path: PathBuf, why: String },
    /// `entry` is the 1-based position in the file, or the id for a provisioned entry: ids are
    /// capability URLs, so file errors name positions rather than ids.
    #[error("entry {entry}: {why}")]
    Entry { entry: String, why: String },
}

/// Whether `id` has the registry's shape: `wh_` and 32 lowercase hex digits.
#[must_use]
pub fn valid_id(id: &str) -> bool {
    id.strip_prefix("wh_").is_some_and(|h| {
        h.len() == 32
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// A new random id, for provisioning.
#[must_use]
pub fn new_id() -> String {
    format!("wh_{:032x}", idemgate_core::LeaseToken::random().0)
}

impl Entry {
    /// Resolves a file entry: checks the id, reads each secret through `env` and decodes it as
    /// the provider expects.
    ///
    /// # Errors
    /// A malformed id, an empty tenant, no secrets, an unset or empty variable, or a secret the
    /// provider cannot use. The message names variables, never their values.
    pub fn resolve(file: &RegistryEntry, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, String> {
        if !valid_id(&file.id) {
            return Err("`id` must be `wh_` followed by 32 lowercase hex digits (128 random bits)".into());
        }
        if file.tenant.is_empty() {
            return Err("`tenant` is empty".into());
        }
        if file.project.as_deref() == Some("") {
            return Err("`project` is empty (leave it out for a tenant-wide webhook)".into());
        }
        if file.secrets_env.is_empty() {
            return Err("`secrets_env` names no variable".into());
        }
        let mut secrets = Vec::with_capacity(file.secrets_env.len());
        for name in &file.secrets_env {
            let value = env(name)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("secret variable `{name}` is unset or empty"))?;
            secrets.push(
                secret_for(file.provider, &value)
                    .map_err(|why| format!("secret variable `{name}`: {why}"))?,
            );
        }
        Ok(Self {
            id: file.id.clone(),
            tenant: file.tenant.clone(),
            project: file.project.clone().unwrap_or_else(|| PROJECT_TENANT.to_owned()),
            provider: file.provider,
            secrets,
        })
    }
}

/// The key bytes of a secret as written. Standard Webhooks secrets are `whsec_` + base64 and are
/// decoded, as its SDKs do; every other provider uses the text as written (Stripe's `whsec_…`
/// included, since Stripe's SDKs sign with the whole string).
///
/// # Errors
/// A Standard Webhooks secret that is not base64, or decodes to nothing.
pub fn secret_for(provider: Provider, text: &str) -> Result<Secret, String> {
    if provider == Provider::StandardWebhooks {
        let b64 = text.strip_prefix("whsec_").unwrap_or(text);
        let key = BASE64
            .decode(b64.trim())
            .map_err(|_| "not `whsec_` + base64".to_owned())?;
        if key.is_empty() {
            return Err("decodes to an empty key".into());
        }
        return Ok(Secret::new(key));
    }
    Ok(Secret::new(text.as_bytes()))
}

/// Parses a registry file's text into entries.
///
/// # Errors
/// Bad YAML, an unknown key, a bad entry (see [`Entry::resolve`]) or a repeated id.
pub fn parse(
    path: &Path,
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<Entry>, RegistryError> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let files: Vec<RegistryEntry> = serde_yaml_ng::from_str(text).map_err(|e| RegistryError::Parse {
        path: path.to_owned(),
        why: e.to_string(),
    })?;
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        let entry = |why| RegistryError::Entry {
            entry: (i + 1).to_string(),
            why,
        };
        let e = Entry::resolve(f, env).map_err(entry)?;
        if !seen.insert(e.id.clone()) {
            return Err(entry("the same id appears earlier in the file".into()));
        }
        out.push(e);
    }
    Ok(out)
}

type Map = HashMap<String, Arc<Entry>>;

/// Reads an environment variable.
pub type Env = fn(&str) -> Option<String>;

/// The modification stamp of a file: changed content almost always changes one of these.
type Stamp = (Option<SystemTime>, u64);

struct Watch {
    path: PathBuf,
    /// Where secrets are read: the process environment, or a test's own.
    env: Env,
    /// When the stamp was last looked at, and the stamp of the last (attempted) load.
    state: Mutex<(Instant, Option<Stamp>)>,
}

/// The registry: file entries (reloaded on change) and provisioned entries.
pub struct Registry {
    watch: Option<Watch>,
    from_file: RwLock<Arc<Map>>,
    provisioned: RwLock<Map>,
    /// The most secrets any file entry / provisioned entry has (see [`Registry::secret_slots`]).
    file_slots: AtomicUsize,
    provisioned_slots: AtomicUsize,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("file", &self.watch.as_ref().map(|w| &w.path))
            .field("entries", &self.len())
            .finish_non_exhaustive()
    }
}

impl Registry {
    /// A registry without a file: entries only through [`Registry::upsert`].
    #[must_use]
    pub fn empty() -> Self {
        Self {
            watch: None,
            from_file: RwLock::new(Arc::new(Map::new())),
            provisioned: RwLock::new(Map::new()),
            file_slots: AtomicUsize::new(0),
            provisioned_slots: AtomicUsize::new(0),
        }
    }

    /// Loads `path`, reading secrets from the process environment.
    ///
    /// # Errors
    /// See [`parse`]; the first load is strict, later reloads keep the last good entries.
    pub fn from_file(path: &Path) -> Result<Self, RegistryError> {
        Self::from_file_with(path, env_var)
    }

    /// [`Registry::from_file`] with secrets read through `env`.
    ///
    /// # Errors
    /// See [`parse`].
    pub fn from_file_with(path: &Path, env: Env) -> Result<Self, RegistryError> {
        let stamp = stamp(path);
        let text = std::fs::read_to_string(path).map_err(|source| RegistryError::Read {
            path: path.to_owned(),
            source,
        })?;
        let entries = parse(path, &text, &env)?;
        Ok(Self {
            watch: Some(Watch {
                path: path.to_owned(),
                env,
                state: Mutex::new((Instant::now(), stamp)),
            }),
            file_slots: AtomicUsize::new(most_secrets(entries.iter())),
            from_file: RwLock::new(Arc::new(by_id(entries))),
            provisioned: RwLock::new(Map::new()),
            provisioned_slots: AtomicUsize::new(0),
        })
    }

    /// The entry for `id`: a provisioned one first, then the file's (re-read first if it changed
    /// and the last look is older than [`CHECK_EVERY`]).
    pub fn lookup(&self, id: &str) -> Option<Arc<Entry>> {
        self.refresh_if_due();
        if let Some(e) = read(&self.provisioned).get(id) {
            return Some(e.clone());
        }
        read(&self.from_file).get(id).cloned()
    }

    /// Adds or replaces a provisioned entry.
    ///
    /// # Errors
    /// The id is not `wh_` + 32 lowercase hex digits, or the entry has no secret.
    pub fn upsert(&self, entry: Entry) -> Result<(), RegistryError> {
        let bad = |why: &str| RegistryError::Entry {
            entry: "(provisioned)".into(),
            why: why.into(),
        };
        if !valid_id(&entry.id) {
            return Err(bad("`id` must be `wh_` followed by 32 lowercase hex digits"));
        }
        if entry.secrets.is_empty() || entry.secrets.iter().any(|s| s.0.is_empty()) {
            return Err(bad("an entry needs at least one non-empty secret"));
        }
        if entry.tenant.is_empty() || entry.project.is_empty() {
            return Err(bad("tenant and project must be non-empty"));
        }
        let mut map = self.provisioned.write().unwrap_or_else(PoisonError::into_inner);
        map.insert(entry.id.clone(), Arc::new(entry));
        self.provisioned_slots
            .store(most_secrets(map.values().map(AsRef::as_ref)), Ordering::Relaxed);
        Ok(())
    }

    /// Removes a provisioned entry; file entries change only with the file.
    pub fn remove(&self, id: &str) -> bool {
        let mut map = self.provisioned.write().unwrap_or_else(PoisonError::into_inner);
        let removed = map.remove(id).is_some();
        self.provisioned_slots
            .store(most_secrets(map.values().map(AsRef::as_ref)), Ordering::Relaxed);
        removed
    }

    /// The most secrets any entry has (at least 1): every signature check computes this many
    /// MACs, padding with a dummy key, so that neither an unknown id nor an entry's number of
    /// secrets shows in the time a refusal takes.
    #[must_use]
    pub fn secret_slots(&self) -> usize {
        self.file_slots
            .load(Ordering::Relaxed)
            .max(self.provisioned_slots.load(Ordering::Relaxed))
            .max(1)
    }

    /// Every entry (provisioned ones win over a file entry with the same id), sorted by id.
    #[must_use]
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        self.refresh_if_due();
        let mut all: Map = (**read(&self.from_file)).clone();
        all.extend(
            read(&self.provisioned)
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        let mut v: Vec<_> = all.into_values().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    #[must_use]
    pub fn len(&self) -> usize {
        read(&self.from_file).len() + read(&self.provisioned).len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-reads the file if its stamp changed, now, whatever the last look.
    ///
    /// # Errors
    /// The file cannot be used; the previous entries stay.
    pub fn reload(&self) -> Result<bool, RegistryError> {
        let Some(w) = &self.watch else { return Ok(false) };
        let mut state = w.state.lock().unwrap_or_else(PoisonError::into_inner);
        self.reload_locked(w, &mut state)
    }

    fn refresh_if_due(&self) {
        let Some(w) = &self.watch else { return };
        // One request looks at the file; the others go on with the current entries.
        let Ok(mut state) = w.state.try_lock() else { return };
        if state.0.elapsed() < CHECK_EVERY {
            return;
        }
        if let Err(e) = self.reload_locked(w, &mut state) {
            tracing::warn!(error = %crate::webhook::chain(&e), "webhook registry not reloaded; the previous entries stay");
        }
    }

    fn reload_locked(&self, w: &Watch, state: &mut (Instant, Option<Stamp>)) -> Result<bool, RegistryError> {
        state.0 = Instant::now();
        let now = stamp(&w.path);
        if now == state.1 {
            return Ok(false);
        }
        // Remember the stamp even when the load fails: the warning is logged once per change,
        // and a half-written file gets a new stamp when the writer finishes.
        state.1 = now;
        let text = std::fs::read_to_string(&w.path).map_err(|source| RegistryError::Read {
            path: w.path.clone(),
            source,
        })?;
        let entries = parse(&w.path, &text, &w.env)?;
        let n = entries.len();
        let slots = most_secrets(entries.iter());
        *self.from_file.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(by_id(entries));
        self.file_slots.store(slots, Ordering::Relaxed);
        tracing::info!(entries = n, "webhook registry reloaded");
        Ok(true)
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn stamp(path: &Path) -> Option<Stamp> {
    std::fs::metadata(path).ok().map(|m| (m.modified().ok(), m.len()))
}

fn most_secrets<'a>(entries: impl Iterator<Item = &'a Entry>) -> usize {
    entries.map(|e| e.secrets.len()).max().unwrap_or(0)
}

fn by_id(entries: Vec<Entry>) -> Map {
    entries.into_iter().map(|e| (e.id.clone(), Arc::new(e))).collect()
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "wh_0123456789abcdef0123456789abcdef";

    fn env(name: &str) -> Option<String> {
        match name {
            "S1" => Some("secret-one".into()),
            "SW" => Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    fn one(yaml: &str) -> Result<Vec<Entry>, RegistryError> {
        parse(Path::new("r.yaml"), yaml, &env)
    }

    #[test]
    fn ids_are_wh_and_128_bits_of_lowercase_hex() {
        assert!(valid_id(ID));
        assert!(valid_id(&new_id()));
        for bad in [
            "wh_0123456789ABCDEF0123456789abcdef",
            "wh_0123456789abcdef0123456789abcde",
            "wh_0123456789abcdef0123456789abcdef0",
            "xx_0123456789abcdef0123456789abcdef",
            "wh_0123456789abcdef0123456789abcdeg",
            "",
        ] {
            assert!(!valid_id(bad), "{bad}");
        }
    }

    #[test]
    fn entries_resolve_secrets_and_default_the_project() {
        let e = one(&format!(
            "- {{id: {ID}, tenant: acme, provider: github, secrets_env: [S1]}}"
        ))
        .unwrap();
        assert_eq!(e[0].project, PROJECT_TENANT);
        assert_eq!(e[0].secrets, vec![Secret::new("secret-one")]);
        let e = one(&format!(
            "- {{id: {ID}, tenant: acme, project: p, provider: standard_webhooks, secrets_env: [SW]}}"
        ))
        .unwrap();
        assert_eq!(e[0].secrets[0].0.len(), 24, "whsec_ secrets are base64-decoded");
        assert!(one("").unwrap().is_empty());
    }

    #[test]
    fn bad_entries_are_refused_without_naming_the_id_or_the_secret() {
        let cases = [
            "- {id: wh_x, tenant: a, provider: github, secrets_env: [S1]}".to_owned(),
            format!("- {{id: {ID}, tenant: a, provider: github, secrets_env: [NOPE]}}"),
            format!("- {{id: {ID}, tenant: a, provider: github, secrets_env: [EMPTY]}}"),
            format!("- {{id: {ID}, tenant: a, provider: github, secrets_env: []}}"),
            format!("- {{id: {ID}, tenant: '', provider: github, secrets_env: [S1]}}"),
            format!("- {{id: {ID}, tenant: a, provider: standard_webhooks, secrets_env: [S1]}}"),
            format!(
                "- {{id: {ID}, tenant: a, provider: github, secrets_env: [S1]}}\n- {{id: {ID}, tenant: b, provider: github, secrets_env: [S1]}}"
            ),
            format!("- {{id: {ID}, tenant: a, provider: carrier_pigeon, secrets_env: [S1]}}"),
            format!("- {{id: {ID}, tenant: a, provider: github, secrets_env: [S1], colour: red}}"),
        ];
        for yaml in &cases {
            let e = one(yaml).unwrap_err().to_string();
            assert!(
                !e.contains("0123456789abcdef") && !e.contains("secret-one"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_file_reloads_on_change_and_keeps_the_last_good_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.yaml");
        std::fs::write(&path, "[]").unwrap();
        let reg = Registry::from_file_with(&path, env).unwrap();
        assert!(reg.lookup(ID).is_none());
        std::fs::write(
            &path,
            format!("- {{id: {ID}, tenant: acme, provider: gitlab, secrets_env: [S1]}}\n"),
        )
        .unwrap();
        assert!(reg.reload().unwrap());
        assert_eq!(reg.lookup(ID).unwrap().tenant, "acme");
        std::fs::write(&path, "- nonsense\n- [").unwrap();
        assert!(reg.reload().is_err());
        assert!(reg.lookup(ID).is_some(), "a bad file keeps the previous entries");
        assert!(!reg.reload().unwrap(), "the same bad file is not re-read");
    }

    #[test]
    fn provisioned_entries_sit_beside_the_file() {
        let reg = Registry::empty();
        let e = Entry {
            id: new_id(),
            tenant: "t".into(),
            project: "p".into(),
            provider: Provider::Shopify,
            secrets: vec![Secret::new("s")],
        };
        assert_eq!(reg.secret_slots(), 1);
        reg.upsert(e.clone()).unwrap();
        assert_eq!(reg.lookup(&e.id).as_deref(), Some(&e));
        let rotating = Entry {
            id: new_id(),
            secrets: vec![Secret::new("a"), Secret::new("b"), Secret::new("c")],
            ..e.clone()
        };
        reg.upsert(rotating.clone()).unwrap();
        assert_eq!(reg.secret_slots(), 3);
        assert!(reg.remove(&rotating.id));
        assert_eq!(reg.secret_slots(), 1);
        assert_eq!(reg.entries().len(), 1);
        assert!(
            reg.upsert(Entry {
                id: "wh_1".into(),
                ..e.clone()
            })
            .is_err()
        );
        assert!(
            reg.upsert(Entry {
                secrets: vec![],
                ..e.clone()
            })
            .is_err()
        );
        assert!(reg.remove(&e.id));
        assert!(reg.is_empty());
    }
}
