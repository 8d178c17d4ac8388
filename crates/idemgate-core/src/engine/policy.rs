//! The per-route knobs of the lifecycle (SPEC section 4), and which outcomes and response
//! headers are kept for replay.

use std::time::Duration;

/// What to do when a second request finds the key in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Concurrency {
    /// Wait for the owner (by notification) up to `wait_timeout`, then replay its outcome.
    #[default]
    Wait,
    /// Answer `request-in-flight` at once.
    Reject,
}

/// What to do when an owner's lease ran out before it finished (the owner died).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LeaseExpiry {
    /// Take the key over with a new lease: the operation runs again.
    #[default]
    Retry,
    /// Answer `outcome-unknown` until an operator purges the record (money movement).
    Fail,
}

/// The per-route knobs of the lifecycle (SPEC section 4).
#[derive(Clone, Debug)]
pub struct Policy {
    pub retention: Duration,
    pub lease: Duration,
    pub concurrent: Concurrency,
    pub wait_timeout: Duration,
    pub on_lease_expiry: LeaseExpiry,
    /// Store 5xx outcomes instead of releasing the key (Stripe style).
    pub store_server_errors: bool,
    pub max_response_bytes: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            concurrent: Concurrency::Wait,
            wait_timeout: Duration::from_secs(10),
            on_lease_expiry: LeaseExpiry::Retry,
            store_server_errors: false,
            max_response_bytes: 1024 * 1024,
        }
    }
}

/// Whether an upstream status is a final outcome to store, or transient (release the key).
///
/// Final: 2xx, 3xx, and 4xx other than 408, 425 and 429; 5xx only with `store_server_errors`.
#[must_use]
pub fn is_final(status: u16, store_server_errors: bool) -> bool {
    match status {
        408 | 425 | 429 => false,
        200..=499 => true,
        500..=599 => store_server_errors,
        _ => false,
    }
}

/// Response headers that are kept for replay. Everything else is dropped: `Set-Cookie` (a
/// session must never be handed to a retry), hop-by-hop headers, and anything per-connection.
const STORED_HEADERS: &[&str] = &[
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-location",
    "content-type",
    "etag",
    "expires",
    "last-modified",
    "link",
    "location",
    "retry-after",
    "vary",
    "x-request-id",
];

/// Whether a response header (lowercase name) is kept for replay.
#[must_use]
pub fn is_storable_header(name: &str) -> bool {
    STORED_HEADERS.contains(&name)
}
