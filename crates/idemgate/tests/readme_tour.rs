//! Runs the README's curl tour, line for line, against the demo configuration and checks the
//! statuses its comments promise.

mod common;

use std::sync::Arc;

use idemgate::config::Config;
use idemgate::proxy::Gateway;
use idemgate::store::AnyStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_tour_tells_the_truth() {
    let readme = include_str!("../../../README.md");
    let block = readme
        .split("<!-- tour:start -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- tour:end -->").next())
        .expect("tour markers");
    let script = block.trim().trim_start_matches("```sh").trim_end_matches("```");
    let expected: Vec<String> = script
        .lines()
        .filter_map(|l| l.split("# -> ").nth(1))
        .map(|s| s.trim().to_owned())
        .collect();
    assert_eq!(expected, ["201", "201", "422", "409", "400"]);

    let up = common::Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let listen = common::free_addr();
    let yaml = include_str!("../examples/demo.yaml")
        .replace("127.0.0.1:8080", &listen.to_string())
        .replace("http://127.0.0.1:3000", &format!("http://{}", up.addr))
        .replace("./idemgate-data", &dir.path().join("data").display().to_string());
    let config = Config::from_yaml(&yaml).unwrap();
    let store = AnyStore::open(&config.store).unwrap();
    let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
    let gateway = Arc::new(Gateway::new(config, store));
    tokio::spawn(idemgate::server::serve(gateway, listener, std::future::pending()));

    let script = script
        .replace("localhost:8080", &listen.to_string())
        .replace("localhost:3000", &up.addr.to_string());
    let out = tokio::process::Command::new("bash")
        .args(["-c", &script])
        .output()
        .await
        .expect("bash and curl are on the machine");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let statuses: Vec<String> = stdout
        .split("HTTP/1.1 ")
        .skip(1)
        .map(|l| l[..3].to_owned())
        .collect();
    assert_eq!(statuses, expected, "{stdout}");
    assert!(stdout.contains("idempotent-replayed: true"), "{stdout}");
    assert!(stdout.contains("retry-after:"), "{stdout}");
    assert!(stdout.trim_end().ends_with("{\"executions\":2}"), "{stdout}");
}
