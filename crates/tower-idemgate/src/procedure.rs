//! Procedure hooks (SPEC section 8, the Fundament design): how a route finds the resource its
//! first response created, and how it asks for that resource's asynchronous status, so that
//! replays carry `Idempotency-Status: processing | completed | failed`.
//!
//! Creating a resource is often not one atomic step: the row exists, but authorization tuples,
//! provisioning or notifications follow asynchronously. A client that retries after a lost
//! response gets the original response back *and* learns how far the follow-up work has come,
//! without tracking the resource id and polling a separate endpoint itself.
//!
//! The rules, as the layer applies them:
//!
//! - only 2xx outcomes carry the header (only they created something);
//! - the first response always says `processing`;
//! - a replay extracts the resource id from the stored response and asks
//!   [`Procedure::resolve`], bounded by [`RESOLVE_TIMEOUT`]; when the id is missing, the
//!   resolver fails or times out, the header falls back to `processing` and a warning is logged.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idemgate_core::record::StoredResponse;

/// The error a resolver may return; it is logged, never shown to the client.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed resolver future (procedures are held as trait objects, one per layer).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How long a replay waits for [`Procedure::resolve`] before answering `processing`.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// The asynchronous state of a created resource, as sent in `Idempotency-Status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResourceStatus {
    /// Created, follow-up work still running.
    Processing,
    /// Follow-up work done.
    Completed,
    /// Follow-up work failed.
    Failed,
}

impl ResourceStatus {
    /// The header value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Processing => "processing",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }
}

/// A route's hooks: extract the created resource's id, resolve its status.
pub trait Procedure: Send + Sync + 'static {
    /// The id of the resource the stored (first) response created, if any.
    fn resource_id(&self, response: &StoredResponse) -> Option<String>;

    /// The resource's current status.
    ///
    /// # Errors
    /// Any failure; the layer logs it and answers `processing`.
    fn resolve<'a>(&'a self, resource_id: &'a str) -> BoxFuture<'a, Result<ResourceStatus, BoxError>>;
}

/// A [`Procedure`] that reads the id at a JSON pointer of the response body (`/id`,
/// `/data/order/id`; strings and numbers) and resolves it with an async closure.
///
/// ```
/// use idemgate_core::record::StoredResponse;
/// use tower_idemgate::procedure::{JsonPointer, Procedure, ResourceStatus};
///
/// let proc = JsonPointer::new("/order/id", |id: String| async move {
///     Ok(if id == "ord_1" { ResourceStatus::Completed } else { ResourceStatus::Processing })
/// });
/// let stored = StoredResponse {
///     status: 201,
///     headers: vec![],
///     body: Some(r#"{"order":{"id":"ord_1"}}"#.into()),
/// };
/// assert_eq!(proc.resource_id(&stored).as_deref(), Some("ord_1"));
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// assert_eq!(proc.resolve("ord_1").await.unwrap(), ResourceStatus::Completed);
/// # });
/// ```
pub struct JsonPointer<F> {
    pointer: String,
    resolve: F,
}

impl<F> JsonPointer<F> {
    /// Reads the id at `pointer` (RFC 6901), resolves it with `resolve`.
    pub fn new(pointer: impl Into<String>, resolve: F) -> Self {
        Self {
            pointer: pointer.into(),
            resolve,
        }
    }
}

impl<F> std::fmt::Debug for JsonPointer<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonPointer")
            .field("pointer", &self.pointer)
            .finish_non_exhaustive()
    }
}

impl<F, Fut> Procedure for JsonPointer<F>
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<ResourceStatus, BoxError>> + Send + 'static,
{
    fn resource_id(&self, response: &StoredResponse) -> Option<String> {
        let body = response.body.as_ref()?;
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        match value.pointer(&self.pointer)? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    }

    fn resolve<'a>(&'a self, resource_id: &'a str) -> BoxFuture<'a, Result<ResourceStatus, BoxError>> {
        Box::pin((self.resolve)(resource_id.to_owned()))
    }
}

/// The `Idempotency-Status` of a replay: resolved, or `processing` with a warning.
pub(crate) async fn replay_status(procedure: &dyn Procedure, response: &StoredResponse) -> ResourceStatus {
    let Some(id) = procedure.resource_id(response) else {
        tracing::warn!(
            "replay: no resource id in the stored response; Idempotency-Status falls back to processing"
        );
        return ResourceStatus::Processing;
    };
    match tokio::time::timeout(RESOLVE_TIMEOUT, procedure.resolve(&id)).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "replay: status resolution failed; Idempotency-Status falls back to processing");
            ResourceStatus::Processing
        }
        Err(_) => {
            tracing::warn!(
                "replay: status resolution timed out; Idempotency-Status falls back to processing"
            );
            ResourceStatus::Processing
        }
    }
}
