//! The command line: `check` and `records` against the real binary.

mod common;

use std::process::Command;

fn idemgate(args: &[&str], dir: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

#[test]
fn check_prints_the_route_table_or_exits_64() {
    let dir = tempfile::tempdir().unwrap();
    let demo = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.yaml");
    let ok = idemgate(&["check", "--config", demo], dir.path());
    assert!(ok.status.success());
    let table = String::from_utf8_lossy(&ok.stdout);
    assert!(table.lines().next().unwrap().starts_with("ID"));
    assert!(
        table.contains("refund")
            && table.contains("/api/v1/orders/{order_id}/refunds")
            && table.contains("30days")
    );

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "routes:\n  - id: a\n    method: POST\n    path: /a\n    upstream: x\n    policy: required\n    colour: red\n").unwrap();
    let out = idemgate(&["check", "--config", bad.to_str().unwrap()], dir.path());
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("colour") && err.contains("line 7"), "{err}");

    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/idemgate.example.yaml"
    );
    let out = idemgate(&["check", "--config", example], dir.path());
    assert_eq!(
        out.status.code(),
        Some(64),
        "the full example names files that do not exist beside it"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("api-keys.yaml") && !err.contains("not supported yet"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_inspect_and_purge_a_stopped_gateways_store() {
    let up = common::Upstream::start().await;
    let mut gw = common::Gateway::start(&up, "embedded", "").await;
    let k = common::key("ops");
    common::post(&gw.url("/fail"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    gw.kill9();
    let dir = tempfile::tempdir().unwrap();
    let config = gw.config_path();
    let namespaced = format!("t-*:*:*:{k}");
    let out = idemgate(
        &["records", "inspect", &namespaced, "--config", config],
        dir.path(),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "completed");
    assert_eq!(v["status"], 201);
    assert_eq!(v["route"], "fail");
    let out = idemgate(&["records", "purge", &namespaced, "--config", config], dir.path());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "{\"purged\":true}");
    let out = idemgate(
        &["records", "inspect", &namespaced, "--config", config],
        dir.path(),
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "null");
}
