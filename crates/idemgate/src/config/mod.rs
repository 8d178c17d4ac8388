//! Configuration: the YAML file ([`file`](mod@file)) resolved into the gateway's runtime
//! [`Config`], with every default applied and every cross-reference checked. Errors name the key
//! and its line.

pub mod file;
pub mod identity;
mod route;
pub mod webhooks;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use http::header::HeaderName;
use idemgate_core::engine::Policy;
use idemgate_core::key::KeyRules;
use idemgate_core::namespace::Scope;

use file::FileConfig;
pub use file::{OnStoreError, PolicyKind, StoreKind, UpstreamKind};

use crate::routes::{Methods, PathTemplate, Table};
use route::resolve_route;

/// A configuration that cannot be used, with the place it came from.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The resolved configuration.
#[derive(Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub max_request_body: usize,
    pub shutdown_timeout: Duration,
    pub header_read_timeout: Duration,
    pub store: StoreConfig,
    pub routes: Table<Arc<Route>>,
    /// `None` when no identity method is configured: every caller is anonymous.
    pub identity: Option<Arc<crate::identity::Identity>>,
    pub metrics: MetricsConfig,
    /// The admin listener, when `server.admin_listen` is set.
    pub admin: Option<AdminConfig>,
    /// The webhook registry and verifiers, when a `webhooks:` section exists.
    pub webhooks: Option<Arc<crate::webhook::Webhooks>>,
}

#[derive(Clone, Copy, Debug)]
pub struct MetricsConfig {
    pub tenant_labels: bool,
}

/// `server.admin_listen` and the token read from `server.admin_token_env`.
#[derive(Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// `None` when no token variable is configured: `/admin/*` then refuses every request.
    pub token: Option<String>,
}

impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
pub struct StoreConfig {
    pub kind: StoreKind,
    pub path: PathBuf,
    pub max_bytes: usize,
    /// `redis` and `postgres` only.
    pub url: Option<String>,
    /// Bound on every store call.
    pub timeout: Duration,
    /// `redis` key prefix.
    pub prefix: String,
    /// `postgres` pool size.
    pub pool_size: usize,
}

// By hand: the url may carry a password, which must not reach a log line.
impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreConfig")
            .field("kind", &self.kind)
            .field("path", &self.path)
            .field("max_bytes", &self.max_bytes)
            .field("url", &self.url.as_ref().map(|_| "<set>"))
            .field("timeout", &self.timeout)
            .field("prefix", &self.prefix)
            .field("pool_size", &self.pool_size)
            .finish()
    }
}

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    /// Scheme and authority, plus an optional path prefix (no trailing `/`).
    pub base: Uri,
    pub timeout: Duration,
    /// `http` (idemgate keeps the records) or `restate` (Restate deduplicates; SPEC 9).
    pub kind: UpstreamKind,
    /// `restate` only: the admin API where route retentions are applied at start.
    pub admin_url: Option<Uri>,
}

/// One resolved route: where it goes and the idempotency rules that apply to it.
#[derive(Debug)]
pub struct Route {
    /// Shared with the metrics' table and each request's access line, so naming a request's
    /// route costs a reference count, not a copy.
    pub id: Arc<str>,
    pub methods: Methods,
    pub path: PathTemplate,
    pub upstream: Arc<Upstream>,
    pub policy: PolicyKind,
    pub scope: Scope,
    pub header: HeaderName,
    pub replayed_header: HeaderName,
    pub keys: KeyRules,
    pub engine: Policy,
    pub on_store_error: OnStoreError,
    /// `_tenant` or `_platform`: the project component of the namespace, whatever the caller's.
    pub project: Option<String>,
    /// Serves `GET {path}/by-idempotency-key/{key}` and `.../output` (SPEC 5).
    pub recovery: bool,
    /// `policy: webhook` routes: the provider, and a generic provider's settings.
    pub provider: Option<webhooks::Provider>,
    pub generic: Option<webhooks::GenericFile>,
    /// The asynchronous status probe (SPEC 8).
    pub status: Option<file::StatusFile>,
    /// Routes to a `restate` upstream: the Restate service and handler (SPEC 9).
    pub target: Option<crate::restate::Target>,
}

