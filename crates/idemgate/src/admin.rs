//! The admin listener, on `server.admin_listen`, apart from client traffic (SPEC 12).
//!
//! | endpoint | what |
//! |---|---|
//! | `GET /healthz` | 200 while the process serves |
//! | `GET /readyz` | 200 when the store answers, else 503 `store-unavailable` |
//! | `GET /metrics` | Prometheus / OpenMetrics text |
//! | `GET /admin/stats` | per route: requests, cache_hits, cache_misses, in_flight_waits, enforced, invalid_key, store_errors, responses_stored |
//! | `GET /admin/routes` | the route table |
//! | `GET /admin/records/{key}` | a record by namespaced key (percent-encoded), without its body unless `?body=true` |
//! | `DELETE /admin/records/{key}` | purge a record: the escape hatch for `outcome-unknown` or a cached terminal error |
//! | `GET /admin/api-keys` | the provisioned API keys (digests and principals) |
//! | `POST /admin/api-keys` | add or replace `{key_sha256, tenant, project, subject}` |
//! | `DELETE /admin/api-keys/{key_sha256}` | remove a key |
//! | `GET /admin/webhooks` | registered webhook endpoints (ids, owners, providers; never secrets) |
//! | `POST /admin/webhooks` | provision `{tenant, project?, provider, secrets_env: [..], id?}` (until restart) |
//! | `DELETE /admin/webhooks/{id}` | remove a provisioned endpoint |
//! | `GET /admin/openapi.json` | an OpenAPI 3.1 description of this listener |
//!
//! `/admin/*` needs `Authorization: Bearer <token>`, the token read from the environment
//! variable named by `server.admin_token_env`, compared in constant time; without a configured
//! token every `/admin/*` request is refused. `/healthz`, `/readyz` and `/metrics` are open, as
//! scrapers and probes expect: bind the listener to a private address.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use idemgate_core::record::now_millis;
use idemgate_core::store::Store;
use idemgate_core::{Record, RecordState};
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;

use crate::body::{Body, full};
use crate::problem::{Kind, Problem};
use crate::proxy::Gateway;

