//! The reverse proxy: each request goes through named phases.
//!
//! 1. **framing**: refuse ambiguous framing (CL+TE, several Content-Length) before anything is
//!    read or forwarded.
//! 2. **route**: method + path template, first match; no match is `not-found`.
//! 3. **policy**: `required` / `accepted` / `prohibited` / `handler_internal` decide whether the
//!    key is read, refused, or the request is forwarded untouched.
//! 4. **dedup**: namespaced key, fingerprint, [`Engine::begin`]; then execute, replay or refuse.
//! 5. **execute**: the upstream call runs to its end even if the client disconnects (polled by
//!    the request's task, moved to a task of its own if that one drops it: `detach.rs`); its
//!    outcome is completed or released before the client sees the response.
//!
//! Beside the phases: the webhook case in `delivery.rs`, recording an outcome in `finish.rs`,
//! the recovery endpoints and the status probe in `recovery.rs`, and the header work (what is
//! never forwarded, what a replay carries) in `headers.rs`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use idemgate_core::engine::{Engine, Execution, Finished, Outcome, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::key::{KeyError, parse_header};
use idemgate_core::namespace::{Principal, namespaced_key_of};
use idemgate_core::record::StoredResponse;
use idemgate_core::store::StoreError;
use tokio_util::task::TaskTracker;

use crate::access_log::AccessLog;
use crate::body::{Body, Prefixed, Read, full, read_limited, stream};
use crate::config::{Config, OnStoreError, PolicyKind, Route, UpstreamKind};
use crate::detach::Detached;
use crate::framing::Verdict;
use crate::identity;
use crate::metrics::Metrics;
use crate::problem::{Kind, Problem};
use crate::store::AnyStore;
use crate::upstream::{UpstreamBody, Upstreams};

mod delivery;
mod finish;
mod headers;
mod recovery;

pub(crate) use headers::strip_hop_by_hop;
use headers::{check_framing, forwarded_for, replay, upstream_uri};
pub(crate) use idemgate_core::headers::value as header_value;
pub use idemgate_core::headers::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_STATUS, OPERATION_ID};
use idemgate_core::headers::{rfc3339, storable as storable_headers};

/// The gateway: configuration, engine, upstream connection pool, and in-flight executions.
#[derive(Debug)]
pub struct Gateway {
    config: Config,
    engine: Engine<AnyStore>,
    metrics: Arc<Metrics>,
    client: Upstreams,
    tasks: TaskTracker,
}

impl Gateway {
    #[must_use]
    pub fn new(config: Config, store: AnyStore) -> Self {
        let client = Upstreams::new(Duration::from_secs(5), Duration::from_secs(60));
        let metrics = Arc::new(Metrics::new(
            config.routes.iter().map(|r| r.id.clone()),
            config.metrics.tenant_labels,
        ));
        // One tracker for executions and for store calls finishing after their client left
        // (a key such a call took for nobody is released by it): shutdown waits on both.
        let tasks = TaskTracker::new();
        Self {
            metrics,
            config,
            engine: Engine::new(Arc::new(store)).with_background(tasks.clone()),
            client,
            tasks,
        }
    }

    #[must_use]
    pub fn config(&self) -> &Config {
        &self.config
    }

    #[must_use]
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    #[must_use]
    pub fn engine(&self) -> &Engine<AnyStore> {
        &self.engine
    }

    /// The upstream connection pool (Restate's ingress and admin API use it too).
    pub(crate) fn client(&self) -> &Upstreams {
        &self.client
    }