const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
const DEFAULT_MAX_REQUEST_BODY: u64 = 10 * 1024 * 1024;
const DEFAULT_MEMORY_BYTES: u64 = 512 * 1024 * 1024;
/// A store call that takes longer is a store error (`on_store_error`).
const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);

impl Config {
    /// Parses and resolves a YAML document.
    ///
    /// # Errors
    /// Syntax, unknown or unsupported keys, bad values, dangling references.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_in(text, std::path::Path::new("."))
    }

    /// Like [`Config::from_yaml`], with files the config names (API keys, JWKS) read relative
    /// to `base`.
    ///
    /// # Errors
    /// As [`Config::from_yaml`].
    pub fn from_yaml_in(text: &str, base: &std::path::Path) -> Result<Self, ConfigError> {
        let file: FileConfig =
            serde_yaml_ng::from_str(text).map_err(|e| ConfigError(describe_yaml_error(&e, text)))?;
        resolve(file, text, base)
    }

    /// Reads and resolves a file.
    ///
    /// # Errors
    /// The file cannot be read, or [`Config::from_yaml`] refuses it.
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
        let base = path.parent().unwrap_or(std::path::Path::new("."));
        Self::from_yaml_in(&text, base).map_err(|e| ConfigError(format!("{}: {}", path.display(), e.0)))
    }

    /// The `serve --upstream URL` configuration: one catch-all `accepted` route for POST and
    /// PATCH, `scope: global`, embedded store in `./idemgate-data`.
    ///
    /// # Errors
    /// The URL is not an absolute `http://` URL.
    pub fn for_upstream(url: &str, listen: Option<SocketAddr>) -> Result<Self, ConfigError> {
        let yaml = format!(
            "upstreams:\n  app:\n    url: {}\nroutes:\n  - id: default\n    method: [POST, PATCH]\n    path: /**\n    upstream: app\n    policy: accepted\n    scope: global\n",
            serde_json::to_string(url).unwrap_or_default()
        );
        let mut config = Self::from_yaml(&yaml)?;
        if let Some(listen) = listen {
            config.listen = listen;
        }
        Ok(config)
    }
}

/// serde_yaml_ng reports "at line L column C"; keep its message and put the line first. For
/// refusals raised inside a value (not-yet-supported keys) it reports the enclosing mapping, so
/// those are located by their key instead.
fn describe_yaml_error(e: &serde_yaml_ng::Error, text: &str) -> String {
    let msg = strip_location(&e.to_string()).to_owned();
    let by_key = msg
        .strip_prefix('`')
        .and_then(|m| m.split_once("`: "))
        .filter(|_| msg.ends_with("is not supported yet"))
        .and_then(|(key, _)| key_line(text, key));
    match (by_key, e.location()) {
        (Some(line), _) => format!("line {line}: {msg}"),
        (None, Some(loc)) => format!("line {}: {msg}", loc.line()),
        (None, None) => msg,
    }
}

/// The 1-based line where `key:` first appears as a mapping key.
fn key_line(text: &str, key: &str) -> Option<usize> {
    text.lines()
        .position(|l| {
            let l = l.trim_start().trim_start_matches("- ").trim_start();
            l.strip_prefix(key).is_some_and(|rest| rest.starts_with(':'))
        })
        .map(|i| i + 1)
}

fn strip_location(msg: &str) -> &str {
    msg.find(" at line ").map_or(msg, |i| &msg[..i])
}

/// The 1-based line of the route with `id`, for error messages on resolved values.
fn route_line(text: &str, id: &str) -> String {
    text.lines()
        .position(|l| {
            let l = l.trim_start().trim_start_matches("- ").trim_start();
            l.strip_prefix("id:")
                .is_some_and(|v| v.trim().trim_matches(['"', '\'']) == id)
        })
        .map_or_else(String::new, |i| format!("line {}: ", i + 1))
}

