//! The counting app most tests serve: `POST /orders` counts, waits at a gate, answers 201
//! (`x-panic` makes it panic), behind a given layer, with a signal when the server drops a
//! request's future.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use idemgate_core::store::Store;
use tower_idemgate::IdempotencyLayer;

use super::{Counter, Gate, serve};

#[derive(Clone)]
pub struct App {
    pub executions: Arc<Counter>,
    pub finished: Arc<Counter>,
    pub dropped: Arc<Counter>,
    pub gate: Arc<Gate>,
}

pub async fn handler(State(app): State<App>, headers: HeaderMap) -> (StatusCode, String) {
    let n = app.executions.bump();
    if headers.contains_key("x-panic") {
        panic!("the handler panicked (on purpose)");
    }
    app.gate.pass().await;
    app.finished.bump();
    (
        StatusCode::CREATED,
        serde_json::json!({"id": format!("ord_{n}")}).to_string(),
    )
}

pub struct DropSignal(Arc<Counter>);
impl Drop for DropSignal {
    fn drop(&mut self) {
        self.0.bump();
    }
}

pub async fn start<St: Store, P: tower_idemgate::PrincipalSource + Clone>(
    layer: IdempotencyLayer<St, P>,
    gate: Arc<Gate>,
) -> (String, App) {
    let app = App {
        executions: Arc::default(),
        finished: Arc::default(),
        dropped: Arc::default(),
        gate,
    };
    let dropped = app.dropped.clone();
    let router = Router::new()
        .route("/orders", post(handler))
        .route_layer(layer)
        // Outermost: signals when the server drops a request's future (the client went away).
        .layer(axum::middleware::from_fn(
            move |req, next: axum::middleware::Next| {
                let signal = DropSignal(dropped.clone());
                async move {
                    let resp = next.run(req).await;
                    std::mem::forget(signal); // completed normally: no signal
                    resp
                }
            },
        ))
        .with_state(app.clone());
    let addr = serve(router).await;
    (format!("http://{addr}/orders"), app)
}
