//! Restate upstreams (SPEC 9): idemgate at the edge of a Restate ingress.
//!
//! Restate's partition processor records each `idempotency-key` atomically, caches the committed
//! response (success or terminal error) for the service's retention, and latches duplicates onto
//! the running invocation. So for a route whose upstream has `kind: restate`, idemgate does
//! everything *before* the key reaches Restate (identity, policy, key validation, namespacing)
//! and leaves the deduplication to Restate:
//!
//! - `Gateway::restate`: `POST {url}/{Service}/{handler}` with `idempotency-key: {namespaced}`.
//!   Response headers: `x-restate-id` becomes `x-operation-id`, other `x-restate-*` are dropped,
//!   `idempotency-expires` is passed on. No local record of the response.
//! - `Gateway::restate_recover`: `GET .../by-idempotency-key/{key}[/output]` becomes
//!   `/restate/invocation/{Service}/{handler}/{namespaced}/output`, then `/attach` (bounded by
//!   `wait_timeout`) while the invocation runs, in the caller's own namespace, with Restate's
//!   answers mapped to the contract (470 not ready → 202, unknown → 404).
//! - [`apply_retention`]: with `admin_url`, each route's `retention` is written to its Restate
//!   service at start (`PATCH /services/{service}`), retried until Restate knows the service.
//!
//! One thing Restate cannot do alone: it answers a reused key with the original response even
//! when the body differs. `fingerprint` keeps a bodiless marker per key in idemgate's store so
//! such a reuse is refused with 422 (see that module for the concurrency argument).

mod fingerprint;
mod retention;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::Full;
use idemgate_core::namespace::Principal;

pub use retention::apply_retention;

use crate::access_log::AccessLog;
use crate::body::{Body, full, stream};
use crate::config::file::RouteFile;
use crate::config::{PolicyKind, Route, Upstream, UpstreamKind};
use crate::problem::{Kind, Problem};
use crate::proxy::{
    Gateway, IDEMPOTENCY_EXPIRES, IDEMPOTENCY_STATUS, OPERATION_ID, header_value, namespace,
    request_fingerprint, strip_hop_by_hop,
};
use crate::upstream::UpstreamBody;

/// The request header Restate's ingress deduplicates on.
const RESTATE_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// Restate's invocation id, shown to clients as `x-operation-id`.
const RESTATE_ID: &str = "x-restate-id";
/// Who produced an error response: `ingress` (Restate itself) or `invocation` (the handler).
const ERROR_SOURCE: &str = "x-restate-error-source";
/// Restate's answer to `/output` for an invocation that has not completed yet.
const NOT_READY: u16 = 470;

/// A route's `target: {Service}/{handler}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub service: String,
    pub handler: String,
}

impl Target {
    /// Parses `Service/handler`: two non-empty names of letters, digits, `_`, `.`, `-`.
    ///
    /// # Errors
    /// Anything else, with the reason.
    pub fn parse(s: &str) -> Result<Self, String> {
        let ok = |n: &str| {
            !n.is_empty()
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        };
        match s.split_once('/') {
            Some((service, handler)) if ok(service) && ok(handler) => Ok(Self {
                service: service.to_owned(),
                handler: handler.to_owned(),
            }),
            _ => Err(format!(
                "`{s}` must be `Service/handler` (letters, digits, `_`, `.`, `-`)"
            )),
        }
    }
}

/// Checks a route against its upstream's kind; the route's [`Target`] for a Restate upstream.
///
/// # Errors
/// The offending key and why.
pub fn check_route(rf: &RouteFile, upstream: &Upstream) -> Result<Option<Target>, (&'static str, String)> {
    if upstream.kind == UpstreamKind::Http {
        return match rf.target {
            Some(_) => Err((
                "target",
                "only routes to a `kind: restate` upstream take a target".into(),
            )),
            None => Ok(None),
        };
    }
    let Some(target) = &rf.target else {
        return Err((
            "target",
            "a route to a `kind: restate` upstream needs `target: Service/handler`".into(),
        ));
    };
    if rf.policy == PolicyKind::Webhook {
        return Err((
            "policy",
            "`webhook` routes to a `kind: restate` upstream are not supported yet".into(),
        ));
    }
    if rf.status.is_some() {
        return Err((
            "status",
            "a status probe reads a stored response; Restate routes keep none".into(),
        ));
    }
    Target::parse(target).map(Some).map_err(|why| ("target", why))
}

