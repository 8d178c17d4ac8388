//! The retrying client helper (feature `client`): one key per logical intent, safe retries.
//!
//! A caller that retries without a key risks running an operation twice; a caller that makes up
//! a new key per attempt gets no protection at all. [`IdempotentClient`] does the one right
//! thing: a fresh UUIDv7 key per logical intent ([`IdempotentClient::send`]), reused verbatim on
//! every attempt, and retries only what a retry can fix:
//!
//! | answer | retried? |
//! |---|---|
//! | connection error, timeout, reset mid-request | yes (the key makes it safe) |
//! | `409` with problem type `request-in-flight` | yes, after `Retry-After` |
//! | `429`, `502`, `503`, `504` | yes, after `Retry-After` if given |
//! | `422 idempotency-key-reused` and every other 4xx | never: the request itself is wrong |
//! | other `409`s (`response-not-retained`, `outcome-unknown`) | never: a retry cannot change them |
//! | 2xx, 3xx, other 5xx | returned as they are |
//!
//! Delays are exponential with full jitter (a random delay between zero and
//! `min(max_delay, base * 2^attempt)`), so a fleet of clients that failed together does not
//! retry together; a `Retry-After` in seconds raises the delay to at least that (bounded by
//! `max_delay`).

use std::time::Duration;

use bytes::Bytes;
use http::HeaderName;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use reqwest::{RequestBuilder, Response, StatusCode};

use crate::idempotency::IDEMPOTENCY_KEY;

/// A fresh key for one logical intent: a UUIDv7 (time-ordered, 74 random bits).
///
/// ```
/// let (a, b) = (tower_idemgate::client::new_key(), tower_idemgate::client::new_key());
/// assert_ne!(a, b);
/// assert_eq!(a.len(), 36);
/// ```
#[must_use]
pub fn new_key() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// How often and how patiently to retry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 5).
    pub max_attempts: u32,
    /// The backoff base (default 100 ms).
    pub base_delay: Duration,
    /// The longest single delay, `Retry-After` included (default 10 s).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
        }
    }
}

impl RetryPolicy {
    /// The delay before retry number `retry` (0 for the first retry): full jitter over the
    /// exponential bound, raised to `retry_after` when the server sent one.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idemgate::client::RetryPolicy;
    ///
    /// let p = RetryPolicy::default();
    /// for retry in 0..20 {
    ///     assert!(p.delay(retry, None) <= p.max_delay);
    /// }
    /// assert!(p.delay(0, None) <= Duration::from_millis(100));
    /// assert!(p.delay(0, Some(Duration::from_secs(2))) >= Duration::from_secs(2));
    /// assert_eq!(p.delay(0, Some(Duration::from_secs(60))), p.max_delay);
    /// ```
    #[must_use]
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let bound = self
            .base_delay
            .saturating_mul(2u32.saturating_pow(retry.min(30)))
            .min(self.max_delay);
        let jitter = Duration::from_nanos(rand::random_range(
            0..=u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX),
        ));
        jitter.max(retry_after.unwrap_or_default()).min(self.max_delay)
    }
}

/// Why [`IdempotentClient::send`] gave up without a response.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The request could not be built.
    #[error("the request could not be built")]
    Build(#[source] reqwest::Error),
    /// The key is not a valid header value (keys must be visible ASCII).
    #[error("the idempotency key is not a valid header value")]
    InvalidKey,
    /// The body is a stream and cannot be sent twice; buffer it to make it retryable.
    #[error("the request body cannot be cloned for a retry")]
    NotRetryable,
    /// Every attempt failed in transport; the last error.
    #[error("no response after {attempts} attempts")]
    Transport {
        /// Attempts made.
        attempts: u32,
        /// The last transport error.
        #[source]
        source: reqwest::Error,
    },
}

/// A reqwest client that sends an idempotency key and retries safely.
///
/// ```no_run
/// use tower_idemgate::client::IdempotentClient;
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let client = IdempotentClient::new(reqwest::Client::new());
/// let http = client.inner();
/// // One logical intent: one key, however many attempts it takes.
/// let resp = client
///     .send(http.post("http://127.0.0.1:3000/orders").body(r#"{"amount":100}"#))
///     .await?;
/// println!("{} (replayed: {:?})", resp.status(), resp.headers().get("idempotent-replayed"));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct IdempotentClient {
    client: reqwest::Client,
    retry: RetryPolicy,
    header: HeaderName,
}