/// Serves the admin API until `shutdown` resolves.
pub async fn serve(gateway: Arc<Gateway>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue; }
            },
            () = &mut shutdown => return,
        };
        let gw = gateway.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let gw = gw.clone();
                async move { Ok::<_, Infallible>(handle(&gw, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn handle(gw: &Gateway, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let method = req.method().clone();
    match (&method, path.as_str()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "text/plain", "ok\n".into()),
        (&Method::GET, "/readyz") => {
            match tokio::time::timeout(Duration::from_secs(2), gw.engine().store().ping()).await {
                Ok(Ok(())) => text(StatusCode::OK, "text/plain", "ready\n".into()),
                _ => Problem::new(Kind::StoreUnavailable, "the store does not answer")
                    .retry_after(1)
                    .into_response(),
            }
        }
        (&Method::GET, "/metrics") => text(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            gw.metrics().render(),
        ),
        (_, p) if p.starts_with("/admin/") => {
            if !authorized(gw, &req) {
                let mut resp = Problem::new(Kind::Unauthenticated, "a valid admin bearer token is required")
                    .into_response();
                resp.headers_mut()
                    .insert("www-authenticate", HeaderValue::from_static("Bearer"));
                return resp;
            }
            let body = match crate::body::read_limited(req.into_body(), 64 * 1024).await {
                Ok(crate::body::Read::Complete(b)) => b,
                _ => {
                    return Problem::new(Kind::PayloadTooLarge, "admin bodies are at most 64 KiB")
                        .into_response();
                }
            };
            admin(gw, &method, &path, &query, &body)
                .await
                .unwrap_or_else(Problem::into_response)
        }
        _ => Problem::new(Kind::NotFound, "no such admin endpoint").into_response(),
    }
}

fn authorized(gw: &Gateway, req: &Request<Incoming>) -> bool {
    let Some(token) = gw.config().admin.as_ref().and_then(|a| a.token.as_deref()) else {
        return false;
    };
    let presented = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Hash both sides so the comparison's length and time do not depend on the token.
    use sha2::{Digest, Sha256};
    bool::from(Sha256::digest(presented.as_bytes()).ct_eq(&Sha256::digest(token.as_bytes())))
}

async fn admin(
    gw: &Gateway,
    method: &Method,
    path: &str,
    query: &str,
    body: &[u8],
) -> Result<Response<Body>, Problem> {
    match (method, path) {
        (&Method::GET, "/admin/stats") => Ok(json_response(&gw.metrics().stats())),
        (&Method::GET, "/admin/routes") => Ok(json_response(&routes(gw))),
        (&Method::GET, "/admin/openapi.json") => Ok(json_response(&openapi())),
        (_, p) if p == "/admin/api-keys" || p.starts_with("/admin/api-keys/") => {
            api_keys(gw, method, p, body)
        }
        (_, p) if p == "/admin/webhooks" || p.starts_with("/admin/webhooks/") => {
            webhooks(gw, method, p, body)
        }
        (_, p) if p.starts_with("/admin/records/") => {
            let raw = &p["/admin/records/".len()..];
            let key = percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .map_err(|_| Problem::new(Kind::BadRequest, "the key is not valid UTF-8"))?;
            let store = gw.engine().store();
            let unavailable = |_| Problem::new(Kind::StoreUnavailable, "the store failed").retry_after(1);
            match *method {
                Method::GET => {
                    let record = store.get(&key, now_millis()).await.map_err(unavailable)?;
                    let record = record.ok_or_else(|| Problem::new(Kind::NotFound, "no such record"))?;
                    let with_body = query.split('&').any(|kv| kv == "body=true");
                    Ok(json_response(&describe_record(&record, with_body)))
                }
                Method::DELETE => {
                    let existed = store.purge(&key).await.map_err(unavailable)?;
                    tracing::warn!(key = %idemgate_core::namespace::key_digest(&key), existed, "record purged by an operator");
                    Ok(json_response(&json!({ "purged": existed })))
                }
                _ => Err(Problem::new(Kind::NotFound, "records take GET or DELETE")),
            }
        }
        _ => Err(Problem::new(Kind::NotFound, "no such admin endpoint")),
    }
}

/// `/admin/api-keys`: list, add (or replace) and remove API keys; written through to the key
/// file, so provisioning survives a restart. Keys travel and are stored only as SHA-256.
fn api_keys(gw: &Gateway, method: &Method, path: &str, body: &[u8]) -> Result<Response<Body>, Problem> {
    let keys = gw
        .config()
        .identity
        .as_ref()
        .and_then(|i| i.api_keys())
        .ok_or_else(|| Problem::new(Kind::NotFound, "the api_keys identity method is not configured"))?;
    let bad = |why: String| Problem::new(Kind::BadRequest, why);
    match (method, path.strip_prefix("/admin/api-keys/")) {
        (&Method::GET, None) => Ok(json_response(
            &serde_json::to_value(keys.list()).unwrap_or_default(),
        )),
        (&Method::POST, None) => {
            let v: crate::identity::ApiKeyView = serde_json::from_slice(body)
                .map_err(|e| bad(format!("expected {{key_sha256, tenant, project, subject}}: {e}")))?;
            keys.upsert(&v).map_err(|r| bad(r.0))?;
            Ok(json_response(&json!({ "key_sha256": v.key_sha256 })))
        }
        (&Method::DELETE, Some(digest)) => {
            let removed = keys.remove(digest).map_err(|r| bad(r.0))?;
            Ok(json_response(&json!({ "removed": removed })))
        }
        _ => Err(Problem::new(
            Kind::NotFound,
            "api-keys take GET, POST, or DELETE /admin/api-keys/{key_sha256}",
        )),
    }
}

/// `/admin/webhooks`: list, provision and remove webhook endpoints. Secrets never travel through
/// the API: an entry names environment variables of the gateway process, as the registry file
/// does. Provisioned entries live until a restart; the registry file is the durable source.
fn webhooks(gw: &Gateway, method: &Method, path: &str, body: &[u8]) -> Result<Response<Body>, Problem> {
    use crate::config::webhooks::RegistryEntry;
    use crate::webhook::registry::{Entry, new_id};
    let hooks = gw
        .config()
        .webhooks
        .as_ref()
        .ok_or_else(|| Problem::new(Kind::NotFound, "no `webhooks:` section is configured"))?;
    let registry = hooks.registry();
    let bad = |why: String| Problem::new(Kind::BadRequest, why);
    match (method, path.strip_prefix("/admin/webhooks/")) {
        (&Method::GET, None) => {
            let list: Vec<Value> = registry
                .entries()
                .iter()
                .map(|e| {
                    json!({"id": e.id, "tenant": e.tenant, "project": e.project,
                           "provider": e.provider.as_str(), "secrets": e.secrets.len()})
                })
                .collect();
            Ok(json_response(&Value::Array(list)))
        }
        (&Method::POST, None) => {
            let mut v: Value =
                serde_json::from_slice(body).map_err(|e| bad(format!("expected a JSON object: {e}")))?;
            if v.get("id").is_none() {
                v["id"] = json!(new_id());
            }
            let file: RegistryEntry = serde_json::from_value(v).map_err(|e| {
                bad(format!(
                    "expected {{tenant, project?, provider, secrets_env: [..], id?}}: {e}"
                ))
            })?;
            let entry = Entry::resolve(&file, &|name| std::env::var(name).ok()).map_err(bad)?;
            let id = entry.id.clone();
            registry.upsert(entry).map_err(|e| bad(e.to_string()))?;
            tracing::info!(tenant = %file.tenant, provider = file.provider.as_str(), "webhook provisioned");
            Ok(json_response(&json!({ "id": id })))
        }
        (&Method::DELETE, Some(id)) => Ok(json_response(&json!({ "removed": registry.remove(id) }))),
        _ => Err(Problem::new(
            Kind::NotFound,
            "webhooks take GET, POST, or DELETE /admin/webhooks/{id}",
        )),
    }
}

/// A record as the admin API and the CLI show it; the body only when asked (it may hold
/// personal data).
#[must_use]
pub fn describe_record(r: &Record, with_body: bool) -> Value {
    let (state, status, lease_until, body) = match &r.state {
        RecordState::InFlight { lease_until, .. } => ("in_flight", None, Some(*lease_until), None),
        RecordState::Completed { response, .. } => {
            let body = with_body.then(|| {
                response
                    .body
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
            });
            ("completed", Some(response.status), None, body.flatten())
        }
    };
    let mut v = json!({
        "state": state,
        "status": status,
        "lease_until_ms": lease_until,
        "route": r.route,
        "operation_id": r.operation_id,
        "fingerprint": r.fingerprint.to_hex(),
        "created_at_ms": r.created_at,
        "expires_at_ms": (r.expires_at != u64::MAX).then_some(r.expires_at),
        "generation": r.generation,
    });
    if with_body {
        v["body"] = json!(body);
    }
    v
}

fn routes(gw: &Gateway) -> Value {
    let list: Vec<Value> = gw
        .config()
        .routes
        .iter()
        .map(|r| {
            json!({
                "id": &*r.id,
                "methods": r.methods.to_string(),
                "path": r.path.to_string(),
                "upstream": r.upstream.name,
                "policy": format!("{:?}", r.policy).to_lowercase(),
                "scope": r.scope.as_str(),
                "retention_secs": r.engine.retention.as_secs(),
                "recovery": r.recovery,
            })
        })
        .collect();
    Value::Array(list)
}

fn json_response(v: &Value) -> Response<Body> {
    text(StatusCode::OK, "application/json", v.to_string())
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut resp = Response::new(full(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// The OpenAPI description of the admin listener.
#[must_use]
pub fn openapi() -> Value {
    let problem = json!({"description": "problem+json", "content": {"application/problem+json": {"schema": {"type": "object"}}}});
    let ok_json =
        |d: &str| json!({"description": d, "content": {"application/json": {"schema": {"type": "object"}}}});
    let secured = json!([{"bearer": []}]);
    let key = json!([{"name": "key", "in": "path", "required": true, "description": "namespaced key, percent-encoded", "schema": {"type": "string"}}]);
    json!({
        "openapi": "3.1.0",
        "info": {"title": "idemgate admin API", "version": env!("CARGO_PKG_VERSION")},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/healthz": {"get": {"operationId": "healthz", "responses": {"200": {"description": "serving", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/readyz": {"get": {"operationId": "readyz", "responses": {"200": {"description": "store reachable", "content": {"text/plain": {"schema": {"type": "string"}}}}, "503": problem}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {"description": "metrics", "content": {"application/openmetrics-text": {"schema": {"type": "string"}}}}}}},
            "/admin/stats": {"get": {"operationId": "stats", "security": secured, "responses": {"200": ok_json("per-route counters"), "401": problem}}},
            "/admin/routes": {"get": {"operationId": "routes", "security": secured, "responses": {"200": {"description": "the route table", "content": {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}}, "401": problem}}},
            "/admin/openapi.json": {"get": {"operationId": "openapi", "security": secured, "responses": {"200": ok_json("this document"), "401": problem}}},
            "/admin/api-keys": {
                "get": {"operationId": "listApiKeys", "security": secured, "responses": {"200": {"description": "keys", "content": {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}}, "401": problem, "404": problem}},
                "post": {"operationId": "putApiKey", "security": secured, "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["key_sha256", "tenant", "subject"], "properties": {"key_sha256": {"type": "string"}, "tenant": {"type": "string"}, "project": {"type": "string"}, "subject": {"type": "string"}}}}}}, "responses": {"200": ok_json("added"), "400": problem, "401": problem}}
            },
            "/admin/api-keys/{key_sha256}": {
                "delete": {"operationId": "deleteApiKey", "security": secured, "parameters": [{"name": "key_sha256", "in": "path", "required": true, "schema": {"type": "string"}}], "responses": {"200": ok_json("{\"removed\": bool}"), "401": problem}}
            },
            "/admin/webhooks": {
                "get": {"operationId": "listWebhooks", "security": secured, "responses": {"200": {"description": "webhooks", "content": {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}}, "401": problem, "404": problem}},
                "post": {"operationId": "putWebhook", "security": secured, "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["tenant", "provider", "secrets_env"], "properties": {"id": {"type": "string"}, "tenant": {"type": "string"}, "project": {"type": "string"}, "provider": {"type": "string"}, "secrets_env": {"type": "array", "items": {"type": "string"}}}}}}}, "responses": {"200": ok_json("{\"id\": …}"), "400": problem, "401": problem}}
            },
            "/admin/webhooks/{id}": {
                "delete": {"operationId": "deleteWebhook", "security": secured, "parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}], "responses": {"200": ok_json("{\"removed\": bool}"), "401": problem}}
            },
            "/admin/records/{key}": {
                "get": {"operationId": "getRecord", "security": secured, "parameters": key.as_array().unwrap().iter().cloned().chain([json!({"name": "body", "in": "query", "required": false, "schema": {"type": "boolean"}})]).collect::<Vec<_>>(), "responses": {"200": ok_json("the record"), "401": problem, "404": problem}},
                "delete": {"operationId": "purgeRecord", "security": secured, "parameters": key, "responses": {"200": ok_json("{\"purged\": bool}"), "401": problem}}
            }
        }
    })
}