fn resolve(file: FileConfig, text: &str, base: &std::path::Path) -> Result<Config, ConfigError> {
    let identity = match &file.identity {
        Some(f) if !f.methods.is_empty() => Some(Arc::new(
            crate::identity::Identity::from_file(f, base).map_err(|e| {
                ConfigError(format!(
                    "{}{e}",
                    key_line(text, "identity").map_or_else(String::new, |l| format!("line {l}: "))
                ))
            })?,
        )),
        _ => None,
    };
    let webhooks = match &file.webhooks {
        Some(w) => Some(Arc::new(
            crate::webhook::Webhooks::new(w, file.server.public_base_url.clone(), base).map_err(|e| {
                ConfigError(format!(
                    "{}{e}",
                    key_line(text, "webhooks").map_or_else(String::new, |l| format!("line {l}: "))
                ))
            })?,
        )),
        None => None,
    };
    let listen = file.server.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
    let listen: SocketAddr = listen
        .parse()
        .map_err(|e| ConfigError(format!("server.listen: `{listen}` is not an address: {e}")))?;
    let store = resolve_store(&file.store)?;
    let mut upstreams = HashMap::new();
    for (name, up) in &file.upstreams {
        let base = parse_base(&up.url).map_err(|why| ConfigError(format!("upstreams.{name}.url: {why}")))?;
        let admin_url = match (&up.admin_url, up.kind) {
            (None, _) => None,
            (Some(url), UpstreamKind::Restate) => Some(
                parse_base(url).map_err(|why| ConfigError(format!("upstreams.{name}.admin_url: {why}")))?,
            ),
            (Some(_), UpstreamKind::Http) => {
                return Err(ConfigError(format!(
                    "upstreams.{name}.admin_url: only `kind: restate` upstreams take an admin_url"
                )));
            }
        };
        upstreams.insert(
            name.clone(),
            Arc::new(Upstream {
                name: name.clone(),
                base,
                timeout: up.timeout.map_or(DEFAULT_UPSTREAM_TIMEOUT, |d| d.0),
                kind: up.kind,
                admin_url,
            }),
        );
    }
    let mut seen = std::collections::HashSet::new();
    let mut entries = Vec::new();
    for (i, rf) in file.routes.iter().enumerate() {
        let at = route_line(text, &rf.id);
        let err = |key: &str, why: String| ConfigError(format!("{at}routes[{i}] ({}).{key}: {why}", rf.id));
        if !seen.insert(rf.id.clone()) {
            return Err(err("id", "duplicate route id".into()));
        }
        let route = resolve_route(rf, &file.idempotency, &upstreams, identity.is_some())
            .map_err(|(k, why)| err(k, why))?;
        if route.policy == PolicyKind::Webhook && webhooks.is_none() {
            return Err(err(
                "policy",
                "`webhook` routes need a `webhooks:` section".into(),
            ));
        }
        entries.push((route.methods.clone(), route.path.clone(), Arc::new(route)));
    }
    if entries.is_empty() {
        return Err(ConfigError("routes: at least one route is needed".into()));
    }
    Ok(Config {
        listen,
        max_request_body: usize::try_from(
            file.server
                .max_request_body
                .map_or(DEFAULT_MAX_REQUEST_BODY, |s| s.0),
        )
        .unwrap_or(usize::MAX),
        header_read_timeout: file
            .server
            .header_read_timeout
            .map_or(Duration::from_secs(10), |d| d.0),
        shutdown_timeout: file
            .server
            .shutdown_timeout
            .map_or(Duration::from_secs(30), |d| d.0),
        store,
        routes: Table::new(entries),
        identity,
        webhooks,
        metrics: MetricsConfig {
            tenant_labels: file.metrics.tenant_labels.unwrap_or(true),
        },
        admin: resolve_admin(&file.server)?,
    })
}

