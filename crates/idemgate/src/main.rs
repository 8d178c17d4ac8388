//! The `idemgate` command line (SPEC 12): `serve`, `check`, `records`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use idemgate::config::{Config, StoreKind};
use idemgate::proxy::Gateway;
use idemgate::store::AnyStore;
use idemgate_core::store::Store;

/// Exit status for a configuration error (sysexits EX_USAGE), as linkerd and friends do.
const EXIT_CONFIG: u8 = 64;

#[derive(Parser)]
#[command(
    name = "idemgate",
    version,
    about = "An idempotency gateway: retries become exactly-once effects."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// The configuration file.
        #[arg(long, conflicts_with = "upstream")]
        config: Option<PathBuf>,
        /// Without a config: proxy to this URL with one catch-all `accepted` route for POST and
        /// PATCH, global scope, embedded store in ./idemgate-data.
        #[arg(long, required_unless_present = "config")]
        upstream: Option<String>,
        /// Listen address (overrides the file's server.listen).
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Validate a configuration and print its route table; exits 64 when it is refused.
    Check {
        #[arg(long)]
        config: PathBuf,
    },
    /// Print an OpenAPI 3.1 document of the client-facing routes, with each one's policy.
    Openapi {
        #[arg(long)]
        config: PathBuf,
    },
    /// Inspect or purge a record of a stopped gateway's embedded store.
    Records {
        #[command(subcommand)]
        action: RecordsAction,
    },
}

#[derive(Subcommand)]
enum RecordsAction {
    /// Print a record (without its body) as JSON.
    Inspect {
        key: String,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Delete a record (the escape hatch for `outcome-unknown` or a cached terminal error).
    Purge {
        key: String,
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { config } => check(&config),
        Command::Serve {
            config,
            upstream,
            listen,
        } => {
            let loaded = match (config, upstream) {
                (Some(path), _) => Config::load(&path).map(|mut c| {
                    if let Some(l) = listen {
                        c.listen = l;
                    }
                    c
                }),
                (None, Some(url)) => Config::for_upstream(&url, listen),
                (None, None) => unreachable!("clap requires one of them"),
            };
            match loaded {
                Ok(config) => run(config),
                Err(e) => {
                    eprintln!("idemgate: {e}");
                    ExitCode::from(EXIT_CONFIG)
                }
            }
        }
        Command::Records { action } => records(action),
        Command::Openapi { config } => match Config::load(&config) {
            Ok(c) => {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&idemgate::openapi::document(&c)).unwrap_or_default()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("idemgate: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
        },
    }
}

fn check(path: &std::path::Path) -> ExitCode {
    match Config::load(path) {
        Ok(config) => {
            println!(
                "{:<20} {:<12} {:<40} {:<16} {:<8} RETENTION",
                "ID", "METHOD", "PATH", "POLICY", "SCOPE"
            );
            for r in config.routes.iter() {
                println!(
                    "{:<20} {:<12} {:<40} {:<16} {:<8} {}",
                    r.id,
                    r.methods.to_string(),
                    r.path.to_string(),
                    format!("{:?}", r.policy).to_lowercase(),
                    r.scope.as_str(),
                    humantime::format_duration(r.engine.retention)
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idemgate: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn run(config: Config) -> ExitCode {
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEMGATE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    runtime().block_on(async move {
        let store = match AnyStore::open(&config.store) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, source = ?std::error::Error::source(&e), "cannot open the store");
                return ExitCode::FAILURE;
            }
        };
        let listener = match tokio::net::TcpListener::bind(config.listen).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, listen = %config.listen, "cannot listen");
                return ExitCode::FAILURE;
            }
        };
        tracing::info!(listen = %config.listen, store = ?config.store.kind, "idemgate listening");
        let gateway = Arc::new(Gateway::new(config, store));
        idemgate::server::serve(gateway, listener, idemgate::server::shutdown_signal()).await;
        ExitCode::SUCCESS
    })
}

fn records(action: RecordsAction) -> ExitCode {
    let (key, config, purge) = match action {
        RecordsAction::Inspect { key, config } => (key, config, false),
        RecordsAction::Purge { key, config } => (key, config, true),
    };
    let store_config = match config.as_deref().map(Config::load).transpose() {
        Ok(c) => c.map_or_else(
            || Config::for_upstream("http://127.0.0.1", None).map(|c| c.store),
            |c| Ok(c.store),
        ),
        Err(e) => Err(e),
    };
    let store_config = match store_config {
        Ok(s) if s.kind == StoreKind::Embedded => s,
        Ok(_) => {
            eprintln!("idemgate: records works on the embedded store of a stopped gateway");
            return ExitCode::from(EXIT_CONFIG);
        }
        Err(e) => {
            eprintln!("idemgate: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    runtime().block_on(async move {
        let store = match idemgate_stores::EmbeddedStore::open(&store_config.path) {
            Ok(s) => s,
            Err(e) => {
                eprintln!(
                    "idemgate: cannot open {} (is a gateway running on it?): {e}",
                    store_config.path.display()
                );
                return ExitCode::FAILURE;
            }
        };
        let result = if purge {
            store
                .purge(&key)
                .await
                .map(|existed| serde_json::json!({ "purged": existed }))
        } else {
            store
                .get(&key, idemgate_core::record::now_millis())
                .await
                .map(|r| match r {
                    None => serde_json::Value::Null,
                    Some(r) => describe(&r),
                })
        };
        match result {
            Ok(v) => {
                println!("{v}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("idemgate: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

fn describe(r: &idemgate_core::Record) -> serde_json::Value {
    let (state, status, lease_until) = match &r.state {
        idemgate_core::RecordState::InFlight { lease_until, .. } => ("in_flight", None, Some(*lease_until)),
        idemgate_core::RecordState::Completed { response, .. } => ("completed", Some(response.status), None),
    };
    serde_json::json!({
        "state": state,
        "status": status,
        "lease_until_ms": lease_until,
        "route": r.route,
        "operation_id": r.operation_id,
        "fingerprint": r.fingerprint.to_hex(),
        "created_at_ms": r.created_at,
        "expires_at_ms": r.expires_at,
        "generation": r.generation,
    })
}
