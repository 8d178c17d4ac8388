//! The configuration file as written (`idemgate.example.yaml`), deserialized strictly: unknown
//! keys are errors.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// A duration written as `250ms`, `30s`, `10m`, `24h`, `7d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map(Dur).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration `{s}`: {e} (examples: 250ms, 30s, 10m, 24h, 7d)"
            ))
        })
    }
}

/// A size written as `512KiB`, `1MiB`, or a plain byte count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Size(n)),
            Raw::S(s) => s
                .parse::<bytesize::ByteSize>()
                .map(|b| Size(b.as_u64()))
                .map_err(|e| {
                    serde::de::Error::custom(format!("invalid size `{s}`: {e} (examples: 512KiB, 1MiB)"))
                }),
        }
    }
}

/// One value or a list (`method: POST` or `method: [POST, PATCH]`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    #[must_use]
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s.clone()],
            Self::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: ServerFile,
    #[serde(default)]
    pub store: StoreFile,
    #[serde(default)]
    pub upstreams: BTreeMap<String, UpstreamFile>,
    pub identity: Option<super::identity::IdentityFile>,
    #[serde(default)]
    pub idempotency: Settings,
    pub webhooks: Option<super::webhooks::WebhooksFile>,
    #[serde(default)]
    pub routes: Vec<RouteFile>,
    #[serde(default)]
    pub metrics: MetricsFile,
}

/// A route's `status:` probe (SPEC 8).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusFile {
    /// JSON pointer into the stored response body, e.g. `/id`.
    pub resource_id: String,
    /// `http://` URL with `{resource_id}`, answering `{"status": "processing|completed|failed"}`.
    pub probe: String,
}

/// `metrics:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsFile {
    /// Label counters with tenant and project (default true); false bounds cardinality.
    pub tenant_labels: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerFile {
    pub listen: Option<String>,
    /// The admin listener (healthz, readyz, metrics, admin API); off when unset.
    pub admin_listen: Option<String>,
    /// The environment variable holding the bearer token for `/admin/*`.
    pub admin_token_env: Option<String>,
    pub max_request_body: Option<Size>,
    /// What webhook providers sign (Twilio signs the public URL).
    pub public_base_url: Option<String>,
    /// How long a graceful shutdown waits for in-flight requests (default 30s).
    pub shutdown_timeout: Option<Dur>,
    /// How long a client may take to send a request head (slowloris defence; default 10s).
    pub header_read_timeout: Option<Dur>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    Memory,
    #[default]
    Embedded,
    Redis,
    Postgres,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreFile {
    #[serde(default)]
    pub kind: StoreKind,
    /// `embedded`: the directory of the redb file.
    pub path: Option<PathBuf>,
    /// `redis` and `postgres`: where the server is.
    pub url: Option<String>,
    /// `memory`: the byte budget.
    pub max_bytes: Option<Size>,
    /// Bound on every store call (default 2s); past it the route's `on_store_error` applies.
    pub timeout: Option<Dur>,
    /// `redis`: prefix of every key and of the notification channel (default `idemgate`).
    pub prefix: Option<String>,
    /// `postgres`: connections in the pool (default 16).
    pub pool_size: Option<usize>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamKind {
    #[default]
    Http,
    Restate,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamFile {
    #[serde(default)]
    pub kind: UpstreamKind,
    pub url: String,
    pub timeout: Option<Dur>,
    /// `restate` only: the Restate admin API, to apply each route's retention at start.
    pub admin_url: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    Required,
    Accepted,
    Prohibited,
    Webhook,
    HandlerInternal,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConcurrentFile {
    Wait,
    Reject,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseExpiryFile {
    Retry,
    Fail,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    FailClosed,
    FailOpen,
}

/// Declares a struct with the given fields plus every per-route idempotency setting, so the
/// `idempotency:` defaults and each route accept exactly the same keys (serde's `flatten` cannot
/// be combined with `deny_unknown_fields`).
macro_rules! with_settings {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty,)* }) => {
        $(#[$m])*
        pub struct $name {
            $($(#[$fm])* pub $f: $t,)*
            pub header: Option<String>,
            pub retention: Option<Dur>,
            pub lease: Option<Dur>,
            pub concurrent: Option<ConcurrentFile>,
            pub wait_timeout: Option<Dur>,
            pub max_key_length: Option<usize>,
            pub reserved_prefixes: Option<Vec<String>>,
            pub key_pattern: Option<String>,
            pub replayed_header: Option<String>,
            pub max_response_bytes: Option<Size>,
            pub store_server_errors: Option<bool>,
            pub on_lease_expiry: Option<LeaseExpiryFile>,
            pub on_store_error: Option<OnStoreError>,
        }

        impl $name {
            /// The settings part of this struct.
            #[must_use]
            pub fn settings(&self) -> Settings {
                Settings {
                    header: self.header.clone(),
                    retention: self.retention,
                    lease: self.lease,
                    concurrent: self.concurrent,
                    wait_timeout: self.wait_timeout,
                    max_key_length: self.max_key_length,
                    reserved_prefixes: self.reserved_prefixes.clone(),
                    key_pattern: self.key_pattern.clone(),
                    replayed_header: self.replayed_header.clone(),
                    max_response_bytes: self.max_response_bytes,
                    store_server_errors: self.store_server_errors,
                    on_lease_expiry: self.on_lease_expiry,
                    on_store_error: self.on_store_error,
                }
            }
        }
    };
}

with_settings! {
    /// Idempotency settings: the file's defaults, or one route's overrides.
    #[derive(Clone, Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Settings {}
}

impl Settings {
    /// `self` with every unset field taken from `defaults`.
    #[must_use]
    pub fn or(self, defaults: &Settings) -> Settings {
        let d = defaults.clone();
        Settings {
            header: self.header.or(d.header),
            retention: self.retention.or(d.retention),
            lease: self.lease.or(d.lease),
            concurrent: self.concurrent.or(d.concurrent),
            wait_timeout: self.wait_timeout.or(d.wait_timeout),
            max_key_length: self.max_key_length.or(d.max_key_length),
            reserved_prefixes: self.reserved_prefixes.or(d.reserved_prefixes),
            key_pattern: self.key_pattern.or(d.key_pattern),
            replayed_header: self.replayed_header.or(d.replayed_header),
            max_response_bytes: self.max_response_bytes.or(d.max_response_bytes),
            store_server_errors: self.store_server_errors.or(d.store_server_errors),
            on_lease_expiry: self.on_lease_expiry.or(d.on_lease_expiry),
            on_store_error: self.on_store_error.or(d.on_store_error),
        }
    }
}

with_settings! {
    /// One entry of `routes:`.
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct RouteFile {
        pub id: String,
        pub method: OneOrMany,
        pub path: String,
        pub upstream: String,
        pub policy: PolicyKind,
        pub scope: Option<idemgate_core::namespace::Scope>,
        pub project: Option<String>,
        #[serde(default)]
        pub recovery: bool,
        pub status: Option<StatusFile>,
        /// Routes to a `restate` upstream: `{Service}/{handler}`.
        pub target: Option<String>,
        pub provider: Option<super::webhooks::Provider>,
        pub generic: Option<super::webhooks::GenericFile>,
    }
}
