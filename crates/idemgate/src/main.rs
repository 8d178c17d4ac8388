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

/// mimalloc rather than glibc malloc: per-thread free lists keep short-lived request buffers
/// away from the long-lived records of the memory store, so RSS tracks live data instead of
/// fragmentation, and allocation is off the top of the request profile. Library users (the
/// tower layer) keep their own allocator: this is the binary's choice only.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        /// The namespaced key, e.g. 't-acme:p1:user%3Aalice:order-1'.
        key: String,
        #[command(flatten)]
        target: RecordsTarget,
    },
    /// Delete a record (the escape hatch for `outcome-unknown` or a cached terminal error).
    Purge {
        key: String,
        #[command(flatten)]
        target: RecordsTarget,
    },
}

/// Where the records are: a running gateway's admin API, or a stopped gateway's embedded store.
#[derive(clap::Args)]
struct RecordsTarget {
    /// The admin listener of a running gateway, e.g. http://127.0.0.1:9090.
    #[arg(long)]
    admin: Option<String>,
    /// The environment variable holding the admin token.
    #[arg(long, default_value = "IDEMGATE_ADMIN_TOKEN")]
    token_env: String,
    /// Without --admin: the config whose embedded store to open (the gateway must be stopped).
    #[arg(long, conflicts_with = "admin")]
    config: Option<PathBuf>,
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

/// The async runtime: work-stealing across cores, or a single-threaded scheduler when the
/// process may use one core only (a container limit, `taskset`): with one worker there is
/// nothing to steal, and the current-thread scheduler wakes tasks without cross-thread
/// queues. `IDEMGATE_WORKER_THREADS` sets the number of workers explicitly.
fn runtime() -> tokio::runtime::Runtime {
    let workers = std::env::var("IDEMGATE_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| *n > 0)
        .or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(std::num::NonZero::get)
        })
        .unwrap_or(1);
    let mut builder = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(workers);
        b
    };
    builder.enable_all().build().expect("tokio runtime")
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
        let admin = match &config.admin {
            Some(a) => match tokio::net::TcpListener::bind(a.listen).await {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::error!(error = %e, listen = %a.listen, "cannot listen for the admin API");
                    return ExitCode::FAILURE;
                }
            },
            None => None,
        };
        tracing::info!(listen = %config.listen, store = ?config.store.kind, "idemgate listening");
        warn_short_leases(&config);
        let gateway = Arc::new(Gateway::new(config, store));
        // SPEC 9: route retentions onto Restate services (background, retried, logged).
        tokio::spawn(idemgate::restate::apply_retention(gateway.clone()));
        let stop = tokio_util::sync::CancellationToken::new();
        if let Some(listener) = admin {
            tokio::spawn(idemgate::admin::serve(
                gateway.clone(),
                listener,
                stop.clone().cancelled_owned(),
            ));
        }
        let signal = stop.clone();
        tokio::spawn(async move {
            idemgate::server::shutdown_signal().await;
            signal.cancel();
        });
        idemgate::server::serve(gateway, listener, stop.cancelled_owned()).await;
        ExitCode::SUCCESS
    })
}

fn records(action: RecordsAction) -> ExitCode {
    let (key, target, purge) = match action {
        RecordsAction::Inspect { key, target } => (key, target, false),
        RecordsAction::Purge { key, target } => (key, target, true),
    };
    let result = match &target.admin {
        Some(url) => runtime().block_on(records_via_admin(url, &target.token_env, &key, purge)),
        None => records_offline(target.config.as_deref(), &key, purge),
    };
    match result {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err((code, e)) => {
            eprintln!("idemgate: {e}");
            ExitCode::from(code)
        }
    }
}

type CliResult = Result<serde_json::Value, (u8, String)>;

async fn records_via_admin(url: &str, token_env: &str, key: &str, purge: bool) -> CliResult {
    use http_body_util::BodyExt;
    let token = std::env::var(token_env).map_err(|_| (EXIT_CONFIG, format!("{token_env} is not set")))?;
    let encoded = percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC);
    let uri: http::Uri = format!("{}/admin/records/{encoded}", url.trim_end_matches('/'))
        .parse()
        .map_err(|e| (EXIT_CONFIG, format!("bad --admin URL: {e}")))?;
    let req = http::Request::builder()
        .method(if purge {
            http::Method::DELETE
        } else {
            http::Method::GET
        })
        .uri(uri)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .map_err(|e| (1, e.to_string()))?;
    let resp = idemgate::upstream::Upstreams::new(
        std::time::Duration::from_secs(5),
        std::time::Duration::from_secs(1),
    )
    .request(req)
    .await
    .map_err(|e| (1, format!("cannot reach the admin API: {e}")))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| (1, e.to_string()))?
        .to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    match status.as_u16() {
        200 => Ok(v),
        404 => Ok(serde_json::Value::Null),
        _ => Err((1, format!("admin API answered {status}: {v}"))),
    }
}

fn records_offline(config: Option<&std::path::Path>, key: &str, purge: bool) -> CliResult {
    let loaded = match config {
        Some(path) => Config::load(path),
        None => Config::for_upstream("http://127.0.0.1", None),
    };
    let store_config = loaded.map_err(|e| (EXIT_CONFIG, e.to_string()))?.store;
    if store_config.kind != StoreKind::Embedded {
        return Err((
            EXIT_CONFIG,
            "without --admin, records works on a stopped gateway's embedded store".into(),
        ));
    }
    runtime().block_on(async move {
        let store = idemgate_stores::EmbeddedStore::open(&store_config.path).map_err(|e| {
            (
                1,
                format!(
                    "cannot open {} (is a gateway running on it? use --admin): {e}",
                    store_config.path.display()
                ),
            )
        })?;
        if purge {
            let existed = store.purge(key).await.map_err(|e| (1, e.to_string()))?;
            Ok(serde_json::json!({ "purged": existed }))
        } else {
            let record = store
                .get(key, idemgate_core::record::now_millis())
                .await
                .map_err(|e| (1, e.to_string()))?;
            Ok(record.map_or(serde_json::Value::Null, |r| {
                idemgate::admin::describe_record(&r, false)
            }))
        }
    })
}

/// Warns of routes whose lease is not comfortably longer than a store call may take: an owner
/// does not call the upstream once less than a tenth of its lease is left (docs/lifecycle.md),
/// so there a `begin` slower than most of the lease answers `409` (`lease_lost`) instead.
fn warn_short_leases(config: &idemgate::config::Config) {
    for route in config.routes.iter() {
        let engine = &route.engine;
        if engine.on_lease_expiry == idemgate_core::engine::LeaseExpiry::Retry
            && engine.lease < config.store.timeout * 2
        {
            tracing::warn!(
                route = %route.id,
                lease = ?engine.lease,
                store_timeout = ?config.store.timeout,
                "lease shorter than twice store.timeout: a slow store call may end in 409 lease_lost"
            );
        }
    }
}
