//! Prometheus metrics (SPEC 12) and the per-route counters behind `/admin/stats`.
//!
//! Every request's counters are derived in one place, [`Metrics::observe`], from the facts its
//! [`AccessLog`] gathered, so the log line, the metrics and the stats can never disagree.
//! Latency histograms are recorded where the time is spent (store calls, upstream calls).
//!
//! Labels: `tenant`, `project`, `endpoint` (the route id) on every counter, plus the metric's own
//! (`case`, `class`, `reason`, `status`, `provider`). With `metrics.tenant_labels: false` the
//! tenant and project labels are left out, to bound cardinality.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::access_log::AccessLog;
use crate::problem::Kind;

/// A counter's labels. The endpoint is shared with the route table and the extra label is
/// usually a constant, so building the labels of a request allocates nothing unless tenant
/// labels are on.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Labels {
    tenant: Option<String>,
    project: Option<String>,
    endpoint: Arc<str>,
    extra: Option<(&'static str, Cow<'static, str>)>,
}

impl EncodeLabelSet for Labels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel;
        if let Some(t) = &self.tenant {
            ("tenant", t.as_str()).encode(encoder.encode_label())?;
        }
        if let Some(p) = &self.project {
            ("project", p.as_str()).encode(encoder.encode_label())?;
        }
        ("endpoint", &*self.endpoint).encode(encoder.encode_label())?;
        if let Some((k, v)) = &self.extra {
            (*k, v.as_ref()).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

/// A histogram's labels: `op` for the store, `endpoint` for the upstream.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct OpLabels {
    pub op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct EndpointLabels {
    pub endpoint: Arc<str>,
}

impl EncodeLabelSet for EndpointLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel;
        ("endpoint", &*self.endpoint).encode(encoder.encode_label())
    }
}

type Counters = Family<Labels, Counter>;

/// Per-route counters for `/admin/stats`.
#[derive(Debug, Default, Serialize)]
pub struct RouteStats {
    requests: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    in_flight_waits: AtomicU64,
    enforced: AtomicU64,
    invalid_key: AtomicU64,
    store_errors: AtomicU64,
    responses_stored: AtomicU64,
}

/// Handles to a route's most common series, taken from their families on first use. Only for
/// requests whose labels carry no tenant or project, where a route's label set is the same for
/// every caller. A handle
/// shares its value with the family's series, so the exposition is unchanged; what it saves is
/// hashing a label set and taking the family's lock several times per request.
#[derive(Debug, Default)]
struct Hot {
    key_present_header: OnceLock<Counter>,
    cache_miss: OnceLock<Counter>,
    /// The first replayed status seen; replays of a route nearly always share it.
    cache_hit: OnceLock<(u16, Counter)>,
    /// Requests without a key, by the first policy class seen (a route's own, nearly always).
    key_missing: OnceLock<(&'static str, Counter)>,
    upstream_seconds: OnceLock<Histogram>,
}

#[derive(Debug, Default)]
struct PerRoute {
    stats: RouteStats,
    hot: Hot,
}

/// All metrics of one gateway.
pub struct Metrics {
    registry: Registry,
    tenant_labels: bool,
    key_present: Counters,
    key_missing: Counters,
    key_invalid: Counters,
    translation_failed: Counters,
    cache_hit: Counters,
    cache_miss: Counters,
    conflict: Counters,
    store_errors: Counters,
    store_seconds: Family<OpLabels, Histogram>,
    /// `store_seconds` for `begin` and `complete`, the two calls of every miss.
    store_hot: [OnceLock<Histogram>; 2],
    upstream_seconds: Family<EndpointLabels, Histogram>,
    /// By route id, in configuration order; the id doubles as the `endpoint` label value. A
    /// list, not a map: a request's id is the configuration's own `Arc`, so finding it is a
    /// pointer comparison per route, cheaper than hashing the id (and route lookup itself scans
    /// the routes the same way).
    routes: Vec<(Arc<str>, PerRoute)>,
    /// Registered family names (for the dashboard test).
    names: Vec<&'static str>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("tenant_labels", &self.tenant_labels)
            .finish_non_exhaustive()
    }
}