fn resolve_store(s: &file::StoreFile) -> Result<StoreConfig, ConfigError> {
    let kind_name = match s.kind {
        StoreKind::Memory => "memory",
        StoreKind::Embedded => "embedded",
        StoreKind::Redis => "redis",
        StoreKind::Postgres => "postgres",
    };
    let only = |key: &str, set: bool, kinds: &[StoreKind], which: &str| {
        if set && !kinds.contains(&s.kind) {
            return Err(ConfigError(format!(
                "store.{key}: only the {which} store takes it (this one is `{kind_name}`)"
            )));
        }
        Ok(())
    };
    only(
        "url",
        s.url.is_some(),
        &[StoreKind::Redis, StoreKind::Postgres],
        "redis and postgres",
    )?;
    only("prefix", s.prefix.is_some(), &[StoreKind::Redis], "redis")?;
    only(
        "pool_size",
        s.pool_size.is_some(),
        &[StoreKind::Postgres],
        "postgres",
    )?;
    let url = match (s.kind, &s.url) {
        (StoreKind::Redis, Some(url)) => {
            idemgate_stores::redis::check_url(url).map_err(|e| {
                ConfigError(format!("store.url: not a usable redis URL: {}", error_chain(&e)))
            })?;
            Some(url.clone())
        }
        (StoreKind::Postgres, Some(url)) => {
            idemgate_stores::postgres::check_url(url)
                .map_err(|e| ConfigError(format!("store.url: not a postgres URL: {}", error_chain(&e))))?;
            Some(url.clone())
        }
        (StoreKind::Redis | StoreKind::Postgres, None) => {
            return Err(ConfigError(format!(
                "store.url: the {kind_name} store needs a url"
            )));
        }
        _ => None,
    };
    let timeout = s.timeout.map_or(DEFAULT_STORE_TIMEOUT, |d| d.0);
    if timeout < Duration::from_millis(10) {
        return Err(ConfigError("store.timeout: must be at least 10ms".into()));
    }
    let prefix = s.prefix.clone().unwrap_or_else(|| "idemgate".into());
    if prefix.is_empty() || prefix.contains(['{', '}']) {
        return Err(ConfigError(
            "store.prefix: must be non-empty, without braces".into(),
        ));
    }
    if s.pool_size == Some(0) {
        return Err(ConfigError("store.pool_size: must be at least 1".into()));
    }
    Ok(StoreConfig {
        kind: s.kind,
        path: s.path.clone().unwrap_or_else(|| PathBuf::from("./idemgate-data")),
        max_bytes: usize::try_from(s.max_bytes.map_or(DEFAULT_MEMORY_BYTES, |b| b.0)).unwrap_or(usize::MAX),
        url,
        timeout,
        prefix,
        pool_size: s.pool_size.unwrap_or(16),
    })
}

/// An error and its sources, for a one-line message.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn resolve_admin(server: &file::ServerFile) -> Result<Option<AdminConfig>, ConfigError> {
    let Some(listen) = &server.admin_listen else {
        if server.admin_token_env.is_some() {
            return Err(ConfigError(
                "server.admin_token_env: needs server.admin_listen".into(),
            ));
        }
        return Ok(None);
    };
    let listen = listen
        .parse()
        .map_err(|e| ConfigError(format!("server.admin_listen: `{listen}` is not an address: {e}")))?;
    let token = match &server.admin_token_env {
        Some(var) => Some(std::env::var(var).ok().filter(|t| !t.is_empty()).ok_or_else(|| {
            ConfigError(format!(
                "server.admin_token_env: environment variable {var} is not set"
            ))
        })?),
        None => None,
    };
    Ok(Some(AdminConfig { listen, token }))
}

fn parse_base(url: &str) -> Result<Uri, String> {
    let uri: Uri = url.parse().map_err(|e| format!("`{url}` is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(format!("`{url}` must be an absolute http:// URL"));
    }
    if uri.query().is_some() {
        return Err(format!("`{url}` must not have a query"));
    }
    Ok(uri)
}

#[cfg(test)]
mod tests;
