//! [`IdempotencyInfo`]: what the layer tells the inner service about a deduplicated request.

/// Inserted into the request extensions of every execution the layer lets through with a key,
/// so a handler can log the operation id or pass the namespaced key on to a downstream service
/// that deduplicates too (as the gateway does with its upstream).
///
/// ```
/// # use tower_idemgate::IdempotencyInfo;
/// async fn handler(info: Option<axum::Extension<IdempotencyInfo>>) -> String {
///     info.map(|i| i.operation_id.clone()).unwrap_or_default()
/// }
/// # let _ = handler;
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyInfo {
    /// The namespaced store key (`t-{tenant}:{project}:{subject}:{raw}`). Treat it as secret-ish:
    /// it contains the caller's raw key.
    pub key: String,
    /// The record's operation id, also sent as `x-operation-id`.
    pub operation_id: String,
}
