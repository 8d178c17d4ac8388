//! A Restate service for idemgate's integration tests (`crates/idemgate/tests/restate.rs`).
//!
//! `restate-test-service ADDR` serves the Restate endpoint protocol on `ADDR` with one service,
//! `Checkout`, whose handlers count their executions by printing one line per run to stdout
//! (`executed {handler} tenant={X-Tenant-Id} name={body's name} `); the test reads those lines back, so counting needs
//! no second channel and survives the handler being cut off mid-way.
//!
//! - `create`: waits `delay_ms` from the JSON body (so duplicates overlap), then answers
//!   `{"tenant", "name", "invocation"}`: the tenant as idemgate stated it in `X-Tenant-Id`, the
//!   body's `name`, and the invocation id.
//! - `fail`: a terminal error (status 409), which Restate caches like a success.
//! - `stuck`: waits `delay_ms`, long enough for a recovery request to find it running.

use std::time::Duration;

use restate_sdk::prelude::*;
use serde_json::{Value, json};

struct Checkout;

/// A request header as the handler sees it, `-` when absent.
fn header(ctx: &Context<'_>, name: &str) -> String {
    ctx.headers()
        .get(name)
        .map_or_else(|| "-".to_owned(), Clone::clone)
}

/// One line per execution: the test's counter.
fn executed(handler: &str, ctx: &Context<'_>, input: &Value) {
    println!(
        "executed {handler} tenant={} name={} ",
        header(ctx, "x-tenant-id"),
        input.get("name").and_then(Value::as_str).unwrap_or("-"),
    );
}

/// Waits the body's `delay_ms` (outside the journal: a test knob, not business logic).
async fn delay(input: &Value) {
    let ms = input.get("delay_ms").and_then(Value::as_u64).unwrap_or(0);
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

#[service]
impl Checkout {
    #[handler]
    async fn create(&self, ctx: Context<'_>, Json(input): Json<Value>) -> Result<Json<Value>, TerminalError> {
        executed("create", &ctx, &input);
        delay(&input).await;
        Ok(Json(json!({
            "tenant": header(&ctx, "x-tenant-id"),
            "name": input.get("name").cloned().unwrap_or(Value::Null),
            "invocation": ctx.invocation_id(),
        })))
    }

    #[handler]
    async fn fail(&self, ctx: Context<'_>, Json(input): Json<Value>) -> Result<Json<Value>, TerminalError> {
        executed("fail", &ctx, &input);
        Err(TerminalError::new_with_code(409, "insufficient funds"))
    }

    #[handler]
    async fn stuck(&self, ctx: Context<'_>, Json(input): Json<Value>) -> Result<Json<Value>, TerminalError> {
        executed("stuck", &ctx, &input);
        delay(&input).await;
        Ok(Json(json!({"done": true})))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:9080".into());
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .unwrap_or_else(|e| panic!("cannot listen on {addr}: {e}"));
    println!(
        "listening {}",
        listener.local_addr().map(|a| a.to_string()).unwrap_or(addr)
    );
    HttpServer::new(Endpoint::builder().bind(Checkout).build())
        .serve(listener)
        .await;
}