fn latency() -> Histogram {
    // 100 µs to about 26 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

impl Metrics {
    /// Metrics for the given route ids.
    #[must_use]
    pub fn new(routes: impl IntoIterator<Item = Arc<str>>, tenant_labels: bool) -> Self {
        let mut registry = Registry::default();
        let mut names = Vec::new();
        let mut counter = |name: &'static str, help: &str| {
            let family = Counters::default();
            registry.register(name, help, family.clone());
            names.push(name);
            family
        };
        let key_present = counter(
            "idempotency_key_present",
            "Requests carrying an idempotency key, by case (A header, B webhook)",
        );
        let key_missing = counter(
            "idempotency_key_missing",
            "Requests without a key on a deduplicating route, by policy class",
        );
        let key_invalid = counter("idempotency_key_invalid", "Keys refused, by reason");
        let translation_failed = counter(
            "transport_translation_failed",
            "Webhook deliveries whose identifier could not be lifted, by provider",
        );
        let cache_hit = counter(
            "idempotency_cache_hit",
            "Replays of a stored outcome, by stored status",
        );
        let cache_miss = counter(
            "idempotency_cache_miss",
            "Executions: the key was new (or released) and the upstream ran",
        );
        let conflict = counter(
            "idempotency_conflict",
            "Requests refused for a key conflict, by reason",
        );
        let store_errors = counter("idempotency_store_errors", "Store errors met by requests");
        // The tower layer counts this one; the gateway cannot see inside a handler.
        let _ = counter(
            "handler_internal_dedup_hit",
            "Handler-internal (case C) dedup hits, counted by the library",
        );
        let store_seconds = Family::<OpLabels, Histogram>::new_with_constructor(latency as fn() -> Histogram);
        registry.register(
            "idempotency_store_duration_seconds",
            "Store call latency, by operation",
            store_seconds.clone(),
        );
        let upstream_seconds =
            Family::<EndpointLabels, Histogram>::new_with_constructor(latency as fn() -> Histogram);
        registry.register(
            "idempotency_upstream_duration_seconds",
            "Upstream call latency, by endpoint",
            upstream_seconds.clone(),
        );
        names.extend([
            "idempotency_store_duration_seconds",
            "idempotency_upstream_duration_seconds",
        ]);
        Self {
            registry,
            tenant_labels,
            key_present,
            key_missing,
            key_invalid,
            translation_failed,
            cache_hit,
            cache_miss,
            conflict,
            store_errors,
            store_seconds,
            store_hot: Default::default(),
            upstream_seconds,
            routes: routes.into_iter().map(|r| (r, PerRoute::default())).collect(),
            names,
        }
    }

    fn labels(
        &self,
        log: &AccessLog,
        endpoint: &Arc<str>,
        extra: Option<(&'static str, Cow<'static, str>)>,
    ) -> Labels {
        let keep = |s: &str| (self.tenant_labels && !s.is_empty()).then(|| s.to_owned());
        Labels {
            tenant: keep(&log.tenant),
            project: keep(&log.project),
            endpoint: endpoint.clone(),
            extra,
        }
    }

    /// A route's counters, found by its id: the configuration's `Arc` (a pointer comparison
    /// per route), else an equal id.
    fn route(&self, id: &Arc<str>) -> Option<&PerRoute> {
        let routes = || self.routes.iter();
        routes()
            .find(|(name, _)| Arc::ptr_eq(name, id))
            .or_else(|| routes().find(|(name, _)| **name == **id))
            .map(|(_, route)| route)
    }

    /// A route's cached handles, when this request's label sets are the route's caller-free
    /// ones: no tenant labels, or a caller without tenant and project (no identity configured).
    fn hot<'a>(&self, route: Option<&'a PerRoute>, log: &AccessLog) -> Option<&'a Hot> {
        let caller_free = !self.tenant_labels || (log.tenant.is_empty() && log.project.is_empty());
        route.filter(|_| caller_free).map(|r| &r.hot)
    }

    /// Records one finished request.
    pub fn observe(&self, log: &AccessLog, status: u16) {
        let Some(endpoint) = &log.endpoint else {
            return; // no route: nothing per endpoint to count
        };
        let route = self.route(endpoint);
        let hot = self.hot(route, log);
        let bump = |field: fn(&RouteStats) -> &AtomicU64| {
            if let Some(r) = route {
                field(&r.stats).fetch_add(1, Ordering::Relaxed);
            }
        };
        bump(|s| &s.requests);
        let series = |family: &Counters, extra: Option<(&'static str, Cow<'static, str>)>| {
            family.get_or_create(&self.labels(log, endpoint, extra)).clone()
        };
        let inc = |family: &Counters, extra: Option<(&'static str, Cow<'static, str>)>| {
            series(family, extra).inc();
        };
        if log.case != "none" {
            let slot = hot.filter(|_| log.case == "A").map(|h| &h.key_present_header);
            count(slot, || {
                series(&self.key_present, Some(("case", Cow::Borrowed(log.case))))
            });
        }
        if log.key_missing {
            // Every keyless request on an `accepted` route lands here: a cached handle spares
            // hashing its label set each time.
            count_first(hot.map(|h| &h.key_missing), log.policy, || {
                series(&self.key_missing, Some(("class", Cow::Borrowed(log.policy))))
            });
        }
        match log.outcome {
            "replayed" | "recovered" => {
                count_first(hot.map(|h| &h.cache_hit), status, || {
                    series(&self.cache_hit, Some(("status", status_label(status))))
                });
                bump(|s| &s.cache_hits);
            }
            "executed" => {
                count(hot.map(|h| &h.cache_miss), || series(&self.cache_miss, None));
                bump(|s| &s.cache_misses);
            }
            _ => {}
        }
        if log.waited {
            bump(|s| &s.in_flight_waits);
        }
        if log.stored {
            bump(|s| &s.responses_stored);
        }
        if log.store_error {
            inc(&self.store_errors, None);
            bump(|s| &s.store_errors);
        }
        let conflict = |reason: &'static str| inc(&self.conflict, Some(("reason", Cow::Borrowed(reason))));
        match log.refusal {
            Some(Kind::MissingKey | Kind::KeyNotAllowed) => {
                bump(|s| &s.enforced);
            }
            Some(Kind::InvalidKey) => {
                inc(
                    &self.key_invalid,
                    Some(("reason", Cow::Borrowed(log.reason.unwrap_or("syntax")))),
                );
                bump(|s| &s.invalid_key);
            }
            Some(Kind::TranslationFailed) => {
                inc(
                    &self.translation_failed,
                    Some(("provider", Cow::Borrowed(log.source))),
                );
            }
            Some(Kind::KeyReused) => conflict("key_reused"),
            Some(Kind::RequestInFlight) if log.outcome == "lease_lost" => conflict("lease_lost"),
            Some(Kind::RequestInFlight) => conflict("in_flight"),
            Some(Kind::OutcomeUnknown) => conflict("outcome_unknown"),
            Some(Kind::ResponseNotRetained) => conflict("not_retained"),
            _ => {}
        }
    }

    /// Records a store call's latency.
    pub fn store_latency(&self, op: &'static str, seconds: f64) {
        let series = || self.store_seconds.get_or_create(&OpLabels { op }).clone();
        match op {
            "begin" => self.store_hot[0].get_or_init(series).observe(seconds),
            "complete" => self.store_hot[1].get_or_init(series).observe(seconds),
            _ => series().observe(seconds),
        }
    }

    /// Records an upstream call's latency.
    pub fn upstream_latency(&self, endpoint: &Arc<str>, seconds: f64) {
        let route = self.route(endpoint);
        let series = || {
            self.upstream_seconds
                .get_or_create(&EndpointLabels {
                    endpoint: endpoint.clone(),
                })
                .clone()
        };
        match route {
            // The endpoint is the only label: no caller-dependent label set here.
            Some(route) => route.hot.upstream_seconds.get_or_init(series).observe(seconds),
            None => series().observe(seconds),
        }
    }

    /// The Prometheus text exposition.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The registered metric family names.
    #[must_use]
    pub fn family_names(&self) -> &[&'static str] {
        &self.names
    }

    /// Per-route counters, for `/admin/stats`.
    #[must_use]
    pub fn stats(&self) -> serde_json::Value {
        let by_route: BTreeMap<&str, &RouteStats> =
            self.routes.iter().map(|(k, v)| (&**k, &v.stats)).collect();
        serde_json::to_value(by_route).unwrap_or_default()
    }
}