/// A request that passed policy and key validation, on its way to Restate.
pub(crate) struct Inbound {
    pub route: Arc<Route>,
    pub parts: http::request::Parts,
    pub body: Bytes,
    pub peer: SocketAddr,
    pub principal: Option<Principal>,
    /// The validated raw key; `None` when the policy lets the request through without one.
    pub raw: Option<String>,
}

impl Gateway {
    /// The Restate phase, taking over after policy and key validation (SPEC 9).
    pub(crate) async fn restate(
        self: &Arc<Self>,
        inbound: Inbound,
        log: &mut AccessLog,
    ) -> Result<Response<Body>, Problem> {
        let Inbound {
            route,
            parts,
            body,
            peer,
            principal,
            raw,
        } = inbound;
        let target = route
            .target
            .as_ref()
            .ok_or_else(|| Problem::new(Kind::UpstreamUnavailable, "the route has no Restate target"))?;
        let key = match raw {
            None => {
                log.key_missing = route.policy == PolicyKind::Accepted;
                None
            }
            Some(raw) => {
                log.case = "A";
                log.source = "header";
                let key = namespace(&route, principal.as_ref(), &raw)?;
                log.set_key(&key);
                let fp = request_fingerprint(&route, &parts, &body);
                self.check_fingerprint(&route, &key, fp, log).await?;
                Some(key)
            }
        };
        let mut headers = parts.headers;
        strip_hop_by_hop(&mut headers);
        self.set_identity_headers(&mut headers, principal.as_ref());
        // The raw key (replaced by the namespaced one below), any client-sent `idempotency-key`
        // (even on a `handler_internal` route, whose header is otherwise left alone) and
        // anything addressed to Restate itself never reach the ingress: Restate would
        // deduplicate on a raw, un-namespaced key, across tenants.
        if key.is_some() {
            headers.remove(&route.header);
        }
        headers.remove(RESTATE_KEY);
        drop_restate_headers(&mut headers);
        if let Some(host) = headers.remove(header::HOST) {
            headers.insert(HeaderName::from_static("x-forwarded-host"), host);
        }
        headers.append(
            HeaderName::from_static("x-forwarded-for"),
            header_value(&peer.ip().to_string()),
        );
        headers.insert(
            HeaderName::from_static("x-forwarded-proto"),
            HeaderValue::from_static("http"),
        );
        if let Some(key) = &key {
            headers.insert(RESTATE_KEY, header_value(key));
        }
        let path = format!("/{}/{}", target.service, target.handler);
        let mut req = Request::post(join(&route.upstream.base, &path)?)
            .body(Full::new(body))
            .map_err(|_| Problem::new(Kind::BadRequest, "the request cannot be forwarded"))?;
        *req.headers_mut() = headers;
        let resp = self.call_restate(&route, req, route.upstream.timeout).await?;
        let (mut head, body) = resp.into_parts();
        client_headers(&mut head.headers);
        if let Some(op) = head.headers.get(OPERATION_ID).and_then(|v| v.to_str().ok()) {
            log.set_operation_id(op);
        }
        // Restate sends `idempotency-expires` only when it answers from a completed invocation
        // of the key (not on the first execution): that is a replay in SPEC 4's sense.
        if key.is_some() && head.headers.contains_key(IDEMPOTENCY_EXPIRES) {
            head.headers
                .insert(route.replayed_header.clone(), HeaderValue::from_static("true"));
            log.cache_hit = true;
            log.outcome = "replayed";
        }
        Ok(Response::from_parts(head, stream(body)))
    }

