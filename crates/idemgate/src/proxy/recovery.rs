//! What a caller can learn about a key besides replaying it: the recovery endpoints (SPEC 5)
//! and the status probe of a replay (SPEC 8).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use idemgate_core::engine::Lookup;
use idemgate_core::record::RecordState;

use super::{
    Gateway, IDEMPOTENCY_STATUS, OPERATION_ID, header_value, invalid_key, namespace, not_retained, replay,
};
use crate::access_log::AccessLog;
use crate::body::{Body, full};
use crate::config::{Route, UpstreamKind};
use crate::problem::{Kind, Problem};

impl Gateway {
    /// SPEC 8: on a replay, asks the route's probe how the created resource is doing. Any
    /// failure (no id in the body, probe down, odd answer) falls back to `processing`, logged.
    pub(super) async fn probe_status(&self, route: &Route, body: Option<&[u8]>) -> Option<HeaderValue> {
        let st = route.status.as_ref()?;
        let processing = HeaderValue::from_static("processing");
        let id = body
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
            .and_then(|v| match v.pointer(&st.resource_id)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Number(n) => Some(n.to_string()),
                _ => None,
            });
        let Some(id) = id else {
            tracing::warn!(endpoint = %route.id, "status probe: no resource id in the stored body");
            return Some(processing);
        };
        let encoded =
            percent_encoding::utf8_percent_encode(&id, percent_encoding::NON_ALPHANUMERIC).to_string();
        let Ok(uri) = st.probe.replace("{resource_id}", &encoded).parse::<Uri>() else {
            return Some(processing);
        };
        let req = Request::get(uri).body(Full::new(Bytes::new())).ok()?;
        let answer = async {
            let resp = self.client.request(req).await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .ok()?
                .to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
            match v.get("status")?.as_str()? {
                s @ ("processing" | "completed" | "failed") => Some(HeaderValue::from_static(match s {
                    "completed" => "completed",
                    "failed" => "failed",
                    _ => "processing",
                })),
                _ => None,
            }
        };
        match tokio::time::timeout(Duration::from_secs(2), answer).await {
            Ok(Some(v)) => Some(v),
            _ => {
                tracing::warn!(endpoint = %route.id, "status probe failed; answering processing");
                Some(processing)
            }
        }
    }

    /// `GET {route path}/by-idempotency-key/{key}[/output]` on a route with `recovery: true`.
    pub(super) fn recovery_target(&self, path: &str) -> Option<(Arc<Route>, String, bool)> {
        let (prefix, rest) = path.rsplit_once("/by-idempotency-key/")?;
        let (raw, output) = rest.strip_suffix("/output").map_or((rest, false), |k| (k, true));
        if raw.is_empty() || raw.contains('/') {
            return None;
        }
        let route = self
            .config
            .routes
            .iter()
            .find(|r| r.recovery && r.path.matches(prefix).is_some())?;
        let raw = percent_encoding::percent_decode_str(raw).decode_utf8().ok()?;
        Some((route.clone(), raw.into_owned(), output))
    }

    /// Answers a recovery request from the caller's own namespace (SPEC 5).
    pub(super) async fn recover(
        &self,
        route: &Route,
        req: &Request<Incoming>,
        peer: SocketAddr,
        raw: &str,
        output: bool,
        log: &mut AccessLog,
    ) -> Result<Response<Body>, Problem> {
        if req.headers().contains_key(&route.header) {
            return Err(Problem::new(
                Kind::KeyNotAllowed,
                "recovery requests name the key in the path",
            ));
        }
        let principal = self.identify(req.headers(), peer).await?;
        log.set_principal(principal.as_ref());
        route.keys.validate(raw).map_err(|e| invalid_key(&e))?;
        let key = namespace(route, principal.as_ref(), raw)?;
        log.set_key(&key);
        if route.upstream.kind == UpstreamKind::Restate {
            return self.restate_recover(route, &key, output, log).await;
        }
        let wait = (!output).then_some(route.engine.wait_timeout);
        let found = self.engine.lookup(&key, wait).await.map_err(|e| {
            tracing::warn!(error = %e, endpoint = %route.id, "store error");
            Problem::new(Kind::StoreUnavailable, "the idempotency store is unavailable").retry_after(1)
        })?;
        let not_found = || Problem::new(Kind::NotFound, "no outcome is recorded for this key");
        match found {
            Lookup::Completed(record) if *record.route == *route.id => {
                let RecordState::Completed { response, .. } = record.state else {
                    return Err(not_found());
                };
                log.set_operation_id(&record.operation_id);
                match response.body {
                    Some(_) => {
                        log.cache_hit = true;
                        log.outcome = "recovered";
                        let status = self.probe_status(route, response.body.as_deref()).await;
                        let mut resp = replay(route, response, &record.operation_id, record.expires_at);
                        if let Some(st) = status {
                            resp.headers_mut().insert(IDEMPOTENCY_STATUS, st);
                        }
                        Ok(resp)
                    }
                    None => Err(not_retained(response.status, record.operation_id)),
                }
            }
            Lookup::InFlight {
                operation_id,
                route: r,
            } if *r == *route.id => {
                log.outcome = "processing";
                let body = serde_json::json!({"status": "processing", "operation_id": operation_id});
                let mut resp = Response::new(full(Bytes::from(body.to_string())));
                *resp.status_mut() = StatusCode::ACCEPTED;
                let h = resp.headers_mut();
                h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                h.insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("processing"));
                h.insert(OPERATION_ID, header_value(&operation_id));
                Ok(resp)
            }
            _ => Err(not_found()),
        }
    }
}
