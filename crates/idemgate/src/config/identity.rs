//! The `identity:` section as written: its methods, kept in the order the file lists them,
//! because the first method that recognises a request decides (SPEC 7).

use std::fmt;
use std::path::PathBuf;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// `identity:`: the configured methods, in file order.
#[derive(Debug, Default)]
pub struct IdentityFile {
    pub methods: Vec<MethodFile>,
}

#[derive(Debug)]
pub enum MethodFile {
    ApiKeys(ApiKeysFile),
    Jwt(JwtFile),
    TrustedHeaders(TrustedHeadersFile),
}

/// `api_keys:`: a file of `{key_sha256, tenant, project, subject}` entries.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeysFile {
    pub file: PathBuf,
}

/// One entry of the API key file. The plaintext key is never stored, only its SHA-256.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyEntry {
    pub key_sha256: String,
    pub tenant: String,
    pub project: Option<String>,
    pub subject: String,
}

/// `jwt:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtFile {
    pub issuer: Option<String>,
    pub audience: Option<String>,
    pub jwks_file: Option<PathBuf>,
    pub jwks_url: Option<String>,
    pub hs256_secret_env: Option<String>,
    #[serde(default)]
    pub claims: ClaimsFile,
    pub subject_type: Option<String>,
}

/// Which claims carry the principal.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimsFile {
    #[serde(default = "default_tenant_claim")]
    pub tenant: String,
    #[serde(default = "default_project_claim")]
    pub project: String,
    #[serde(default = "default_subject_claim")]
    pub subject: String,
}

impl Default for ClaimsFile {
    fn default() -> Self {
        Self {
            tenant: default_tenant_claim(),
            project: default_project_claim(),
            subject: default_subject_claim(),
        }
    }
}

fn default_tenant_claim() -> String {
    "tenant_id".into()
}
fn default_project_claim() -> String {
    "project_id".into()
}
fn default_subject_claim() -> String {
    "sub".into()
}

/// `trusted_headers:`: identity set by an authenticating proxy in front of idemgate.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustedHeadersFile {
    #[serde(default = "default_tenant_header")]
    pub tenant: String,
    #[serde(default = "default_project_header")]
    pub project: String,
    #[serde(default = "default_subject_header")]
    pub subject: String,
    pub trusted_proxies: Vec<String>,
}

fn default_tenant_header() -> String {
    "X-Tenant-Id".into()
}
fn default_project_header() -> String {
    "X-Project-Id".into()
}
fn default_subject_header() -> String {
    "X-Subject".into()
}

impl<'de> Deserialize<'de> for IdentityFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct InOrder;
        impl<'de> Visitor<'de> for InOrder {
            type Value = IdentityFile;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of identity methods: api_keys, jwt, trusted_headers")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<IdentityFile, A::Error> {
                let mut methods = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    let method = match name.as_str() {
                        "api_keys" => MethodFile::ApiKeys(map.next_value()?),
                        "jwt" => MethodFile::Jwt(map.next_value()?),
                        "trusted_headers" => MethodFile::TrustedHeaders(map.next_value()?),
                        other => {
                            return Err(de::Error::unknown_field(
                                other,
                                &["api_keys", "jwt", "trusted_headers"],
                            ));
                        }
                    };
                    if methods
                        .iter()
                        .any(|m| std::mem::discriminant(m) == std::mem::discriminant(&method))
                    {
                        return Err(de::Error::custom(format!("duplicate identity method `{name}`")));
                    }
                    methods.push(method);
                }
                Ok(IdentityFile { methods })
            }
        }
        d.deserialize_map(InOrder)
    }
}