    /// Executions still running (their upstream call and record update), for graceful shutdown.
    #[must_use]
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Handles one request and writes its access-log line.
    ///
    /// `framing` is the connection sniffer's verdict on this request's head (see
    /// [`crate::framing`]): a refusal reason, or `None`. Never an error: every refusal is a
    /// problem+json response (the `Result` is hyper's service signature, so the server calls
    /// this without a wrapper).
    ///
    /// # Errors
    /// None.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
        framing: Verdict,
    ) -> Result<Response<Body>, std::convert::Infallible> {
        let mut log = AccessLog::new(req.method());
        let routed = match framing {
            Some(why) => Err(Problem::new(Kind::BadRequest, why).close()),
            None => self.route(req, peer, &mut log).await,
        };
        let resp = match routed {
            Ok(resp) => resp,
            Err(problem) => {
                if log.outcome == "forwarded" {
                    log.outcome = "refused";
                }
                log.refusal = Some(problem.kind);
                log.reason = problem.reason;
                log.store_error |= problem.kind == Kind::StoreUnavailable;
                problem.into_response()
            }
        };
        let status = resp.status().as_u16();
        log.emit(status);
        self.metrics.observe(&log, status);
        Ok(resp)
    }

    async fn route(
        self: &Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
        log: &mut AccessLog,
    ) -> Result<Response<Body>, Problem> {
        check_framing(req.headers())?;
        if req.method() == http::Method::GET
            && let Some((route, raw, output)) = self.recovery_target(req.uri().path())
        {
            log.endpoint = Some(route.id.clone());
            log.policy = "recovery";
            return Box::pin(self.recover(&route, &req, peer, &raw, output, log)).await;
        }
        let Some(route) = self.config.routes.find(req.method(), req.uri().path()).cloned() else {
            return Err(Problem::new(
                Kind::NotFound,
                "no route matches this method and path",
            ));
        };
        log.endpoint = Some(route.id.clone());
        log.policy = policy_name(route.policy);
        if route.policy == PolicyKind::Webhook {
            return Box::pin(self.webhook(route, req, peer, log)).await;
        }
        let principal = self.identify(req.headers(), peer).await?;
        log.set_principal(principal.as_ref());
        let key_lines = || {
            req.headers()
                .get_all(&route.header)
                .iter()
                .map(HeaderValue::as_bytes)
        };
        let raw = match route.policy {
            PolicyKind::HandlerInternal => None,
            PolicyKind::Prohibited => {
                if key_lines().next().is_some() {
                    return Err(Problem::new(
                        Kind::KeyNotAllowed,
                        format!("this endpoint does not take an {} header", route.header),
                    ));
                }
                None
            }
            PolicyKind::Required | PolicyKind::Accepted | PolicyKind::Webhook => {
                let raw = parse_header(key_lines()).and_then(|raw| match raw {
                    Some(k) => route.keys.validate(&k).map(|()| Some(k)),
                    None => Ok(None),
                });
                match raw {
                    Err(e) => return Err(invalid_key(&e)),
                    Ok(None) if route.policy == PolicyKind::Required => {
                        log.key_missing = true;
                        return Err(Problem::new(
                            Kind::MissingKey,
                            format!("this endpoint requires an {} header", route.header),
                        ));
                    }
                    Ok(raw) => raw,
                }
            }
        };
        let (parts, body) = req.into_parts();
        let body = self.read_body(body).await?;
        if route.upstream.kind == UpstreamKind::Restate {
            // SPEC 9: Restate deduplicates; see `crate::restate`.
            let inbound = crate::restate::Inbound {
                route,
                parts,
                body,
                peer,
                principal,
                raw,
            };
            return Box::pin(self.restate(inbound, log)).await;
        }
        let Some(raw) = raw else {
            log.key_missing = route.policy == PolicyKind::Accepted;
            return self.forward(&route, parts, body, peer, principal.as_ref()).await;
        };
        log.case = "A";
        log.source = "header";
        let key = namespace(&route, principal.as_ref(), &raw)?;
        log.set_key(&key);
        let fingerprint = request_fingerprint(&route, &parts, &body);
        let call = Call {
            route,
            parts,
            body,
            peer,
            principal,
        };
        // Boxed, like the other branches that await large futures: the future of every request,
        // passthrough included, is as large as its largest branch, and hyper moves it around.
        Box::pin(self.dedup(call, key, fingerprint, log)).await
    }

    /// Reads a request body, refusing one over `max_request_body`.
    async fn read_body(&self, body: Incoming) -> Result<Bytes, Problem> {
        match read_limited(body, self.config.max_request_body).await {
            Ok(Read::Complete(b)) => Ok(b),
            Ok(Read::TooLarge(..)) => Err(Problem::new(
                Kind::PayloadTooLarge,
                format!("the body is over {} bytes", self.config.max_request_body),
            )
            .close()),
            Err(_) => Err(Problem::new(Kind::BadRequest, "the request body could not be read").close()),
        }
    }

    async fn dedup(
        self: &Arc<Self>,
        call: Call,
        key: String,
        fingerprint: Fingerprint,
        log: &mut AccessLog,
    ) -> Result<Response<Body>, Problem> {
        let route = &*call.route;
        let timer = Instant::now();
        let begun = self
            .engine
            .begin_traced(&key, &route.id, fingerprint, &route.engine, &mut log.waited)
            .await;
        if !log.waited {
            // A wait is time spent on another request, not on the store.
            self.metrics.store_latency("begin", timer.elapsed().as_secs_f64());
        }
        let started = match begun {
            Ok(s) => s,
            Err(e) => {
                store_failed(route, &e, log)?;
                let Call {
                    parts,
                    body,
                    peer,
                    principal,
                    ..
                } = call;
                // Boxed, as every rare branch here: `dedup`'s future is as large as its largest
                // await, and each miss moves it (see `Gateway::route`).
                return Box::pin(self.forward(route, parts, body, peer, principal.as_ref())).await;
            }
        };
        match started {
            Started::Execute(exec) => {
                log.set_operation_id(exec.operation_id());
                log.outcome = "executed";
                // If the client goes away, the upstream call still runs to its end and its
                // outcome is recorded: dropped unfinished, the execution moves to a tracked task.
                // `execute`'s own future is what gets boxed: a wrapper block around it would
                // hold the request's fields a second time, as its captures.
                let (resp, stored) = Detached::new(self.clone().execute(call, key, exec), &self.tasks).await;
                log.stored = stored;
                if resp.as_ref().is_err_and(|p| p.kind == Kind::RequestInFlight) {
                    // The lease ran out before the upstream was called: nothing executed.
                    log.outcome = "lease_lost";
                }
                resp
            }
            Started::Replay {
                response,
                operation_id,
                expires_at,
            } => {
                log.cache_hit = true;
                log.outcome = "replayed";
                log.set_operation_id(&operation_id);
                let status = match route.status {
                    Some(_) => Box::pin(self.probe_status(route, response.body.as_deref())).await,
                    None => None,
                };
                let mut resp = replay(route, response, &operation_id, expires_at);
                if let Some(st) = status {
                    resp.headers_mut().insert(IDEMPOTENCY_STATUS, st);
                }
                Ok(resp)
            }
            Started::NotRetained {
                status,
                operation_id,
                ..
            } => Err(not_retained(status, operation_id)),
            Started::Mismatch { operation_id } => Err(Problem::new(
                Kind::KeyReused,
                "this key was used for a request with a different body, method or endpoint",
            )
            .operation(operation_id)),
            Started::InFlight {
                operation_id,
                retry_after,
            } => Err(Problem::new(Kind::RequestInFlight, "a request with this key is still being processed")
                .operation(operation_id)
                .retry_after(retry_after.as_secs())),
            Started::OutcomeUnknown { operation_id } => Err(Problem::new(
                Kind::OutcomeUnknown,
                "the request with this key was interrupted; an operator must resolve it before the key can be used again",
            )
            .operation(operation_id)),
        }
    }

    /// Calls the upstream as the key's owner and records the outcome; also tells whether the
    /// outcome was stored (completed).
    async fn execute(
        self: Arc<Self>,
        call: Call,
        key: String,
        exec: Execution<AnyStore>,
    ) -> (Result<Response<Body>, Problem>, bool) {
        let op = exec.operation_id().to_owned();
        let route = &*call.route;
        let upstream = self
            .call_upstream(
                route,
                call.parts,
                call.body,
                call.peer,
                call.principal.as_ref(),
                Some((&key, &exec)),
            )
            .await;
        let resp = match upstream {
            Ok(resp) => resp,
            Err(problem) if problem.kind == Kind::RequestInFlight => {
                // The lease ran out before the upstream was called (`lease_lost`).
                self.withdraw(exec).await;
                return (Err(problem.operation(op)), false);
            }
            Err(problem) => {
                self.finish(exec, Outcome::NoResponse).await;
                return (Err(problem.operation(op)), false);
            }
        };
        let (mut head, body) = resp.into_parts();
        let (stored_body, rest) = match read_limited(body, route.engine.max_response_bytes).await {
            // Shared, not copied: `b` may be a view into a much larger read buffer, but the
            // memory, Redis and PostgreSQL stores encode the response within the call; what
            // keeps it longer (the embedded store until its commit, the hand-off to waiters, an
            // outcome retried into a failing store) keeps `StoredResponse::compacted`.
            Ok(Read::Complete(b)) => (Some(b.clone()), full(b)),
            Ok(Read::TooLarge(prefix, rest)) => (None, stream(Prefixed::new(prefix, rest))),
            Err(_) => {
                self.finish(exec, Outcome::NoResponse).await;
                let problem = Problem::new(Kind::UpstreamUnavailable, "the upstream response broke off");
                return (Err(problem.operation(op)), false);
            }
        };
        strip_hop_by_hop(&mut head.headers);
        let stored = StoredResponse {
            status: head.status.as_u16(),
            headers: storable_headers(&head.headers),
            body: stored_body,
        };
        let completed = match self.finish(exec, Outcome::Response(stored)).await {
            Some(Finished::Completed { expires_at }) => {
                head.headers.insert(IDEMPOTENCY_EXPIRES, rfc3339(expires_at));
                if route.status.is_some() {
                    // SPEC 8: the first response of an asynchronous procedure is `processing`.
                    head.headers
                        .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("processing"));
                }
                true
            }
            _ => false,
        };
        head.headers.insert(OPERATION_ID, header_value(&op));
        (Ok(Response::from_parts(head, rest)), completed)
    }

    /// Forwards without deduplication.
    async fn forward(
        &self,
        route: &Route,
        parts: http::request::Parts,
        body: Bytes,
        peer: SocketAddr,
        principal: Option<&Principal>,
    ) -> Result<Response<Body>, Problem> {
        let resp = self
            .call_upstream(route, parts, body, peer, principal, None)
            .await?;
        let (mut head, body) = resp.into_parts();
        strip_hop_by_hop(&mut head.headers);
        Ok(Response::from_parts(head, stream(body)))
    }

    async fn call_upstream(
        &self,
        route: &Route,
        mut parts: http::request::Parts,
        body: Bytes,
        peer: SocketAddr,
        principal: Option<&Principal>,
        dedup: Option<(&str, &Execution<AnyStore>)>,
    ) -> Result<Response<UpstreamBody>, Problem> {
        let uri = upstream_uri(&route.upstream.base, &parts.uri)
            .map_err(|()| Problem::new(Kind::BadRequest, "the request target cannot be forwarded"))?;
        let headers = &mut parts.headers;
        strip_hop_by_hop(headers);
        self.set_identity_headers(headers, principal);
        if let Some(host) = headers.remove(header::HOST) {
            headers.insert(HeaderName::from_static("x-forwarded-host"), host);
        }
        headers.append(
            HeaderName::from_static("x-forwarded-for"),
            forwarded_for(peer.ip()),
        );
        headers.insert(
            HeaderName::from_static("x-forwarded-proto"),
            HeaderValue::from_static("http"),
        );
        if let Some((key, exec)) = dedup {
            // The upstream sees the namespaced key, so its own dedup (if any) is tenant-safe too.
            headers.insert(route.header.clone(), header_value(key));
            headers.insert(OPERATION_ID, header_value(exec.operation_id()));
        }
        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        let req = Request::from_parts(parts, Full::new(body));
        // Asked right before the request is written, after any wait for a connection: a
        // gateway paused past its lease since `begin` must not run the operation another
        // replica may have taken over and run (`Execution::lease_held`).
        let withdrawn = || dedup.is_some_and(|(_, exec)| !exec.lease_held());
        // Tokio's clock, which the bound runs on (the same as `Instant::now` unless a test
        // paused it).
        let timer = tokio::time::Instant::now();
        let answer = self
            .client
            .request_unless(req, &withdrawn, timer.checked_add(route.upstream.timeout))
            .await;
        self.metrics
            .upstream_latency(&route.id, timer.elapsed().as_secs_f64());
        match answer {
            Ok(resp) => Ok(resp),
            Err(crate::upstream::Error::Withdrawn) => Err(lease_lost()),
            Err(crate::upstream::Error::Timeout) => {
                Err(Problem::new(Kind::UpstreamTimeout, "the upstream did not answer in time").retry_after(1))
            }
            Err(e) => {
                tracing::warn!(upstream = %route.upstream.name, error = %e, "upstream request failed");
                Err(
                    Problem::new(Kind::UpstreamUnavailable, "the upstream could not be reached")
                        .retry_after(1),
                )
            }
        }
    }
}

