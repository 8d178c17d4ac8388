//! Webhooks (case B, SPEC 6): look the endpoint up in the registry, verify the provider's
//! signature, lift the provider's own delivery identifier out of its transport slot, and hand
//! the proxy a principal and a raw key; the lifecycle is then the same as case A.
//!
//! - [`registry`]: ids to tenant, project, provider and secrets; the file, reloaded on change.
//! - [`providers`]: each provider's signature scheme and identifier slot.
//! - [`crypto`]: HMAC and constant-time comparison, the only place signatures are compared.
//!
//! An unknown id (or one registered for another provider than the route's) answers `404
//! unknown-webhook` only after the same signature work as a known id with a bad signature: the
//! route's provider check runs through the same code against a dummy secret, and its result is
//! thrown away. Every check is also padded to the registry's largest number of secrets per entry
//! ([`crypto::Keys`]), so an entry in rotation costs no more than any other. Secrets and
//! signatures are never logged, nor put in a problem body.

pub mod crypto;
pub mod providers;
pub mod registry;

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idemgate_core::namespace::Principal;

use crate::config::Route;
use crate::config::webhooks::WebhooksFile;
use crate::problem::{Kind, Problem};
use crypto::{Keys, Secret};
use providers::Delivery;
use registry::Registry;

/// The subject of every webhook principal.
pub const WEBHOOK_SUBJECT: &str = "service:webhook-ingest";

/// Default for `webhooks.signature_tolerance`.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

/// A webhook setup that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {why}")]
pub struct SetupError {
    /// The configuration key at fault, in full (`webhooks.registry`).
    pub key: &'static str,
    pub why: String,
}

/// A verified delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The registry's tenant and project, subject [`WEBHOOK_SUBJECT`].
    pub principal: Principal,
    /// The raw key: `{webhook_id}/{provider}-{identifier}` (the webhook id is part of it because
    /// GitHub shares one delivery id across every hook of an event).
    pub raw_key: String,
    /// The provider name, for logs and metrics.
    pub provider: &'static str,
}

/// The registry and the verifiers.
#[derive(Debug)]
pub struct Webhooks {
    registry: Registry,
    tolerance: Duration,
    public_base_url: Option<String>,
    /// What an unknown id is checked against, and what pads an entry's secrets up to the
    /// registry's [`Registry::secret_slots`] (random; its results are discarded anyway).
    dummy: Secret,
}

impl Webhooks {
    /// Loads the registry (`file.registry`, relative to `base`, the config file's directory).
    ///
    /// # Errors
    /// The registry cannot be read or has a bad entry (a malformed id, an unset secret variable),
    /// or `public_base_url` is not an absolute http(s) URL.
    pub fn new(
        file: &WebhooksFile,
        public_base_url: Option<String>,
        base: &Path,
    ) -> Result<Self, SetupError> {
        let registry = match &file.registry {
            Some(path) => Registry::from_file(&base.join(path)).map_err(|e| SetupError {
                key: "webhooks.registry",
                why: chain(&e),
            })?,
            None => Registry::empty(),
        };
        if let Some(url) = &public_base_url {
            check_base_url(url).map_err(|why| SetupError {
                key: "server.public_base_url",
                why,
            })?;
        }
        let tolerance = file.signature_tolerance.map_or(DEFAULT_TOLERANCE, |d| d.0);
        if tolerance.is_zero() {
            return Err(SetupError {
                key: "webhooks.signature_tolerance",
                why: "must be more than 0s".into(),
            });
        }
        let dummy = idemgate_core::LeaseToken::random().0.to_le_bytes();
        Ok(Self {
            registry,
            tolerance,
            public_base_url: public_base_url.map(|u| u.trim_end_matches('/').to_owned()),
            dummy: Secret::new(dummy.repeat(2)),
        })
    }

    /// The registry, for provisioning (admin API) and listing.
    #[must_use]
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Admits one delivery to `route` for `webhook_id` (the path's `{webhook_id}`).
    ///
    /// # Errors
    /// `unknown-webhook` (404), `invalid-signature` (401) or `translation-failed` (400).
    pub fn admit(
        &self,
        route: &Route,
        webhook_id: &str,
        parts: &http::request::Parts,
        body: &[u8],
    ) -> Result<Admitted, Problem> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.check(
            route,
            webhook_id,
            parts,
            body,
            i64::try_from(now).unwrap_or(i64::MAX),
        )
        .0
    }

    /// [`Webhooks::admit`] at a given time, also answering the signature work done (MACs
    /// computed), which the timing tests compare between the unknown-id and bad-signature paths.
    fn check(
        &self,
        route: &Route,
        webhook_id: &str,
        parts: &http::request::Parts,
        body: &[u8],
        now: i64,
    ) -> (Result<Admitted, Problem>, usize) {
        let unknown = || Problem::new(Kind::UnknownWebhook, "no such webhook");
        let Some(provider) = route.provider else {
            return (Err(unknown()), 0);
        };
        // An entry of another provider is as unknown as no entry: the id is not this route's.
        let entry = self
            .registry
            .lookup(webhook_id)
            .filter(|e| e.provider == provider);
        let secrets = entry.as_ref().map_or(&[][..], |e| &e.secrets[..]);
        let keys = Keys::padded(secrets, self.registry.secret_slots(), &self.dummy);
        let delivery = Delivery {
            headers: &parts.headers,
            uri: &parts.uri,
            body,
            public_base_url: self.public_base_url.as_deref(),
            now,
            tolerance: self.tolerance.as_secs(),
        };
        let verified = providers::verify(provider, route.generic.as_ref(), &keys, &delivery);
        let work = keys.work();
        let Some(entry) = entry else {
            return (Err(unknown()), work);
        };
        if let Err(reason) = verified {
            tracing::debug!(provider = provider.as_str(), tenant = %entry.tenant, endpoint = %route.id, reason, "webhook signature refused");
            return (
                Err(Problem::new(
                    Kind::InvalidSignature,
                    format!("the {} signature does not verify: {reason}", provider.as_str()),
                )),
                work,
            );
        }
        let identifier = match providers::identifier(provider, route.generic.as_ref(), &delivery) {
            Ok(id) => id,
            Err(reason) => {
                // Counted by the metrics module as `transport_translation_failed_total{provider}`
                // from the access log (the proxy sets the provider as the log's source).
                tracing::warn!(provider = provider.as_str(), tenant = %entry.tenant, endpoint = %route.id, reason, "webhook translation failed");
                return (
                    Err(Problem::new(
                        Kind::TranslationFailed,
                        format!("no {} delivery identifier: {reason}", provider.as_str()),
                    )),
                    work,
                );
            }
        };
        let admitted = Admitted {
            principal: Principal::new(entry.tenant.clone(), entry.project.clone(), WEBHOOK_SUBJECT),
            raw_key: format!("{webhook_id}/{}-{identifier}", provider.as_str()),
            provider: provider.as_str(),
        };
        (Ok(admitted), work)
    }
}

fn check_base_url(url: &str) -> Result<(), String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("`{url}` is not a URL: {e}"))?;
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    if !scheme_ok || uri.authority().is_none() || uri.query().is_some() {
        return Err(format!("`{url}` must be an absolute http(s) URL without a query"));
    }
    Ok(())
}

/// An error and its sources, on one line.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests;