    /// A recovery request on a Restate route (SPEC 5, 9): attach to the invocation of the
    /// caller's own namespaced key, or read its output without waiting.
    pub(crate) async fn restate_recover(
        &self,
        route: &Route,
        key: &str,
        output: bool,
        log: &mut AccessLog,
    ) -> Result<Response<Body>, Problem> {
        let target = route
            .target
            .as_ref()
            .ok_or_else(|| Problem::new(Kind::UpstreamUnavailable, "the route has no Restate target"))?;
        // `/output` first: it never blocks, and its "not found" is told apart from a handler's
        // stored 404 by `x-restate-error-source: ingress` (`/attach` answers an unknown key
        // with an invocation-sourced 404, the same shape as a handler's own).
        let req = recovery_request(route, target, key, "output")?;
        let resp = self.call_restate(route, req, route.upstream.timeout).await?;
        let resp = match resp.status().as_u16() {
            // Still running: `/output` answers at once; a plain recovery attaches and waits up
            // to the route's `wait_timeout` (attaching blocks until the invocation ends).
            NOT_READY if output => return Ok(processing(log)),
            NOT_READY => {
                let req = recovery_request(route, target, key, "attach")?;
                match self.call_restate(route, req, route.engine.wait_timeout).await {
                    Err(p) if p.kind == Kind::UpstreamTimeout => return Ok(processing(log)),
                    other => other?,
                }
            }
            _ => resp,
        };
        // Restate's own "no such invocation" (and "purged", where it says so) come from the
        // ingress; a handler's stored 404 or 410 comes from the invocation and is replayed.
        let from_ingress = resp
            .headers()
            .get(ERROR_SOURCE)
            .is_some_and(|v| v.as_bytes() == b"ingress");
        match resp.status().as_u16() {
            404 if from_ingress => Err(Problem::new(
                Kind::NotFound,
                "no outcome is recorded for this key",
            )),
            410 if from_ingress => Err(Problem::new(
                Kind::OutcomePurged,
                "the outcome for this key was purged",
            )),
            NOT_READY => Ok(processing(log)),
            _ => {
                let (mut head, body) = resp.into_parts();
                client_headers(&mut head.headers);
                if let Some(op) = head.headers.get(OPERATION_ID).and_then(|v| v.to_str().ok()) {
                    log.set_operation_id(op);
                }
                head.headers
                    .insert(route.replayed_header.clone(), HeaderValue::from_static("true"));
                log.cache_hit = true;
                log.outcome = "recovered";
                Ok(Response::from_parts(head, stream(body)))
            }
        }
    }

    /// One request to the ingress, timed and bounded; connection failures and timeouts are the
    /// gateway's 502 and 504.
    async fn call_restate(
        &self,
        route: &Route,
        req: Request<Full<Bytes>>,
        limit: Duration,
    ) -> Result<Response<UpstreamBody>, Problem> {
        let timer = Instant::now();
        let answer = tokio::time::timeout(limit, self.client().request(req)).await;
        self.metrics()
            .upstream_latency(&route.id, timer.elapsed().as_secs_f64());
        match answer {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => {
                tracing::warn!(upstream = %route.upstream.name, error = %e, "Restate ingress request failed");
                Err(Problem::new(Kind::UpstreamUnavailable, "the upstream could not be reached").retry_after(1))
            }
            Err(_) => Err(Problem::new(
                Kind::UpstreamTimeout,
                "the upstream did not answer in time; a retry with the same key attaches to the running operation",
            )
            .retry_after(1)),
        }
    }
}

/// `GET {url}/restate/invocation/{Service}/{handler}/{key}/{what}`.
fn recovery_request(
    route: &Route,
    target: &Target,
    key: &str,
    what: &str,
) -> Result<Request<Full<Bytes>>, Problem> {
    // Verbatim: Restate matches the path segment without percent-decoding it, and a namespaced
    // key is URI-safe already (every component is percent-escaped outside `A-Za-z0-9._~-`, so
    // only `:`, `*` and `%XX` triplets are added).
    let path = format!(
        "/restate/invocation/{}/{}/{key}/{what}",
        target.service, target.handler
    );
    Request::get(join(&route.upstream.base, &path)?)
        .body(Full::new(Bytes::new()))
        .map_err(|_| Problem::new(Kind::BadRequest, "the request cannot be forwarded"))
}

/// The contract's "still running" answer to a recovery request.
fn processing(log: &mut AccessLog) -> Response<Body> {
    log.outcome = "processing";
    let mut resp = Response::new(full(Bytes::from_static(b"{\"status\":\"processing\"}")));
    *resp.status_mut() = StatusCode::ACCEPTED;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    h.insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("processing"));
    resp
}

/// What a client sees of Restate's response headers: `x-restate-id` as `x-operation-id`, no
/// other `x-restate-*`, no hop-by-hop headers. `idempotency-expires` keeps its name.
fn client_headers(h: &mut HeaderMap) {
    strip_hop_by_hop(h);
    let id = h.remove(RESTATE_ID);
    drop_restate_headers(h);
    if let Some(id) = id {
        h.insert(OPERATION_ID, id);
    }
}