impl IdempotentClient {
    /// Wraps `client` with the default [`RetryPolicy`] and the `Idempotency-Key` header.
    #[must_use]
    pub fn new(client: reqwest::Client) -> Self {
        Self {
            client,
            retry: RetryPolicy::default(),
            header: IDEMPOTENCY_KEY,
        }
    }

    /// Replaces the retry policy.
    #[must_use]
    pub fn retry_policy(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Sends the key in another header.
    #[must_use]
    pub fn header(mut self, name: HeaderName) -> Self {
        self.header = name;
        self
    }

    /// The wrapped client, to build requests with.
    #[must_use]
    pub fn inner(&self) -> &reqwest::Client {
        &self.client
    }

    /// Sends one logical intent under a fresh key ([`new_key`]).
    ///
    /// # Errors
    /// See [`ClientError`]. A response of any status is `Ok`.
    pub async fn send(&self, request: RequestBuilder) -> Result<Response, ClientError> {
        self.send_with_key(&new_key(), request).await
    }

    /// Sends one logical intent under `key` (a key the caller persisted, say, to survive its
    /// own restart).
    ///
    /// # Errors
    /// See [`ClientError`]. A response of any status is `Ok`.
    pub async fn send_with_key(&self, key: &str, request: RequestBuilder) -> Result<Response, ClientError> {
        let mut request = request.build().map_err(ClientError::Build)?;
        let value = http::HeaderValue::from_str(key).map_err(|_| ClientError::InvalidKey)?;
        request.headers_mut().insert(self.header.clone(), value);
        let attempts = self.retry.max_attempts.max(1);
        for attempt in 1..=attempts {
            let last = attempt == attempts;
            // Each attempt sends a copy: the original stays for the next one.
            let this = request.try_clone().ok_or(ClientError::NotRetryable)?;
            let retry_after = match self.client.execute(this).await {
                Err(e) if last || e.is_builder() => {
                    return Err(ClientError::Transport {
                        attempts: attempt,
                        source: e,
                    });
                }
                Err(e) => {
                    tracing::debug!(error = %e, attempt, "transport error; retrying with the same key");
                    None
                }
                Ok(resp) if last => return Ok(resp),
                Ok(resp) => match verdict(resp).await {
                    Verdict::Done(resp) => return Ok(resp),
                    Verdict::Retry(after) => after,
                },
            };
            tokio::time::sleep(self.retry.delay(attempt - 1, retry_after)).await;
        }
        unreachable!("the last attempt returns")
    }
}

enum Verdict {
    Done(Response),
    Retry(Option<Duration>),
}

async fn verdict(resp: Response) -> Verdict {
    let retry_after = resp
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    match resp.status() {
        StatusCode::TOO_MANY_REQUESTS
        | StatusCode::BAD_GATEWAY
        | StatusCode::SERVICE_UNAVAILABLE
        | StatusCode::GATEWAY_TIMEOUT => Verdict::Retry(retry_after),
        StatusCode::CONFLICT => {
            // Only `request-in-flight` is worth waiting for; the body says which 409 it is, so
            // read it and hand back an identical response when it is another one.
            let is_problem = resp
                .headers()
                .get(CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
            if !is_problem {
                return Verdict::Done(resp);
            }
            let (status, version, headers) = (resp.status(), resp.version(), resp.headers().clone());
            let body = resp.bytes().await.unwrap_or_default();
            if problem_slug(&body).as_deref() == Some("request-in-flight") {
                return Verdict::Retry(retry_after);
            }
            let mut rebuilt = http::Response::new(body);
            *rebuilt.status_mut() = status;
            *rebuilt.version_mut() = version;
            *rebuilt.headers_mut() = headers;
            Verdict::Done(Response::from(rebuilt))
        }
        _ => Verdict::Done(resp),
    }
}

fn problem_slug(body: &Bytes) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let ty = value.get("type")?.as_str()?;
    Some(ty.rsplit('/').next()?.to_owned())
}