/// The answer when the lease ran out before the upstream was called (`Execution::lease_held`):
/// the key may be another attempt's now, and a retry gets that attempt's outcome.
fn lease_lost() -> Problem {
    Problem::new(
        Kind::RequestInFlight,
        "the lease on this key ran out before the request reached the upstream; another attempt may hold it",
    )
    .retry_after(1)
}

impl Gateway {
    /// Resolves the caller; a presented but invalid credential is a 401.
    async fn identify(&self, headers: &HeaderMap, peer: SocketAddr) -> Result<Option<Principal>, Problem> {
        let Some(identity) = &self.config.identity else {
            return Ok(None);
        };
        // Boxed: resolving may fetch a JWKS, a large future that would otherwise set the size
        // of every request's future, identified or not (hyper moves that future per request).
        Box::pin(identity.resolve(headers, peer.ip()))
            .await
            .map_err(|r| Problem::new(Kind::Unauthenticated, r.0))
    }

    /// Removes every client-sent identity header, then states the resolved principal.
    pub(crate) fn set_identity_headers(&self, headers: &mut HeaderMap, principal: Option<&Principal>) {
        let stated = [
            identity::TENANT_HEADER,
            identity::PROJECT_HEADER,
            identity::SUBJECT_HEADER,
        ];
        // One pass over the names the client sent (compared, not hashed) instead of three
        // hashed removals of names that are almost never there.
        if headers.keys().any(|n| stated.contains(n)) {
            for name in stated {
                headers.remove(name);
            }
        }
        if let Some(id) = &self.config.identity {
            for name in id.inbound_headers() {
                headers.remove(name);
            }
        }
        if let Some(p) = principal {
            headers.insert(identity::TENANT_HEADER, header_value(&p.tenant));
            headers.insert(identity::PROJECT_HEADER, header_value(&p.project));
            headers.insert(identity::SUBJECT_HEADER, header_value(&p.subject));
        }
    }
}