/// Removes every header whose name starts with `x-restate-`.
fn drop_restate_headers(h: &mut HeaderMap) {
    let names: Vec<HeaderName> = h
        .keys()
        .filter(|n| n.as_str().starts_with("x-restate-"))
        .cloned()
        .collect();
    for n in names {
        h.remove(n);
    }
}

/// `base` (scheme, authority, optional path prefix) joined with an absolute `path`.
fn join(base: &Uri, path: &str) -> Result<Uri, Problem> {
    let prefix = base.path().trim_end_matches('/');
    let mut parts = base.clone().into_parts();
    parts.path_and_query = format!("{prefix}{path}").parse().ok();
    Uri::from_parts(parts)
        .map_err(|_| Problem::new(Kind::BadRequest, "the request target cannot be forwarded"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let t = Target::parse("LLMGatewayService/SendMessage").unwrap();
        assert_eq!(t.service, "LLMGatewayService");
        assert_eq!(t.handler, "SendMessage");
        assert!(Target::parse("my.pkg.Svc/run_1").is_ok());
        for bad in ["", "Svc", "Svc/", "/h", "Svc/h/x", "Svc/h x", "Svc/{h}"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn client_headers_hide_restate() {
        let mut h = HeaderMap::new();
        h.insert("x-restate-id", HeaderValue::from_static("inv_1"));
        h.insert("x-restate-foo", HeaderValue::from_static("x"));
        h.insert("idempotency-expires", HeaderValue::from_static("t"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h.insert("connection", HeaderValue::from_static("keep-alive"));
        client_headers(&mut h);
        assert_eq!(h.get("x-operation-id").unwrap(), "inv_1");
        assert!(h.get("x-restate-foo").is_none() && h.get("x-restate-id").is_none());
        assert!(h.get("connection").is_none());
        assert_eq!(h.get("Idempotency-Expires").unwrap(), "t");
        assert!(h.keys().all(|n| !n.as_str().contains("restate")));
    }

    #[test]
    fn join_keeps_a_prefix() {
        let base: Uri = "http://127.0.0.1:8080/ingress/".parse().unwrap();
        assert_eq!(
            join(&base, "/Svc/h").unwrap().to_string(),
            "http://127.0.0.1:8080/ingress/Svc/h"
        );
    }
}

#[cfg(test)]
mod config_tests {
    use http::Method;

    use super::*;
    use crate::config::Config;

    const YAML: &str = "
store:
  kind: memory
upstreams:
  checkout:
    kind: restate
    url: http://127.0.0.1:18080
    admin_url: http://127.0.0.1:19070
routes:
  - id: send-message
    method: POST
    path: /api/v1/llm/send-message
    upstream: checkout
    target: LLMGatewayService/SendMessage
    policy: required
    recovery: true
";

    #[test]
    fn a_restate_route_resolves() {
        let c = Config::from_yaml(YAML).unwrap();
        let r = c.routes.find(&Method::POST, "/api/v1/llm/send-message").unwrap();
        assert_eq!(r.upstream.kind, UpstreamKind::Restate);
        assert_eq!(
            r.upstream.admin_url.as_ref().map(ToString::to_string).as_deref(),
            Some("http://127.0.0.1:19070/")
        );
        assert_eq!(
            r.target,
            Some(Target {
                service: "LLMGatewayService".into(),
                handler: "SendMessage".into()
            })
        );
    }

    #[test]
    fn what_restate_routes_refuse() {
        let err = |yaml: String| Config::from_yaml(&yaml).expect_err("must be refused").0;
        let e = err(YAML.replace("LLMGatewayService/SendMessage", "nope"));
        assert!(e.contains("target") && e.contains("Service/handler"), "{e}");
        let e = err(YAML.replace(
            "    recovery: true\n",
            "    status: {resource_id: /id, probe: 'http://x/{resource_id}'}\n",
        ));
        assert!(e.contains("status") && e.contains("Restate"), "{e}");
        let e = err(YAML.replace(
            "    admin_url: http://127.0.0.1:19070\n",
            "    admin_url: ftp://x\n",
        ));
        assert!(e.contains("admin_url"), "{e}");
    }
}
