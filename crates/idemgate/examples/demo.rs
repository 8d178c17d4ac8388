//! The README's first command: the gateway on its embedded default store (`./idemgate-data`),
//! listening on 127.0.0.1:8080, in front of the counting demo upstream on 127.0.0.1:3000.
//!
//! Run with: `cargo run -p idemgate --example demo`, then follow the curl tour in the README.
//! Ctrl-C stops both.

use std::sync::Arc;

use idemgate::config::Config;
use idemgate::demo::{Counts, serve as serve_upstream};
use idemgate::proxy::Gateway;
use idemgate::store::AnyStore;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .init();
    let config = Config::from_yaml(include_str!("demo.yaml"))?;
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    tokio::spawn(serve_upstream(upstream, Arc::new(Counts::default())));
    let store = AnyStore::open(&config.store)?;
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    eprintln!(
        "demo upstream on http://127.0.0.1:3000, idemgate on http://{}",
        config.listen
    );
    let gateway = Arc::new(Gateway::new(config, store));
    idemgate::server::serve(gateway, listener, idemgate::server::shutdown_signal()).await;
    Ok(())
}