/// A request on its way upstream: where it goes, what it carries, who sent it.
struct Call {
    route: Arc<Route>,
    parts: http::request::Parts,
    body: Bytes,
    peer: SocketAddr,
    principal: Option<Principal>,
}

/// The case-A fingerprint: route, method, normalized path and query, body.
pub(crate) fn request_fingerprint(route: &Route, parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    Fingerprint::compute(&route.id, parts.method.as_str(), pq, content_type, body)
}

/// The namespaced key for a route and caller; a scope that needs a principal without one is 401.
pub(crate) fn namespace(route: &Route, principal: Option<&Principal>, raw: &str) -> Result<String, Problem> {
    // The route's own project, if it names one, stands in for the caller's; borrowed, as the
    // rest of the principal (copying it was three allocations per keyed request).
    let caller = principal.map(|p| {
        let project = route.project.as_deref().unwrap_or(&p.project);
        (p.tenant.as_str(), project, p.subject.as_str())
    });
    namespaced_key_of(route.scope, caller, raw).map_err(|_| {
        Problem::new(
            Kind::Unauthenticated,
            "this endpoint needs an authenticated caller",
        )
    })
}

/// A store call of a deduplicating request failed: logs it and applies the route's
/// `on_store_error`. `Ok` is fail-open (the caller goes on without deduplication), `Err` the
/// 503 to answer.
pub(crate) fn store_failed(route: &Route, e: &StoreError, log: &mut AccessLog) -> Result<(), Problem> {
    log.store_error = true;
    tracing::warn!(error = %e, endpoint = %route.id, "store error");
    match route.on_store_error {
        OnStoreError::FailClosed => {
            Err(Problem::new(Kind::StoreUnavailable, "the idempotency store is unavailable").retry_after(1))
        }
        OnStoreError::FailOpen => {
            log.outcome = "fail_open";
            Ok(())
        }
    }
}

fn not_retained(status: u16, operation_id: String) -> Problem {
    Problem::new(
        Kind::ResponseNotRetained,
        format!("the original request completed with status {status}, but its body was too large to keep"),
    )
    .operation(operation_id)
}

fn invalid_key(e: &KeyError) -> Problem {
    Problem::new(Kind::InvalidKey, e.to_string()).reason(e.reason.as_str())
}

fn policy_name(p: PolicyKind) -> &'static str {
    match p {
        PolicyKind::Required => "required",
        PolicyKind::Accepted => "accepted",
        PolicyKind::Prohibited => "prohibited",
        PolicyKind::Webhook => "webhook",
        PolicyKind::HandlerInternal => "handler_internal",
    }
}
