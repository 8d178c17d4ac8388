//! One route of the file resolved: methods, path, upstream, policy and the idempotency
//! settings it inherits or overrides.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::{Method, Uri};
use idemgate_core::engine::{Concurrency, LeaseExpiry, Policy};
use idemgate_core::key::KeyRules;
use idemgate_core::namespace::Scope;

use super::file::{ConcurrentFile, LeaseExpiryFile, OneOrMany, RouteFile, Settings};
use super::{OnStoreError, PolicyKind, Route, Upstream, webhooks};
use crate::routes::{Methods, PathTemplate};

type RouteError = (&'static str, String);

pub(super) fn resolve_route(
    rf: &RouteFile,
    defaults: &Settings,
    upstreams: &HashMap<String, Arc<Upstream>>,
    has_identity: bool,
) -> Result<Route, RouteError> {
    let methods = parse_methods(&rf.method).map_err(|why| ("method", why))?;
    let path = PathTemplate::parse(&rf.path).map_err(|e| ("path", e.to_string()))?;
    let upstream = upstreams.get(&rf.upstream).cloned().ok_or_else(|| {
        (
            "upstream",
            format!("`{}` is not defined under `upstreams`", rf.upstream),
        )
    })?;
    if let Some(st) = &rf.status {
        if !st.resource_id.starts_with('/') {
            return Err((
                "status.resource_id",
                "must be a JSON pointer such as `/id`".into(),
            ));
        }
        let ok = st.probe.contains("{resource_id}")
            && st
                .probe
                .replace("{resource_id}", "x")
                .parse::<Uri>()
                .is_ok_and(|u| u.scheme_str() == Some("http"));
        if !ok {
            return Err((
                "status.probe",
                "must be an http:// URL containing `{resource_id}`".into(),
            ));
        }
    }
    if rf.policy == PolicyKind::Webhook {
        if !rf.path.contains("{webhook_id}") {
            return Err((
                "path",
                "a `webhook` route's path needs a `{webhook_id}` segment".into(),
            ));
        }
        match (rf.provider, &rf.generic) {
            (None, _) => return Err(("provider", "a `webhook` route needs a provider".into())),
            (Some(webhooks::Provider::Generic), None) => {
                return Err(("generic", "provider `generic` needs a `generic:` block".into()));
            }
            (Some(p), Some(_)) if p != webhooks::Provider::Generic => {
                return Err((
                    "generic",
                    "only provider `generic` takes a `generic:` block".into(),
                ));
            }
            _ => {}
        }
    } else if rf.provider.is_some() || rf.generic.is_some() {
        return Err(("provider", "only `policy: webhook` routes take a provider".into()));
    }
    let target = crate::restate::check_route(rf, &upstream)?;
    if let Some(p) = &rf.project
        && p != idemgate_core::namespace::PROJECT_TENANT
        && p != idemgate_core::namespace::PROJECT_PLATFORM
    {
        return Err(("project", format!("`{p}` must be `_tenant` or `_platform`")));
    }
    // SPEC 4.1: `subject` once identity is configured; without identity there is no principal,
    // so `global`.
    // Webhook principals come from the registry, so their routes are subject-scoped too.
    let scope = rf
        .scope
        .unwrap_or(if has_identity || rf.policy == PolicyKind::Webhook {
            Scope::Subject
        } else {
            Scope::Global
        });
    let s = rf.settings().or(defaults);
    let header = header_name(s.header.as_deref().unwrap_or("Idempotency-Key")).map_err(|w| ("header", w))?;
    let replayed_header = header_name(s.replayed_header.as_deref().unwrap_or("Idempotent-Replayed"))
        .map_err(|w| ("replayed_header", w))?;
    let keys = KeyRules::new(
        s.max_key_length
            .unwrap_or(idemgate_core::key::DEFAULT_MAX_KEY_LEN),
        s.key_pattern.as_deref(),
        s.reserved_prefixes
            .clone()
            .unwrap_or_else(|| vec![idemgate_core::key::DEFAULT_RESERVED_PREFIX.to_owned()]),
    )
    .map_err(|e| ("key_pattern", e.to_string()))?;
    let base = Policy::default();
    // Providers redeliver for days: webhook routes keep records 7d unless told otherwise.
    let default_retention = if rf.policy == PolicyKind::Webhook {
        Duration::from_secs(7 * 86_400)
    } else {
        base.retention
    };
    let engine = Policy {
        retention: s.retention.map_or(default_retention, |d| d.0),
        lease: s.lease.map_or(base.lease, |d| d.0),
        concurrent: match s.concurrent {
            Some(ConcurrentFile::Reject) => Concurrency::Reject,
            Some(ConcurrentFile::Wait) | None => Concurrency::Wait,
        },
        wait_timeout: s.wait_timeout.map_or(base.wait_timeout, |d| d.0),
        on_lease_expiry: match s.on_lease_expiry {
            Some(LeaseExpiryFile::Fail) => LeaseExpiry::Fail,
            Some(LeaseExpiryFile::Retry) | None => LeaseExpiry::Retry,
        },
        store_server_errors: s.store_server_errors.unwrap_or(false),
        max_response_bytes: s.max_response_bytes.map_or(base.max_response_bytes, |b| {
            usize::try_from(b.0).unwrap_or(usize::MAX)
        }),
    };
    if engine.lease < Duration::from_millis(100) {
        return Err(("lease", "must be at least 100ms".into()));
    }
    let on_store_error = s.on_store_error.unwrap_or(match rf.policy {
        PolicyKind::Accepted => OnStoreError::FailOpen,
        _ => OnStoreError::FailClosed,
    });
    Ok(Route {
        id: rf.id.as_str().into(),
        methods,
        path,
        upstream,
        policy: rf.policy,
        scope,
        header,
        replayed_header,
        keys,
        engine,
        on_store_error,
        project: rf.project.clone(),
        recovery: rf.recovery,
        provider: rf.provider,
        generic: rf.generic.clone(),
        status: rf.status.clone(),
        target,
    })
}

fn parse_methods(m: &OneOrMany) -> Result<Methods, String> {
    let names = m.to_vec();
    if names.is_empty() {
        return Err("at least one method is needed".into());
    }
    names
        .iter()
        .map(|n| {
            let upper = n.to_ascii_uppercase();
            Method::from_bytes(upper.as_bytes()).map_err(|_| format!("`{n}` is not an HTTP method"))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Methods)
}

fn header_name(name: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("`{name}` is not a header name"))
}