/// Counts one on the cached handle when there is a slot for it, else on the family's series.
fn count(slot: Option<&OnceLock<Counter>>, series: impl FnOnce() -> Counter) {
    match slot {
        Some(slot) => slot.get_or_init(series).inc(),
        None => series().inc(),
    };
}

/// Counts one on the cached handle when it was made for this label value (the first one seen:
/// a route's replays nearly always share a status, its keyless requests a class), else on the
/// family's series.
fn count_first<T: PartialEq + Copy>(
    slot: Option<&OnceLock<(T, Counter)>>,
    value: T,
    series: impl Fn() -> Counter,
) {
    match slot.map(|slot| slot.get_or_init(|| (value, series()))) {
        Some((first, counter)) if *first == value => counter.inc(),
        _ => series().inc(),
    };
}

/// A status code as a label value; the common ones without formatting.
fn status_label(status: u16) -> Cow<'static, str> {
    Cow::Borrowed(match status {
        200 => "200",
        201 => "201",
        202 => "202",
        204 => "204",
        400 => "400",
        404 => "404",
        409 => "409",
        422 => "422",
        _ => return Cow::Owned(status.to_string()),
    })
}

/// Shared handle.
pub type SharedMetrics = Arc<Metrics>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The cached handles of a route count into the same series the families expose, with and
    /// without tenant labels.
    #[test]
    fn cached_series_and_family_series_are_the_same() {
        for tenant_labels in [false, true] {
            let metrics = Metrics::new(["r".into()], tenant_labels);
            let request = |tenant: &str, outcome: &'static str, status: u16| {
                let mut log = AccessLog::new(&http::Method::POST);
                log.endpoint = Some("r".into());
                log.case = "A";
                log.tenant = tenant.into();
                log.outcome = outcome;
                metrics.observe(&log, status);
            };
            request("acme", "executed", 201);
            request("acme", "executed", 201);
            request("acme", "replayed", 201);
            request("acme", "replayed", 200);
            // Callers without a tenant (no identity configured): the caller-free series.
            request("", "executed", 201);
            request("", "executed", 201);
            // Keyless requests: the cached handle takes the first class, the family the rest.
            let keyless = |tenant: &str, class: &'static str| {
                let mut log = AccessLog::new(&http::Method::POST);
                log.endpoint = Some("r".into());
                log.tenant = tenant.into();
                log.policy = class;
                log.key_missing = true;
                metrics.observe(&log, 201);
            };
            keyless("", "accepted");
            keyless("", "accepted");
            keyless("", "recovery");
            keyless("acme", "accepted");
            metrics.store_latency("begin", 0.001);
            metrics.store_latency("begin", 0.001);
            metrics.store_latency("release", 0.001);
            metrics.upstream_latency(&"r".into(), 0.002);
            let text = metrics.render();
            let mut expected = vec![
                "idempotency_store_duration_seconds_count{op=\"begin\"} 2",
                "idempotency_store_duration_seconds_count{op=\"release\"} 1",
                "idempotency_upstream_duration_seconds_count{endpoint=\"r\"} 1",
            ];
            if tenant_labels {
                expected.extend([
                    "idempotency_key_present_total{tenant=\"acme\",endpoint=\"r\",case=\"A\"} 4",
                    "idempotency_cache_miss_total{tenant=\"acme\",endpoint=\"r\"} 2",
                    "idempotency_cache_hit_total{tenant=\"acme\",endpoint=\"r\",status=\"201\"} 1",
                    "idempotency_cache_hit_total{tenant=\"acme\",endpoint=\"r\",status=\"200\"} 1",
                    "idempotency_key_present_total{endpoint=\"r\",case=\"A\"} 2",
                    "idempotency_cache_miss_total{endpoint=\"r\"} 2",
                    "idempotency_key_missing_total{endpoint=\"r\",class=\"accepted\"} 2",
                    "idempotency_key_missing_total{endpoint=\"r\",class=\"recovery\"} 1",
                    "idempotency_key_missing_total{tenant=\"acme\",endpoint=\"r\",class=\"accepted\"} 1",
                ]);
            } else {
                expected.extend([
                    "idempotency_key_present_total{endpoint=\"r\",case=\"A\"} 6",
                    "idempotency_cache_miss_total{endpoint=\"r\"} 4",
                    "idempotency_cache_hit_total{endpoint=\"r\",status=\"201\"} 1",
                    "idempotency_cache_hit_total{endpoint=\"r\",status=\"200\"} 1",
                    "idempotency_key_missing_total{endpoint=\"r\",class=\"accepted\"} 3",
                    "idempotency_key_missing_total{endpoint=\"r\",class=\"recovery\"} 1",
                ]);
            }
            for line in expected {
                assert!(text.contains(line), "missing {line} in\n{text}");
            }
        }
    }

    /// A 409 from a lease that ran out before the upstream was called counts apart from a
    /// request that found its key in flight.
    #[test]
    fn a_lease_lost_refusal_is_its_own_conflict_reason() {
        let metrics = Metrics::new(["r".into()], false);
        for outcome in ["lease_lost", "executed"] {
            let mut log = AccessLog::new(&http::Method::POST);
            log.endpoint = Some("r".into());
            log.case = "A";
            log.outcome = outcome;
            log.refusal = Some(Kind::RequestInFlight);
            metrics.observe(&log, 409);
        }
        let text = metrics.render();
        for line in [
            "idempotency_conflict_total{endpoint=\"r\",reason=\"lease_lost\"} 1",
            "idempotency_conflict_total{endpoint=\"r\",reason=\"in_flight\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    /// Every metric the shipped dashboard and alert rules query is one the gateway exports.
    #[test]
    fn dashboard_and_alerts_use_only_exported_metrics() {
        let metrics = Metrics::new(["r".into()], true);
        let exported = metrics.family_names();
        let docs = [
            include_str!("../../../docs/grafana/idemgate-dashboard.json"),
            include_str!("../../../docs/grafana/alerts.yaml"),
        ];
        let mut checked = 0;
        for doc in docs {
            for word in doc.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                let is_metric = word.starts_with("idempotency_") || word.starts_with("transport_");
                if !is_metric || word.ends_with("_total") && word.len() < 8 {
                    continue;
                }
                let base = word.trim_end_matches("_bucket").trim_end_matches("_total");
                assert!(exported.contains(&base), "{word} is not exported");
                checked += 1;
            }
        }
        assert!(checked > 20, "the documents reference the metrics ({checked})");
    }
}
