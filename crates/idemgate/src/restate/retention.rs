//! Applying route retentions to Restate services (SPEC 9, `upstreams.<name>.admin_url`).
//!
//! Restate keeps an idempotent invocation's outcome for its *service's* idempotency retention,
//! which the admin API changes at runtime: `PATCH /services/{service}` with
//! `{"idempotency_retention": "..."}`. At start idemgate writes each route's `retention` there,
//! so the file is the one place retention is declared. Several routes to one service get the
//! longest of their retentions (Restate has no per-handler setting through this API), with a
//! warning.
//!
//! The gateway does not wait for this: it starts serving at once, and the writes are retried
//! in the background with a capped backoff (the deployment may be registered after the gateway
//! starts). Each result is logged. Restate resets the setting when the deployment is registered
//! again from the SDK's declaration; restart idemgate (or declare the same retention in the
//! service) after a re-registration.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};

use crate::proxy::Gateway;

/// Attempts per service before giving up (about five minutes with the backoff below).
const ATTEMPTS: u32 = 14;
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Bound on one admin call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// One write: which admin API, which service, which retention.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Want {
    admin: Uri,
    service: String,
    retention: Duration,
    routes: Vec<String>,
}

/// What the Restate routes of the configuration ask for, one entry per (admin API, service).
fn wanted(gateway: &Gateway) -> Vec<Want> {
    let mut by_service: BTreeMap<(String, String), Want> = BTreeMap::new();
    for route in gateway.config().routes.iter() {
        let (Some(admin), Some(target)) = (&route.upstream.admin_url, &route.target) else {
            continue;
        };
        let want = by_service
            .entry((admin.to_string(), target.service.clone()))
            .or_insert_with(|| Want {
                admin: admin.clone(),
                service: target.service.clone(),
                retention: route.engine.retention,
                routes: Vec::new(),
            });
        if want.retention != route.engine.retention {
            tracing::warn!(
                service = %target.service,
                routes = ?want.routes,
                route = %route.id,
                "routes to one Restate service declare different retentions; applying the longest"
            );
            want.retention = want.retention.max(route.engine.retention);
        }
        want.routes.push(route.id.to_string());
    }
    by_service.into_values().collect()
}

/// Writes every Restate route's retention to its service, retrying in the background; resolves
/// when every write succeeded or gave up. Spawn it once at start.
pub async fn apply_retention(gateway: Arc<Gateway>) {
    let writes = wanted(&gateway).into_iter().map(|want| {
        let gateway = gateway.clone();
        async move { apply_one(&gateway, &want).await }
    });
    join_all(writes).await;
}

/// Runs the writes concurrently without a futures dependency.
async fn join_all<F: std::future::Future<Output = ()> + Send + 'static>(writes: impl Iterator<Item = F>) {
    let handles: Vec<_> = writes.map(tokio::spawn).collect();
    for h in handles {
        let _ = h.await;
    }
}

async fn apply_one(gateway: &Gateway, want: &Want) {
    let retention = restate_duration(want.retention);
    let mut backoff = FIRST_BACKOFF;
    for attempt in 1..=ATTEMPTS {
        match patch(gateway, want, &retention).await {
            Ok(reported) => {
                tracing::info!(
                    service = %want.service,
                    routes = ?want.routes,
                    retention = %retention,
                    restate_reports = %reported,
                    "applied the route retention to the Restate service"
                );
                return;
            }
            Err(why) if attempt < ATTEMPTS => {
                tracing::warn!(service = %want.service, attempt, error = %why, "could not apply the retention to the Restate service; retrying");
            }
            Err(why) => {
                tracing::error!(service = %want.service, error = %why, "gave up applying the retention to the Restate service");
                return;
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One `PATCH /services/{service}`; Restate's reported retention on success.
async fn patch(gateway: &Gateway, want: &Want, retention: &str) -> Result<String, String> {
    let prefix = want.admin.path().trim_end_matches('/');
    let encoded = percent_encoding::utf8_percent_encode(&want.service, percent_encoding::NON_ALPHANUMERIC);
    let mut parts = want.admin.clone().into_parts();
    parts.path_and_query = format!("{prefix}/services/{encoded}").parse().ok();
    let uri = Uri::from_parts(parts).map_err(|e| e.to_string())?;
    let body = serde_json::json!({ "idempotency_retention": retention }).to_string();
    let req = Request::patch(uri)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let call = async {
        let resp = gateway.client().request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, body))
    };
    let (status, body) = tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| "the admin API did not answer in time".to_owned())??;
    if !status.is_success() {
        return Err(format!(
            "admin API answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(300)])
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    Ok(v.get("idempotency_retention")
        .and_then(|r| r.as_str())
        .unwrap_or("?")
        .to_owned())
}

/// A duration as Restate's admin API reads it (jiff's friendly format), in whole seconds or
/// milliseconds.
fn restate_duration(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_restate_syntax() {
        assert_eq!(restate_duration(Duration::from_secs(86_400)), "86400s");
        assert_eq!(restate_duration(Duration::from_millis(1500)), "1500ms");
    }
}
