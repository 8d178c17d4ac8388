//! The providers' own SDKs, run as small scripts (`sign.py`, `sign.mjs`) from the directory
//! that `.ci/run` installs them into, named by `IDEMGATE_TEST_WEBHOOK_SDKS`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

pub struct Sdks {
    python: PathBuf,
    node_dir: PathBuf,
    scripts: PathBuf,
}

pub fn sdks(test: &str) -> Option<Sdks> {
    let Some(dir) = std::env::var_os("IDEMGATE_TEST_WEBHOOK_SDKS") else {
        eprintln!(
            "skipped {test}: set IDEMGATE_TEST_WEBHOOK_SDKS to the SDK directory (.ci/run installs it)"
        );
        return None;
    };
    let dir = PathBuf::from(dir);
    let python = dir.join("venv/bin/python");
    // Asked for but absent is a broken setup, not a skip.
    assert!(python.exists(), "no {} (see .ci/run)", python.display());
    Some(Sdks {
        python,
        node_dir: dir.join("node"),
        scripts: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/webhook_signers"),
    })
}

impl Sdks {
    pub fn python(&self, req: &Value) -> String {
        let mut cmd = Command::new(&self.python);
        cmd.arg(self.scripts.join("sign.py"));
        run(cmd, req)
    }

    /// `@octokit/webhooks-methods`' `sign(secret, body)`.
    pub fn octokit(&self, secret: &str, body: &str) -> String {
        let mut cmd = Command::new("node");
        cmd.arg(self.scripts.join("sign.mjs")).arg(&self.node_dir);
        run(cmd, &json!({"secret": secret, "body": body}))
    }

    pub fn stripe(&self, secret: &str, t: i64, body: &str) -> String {
        self.python(&json!({"sdk": "stripe", "secret": secret, "timestamp": t, "body": body}))
    }
}

fn run(mut cmd: Command, req: &Value) -> String {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the signer starts");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(req.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "signer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}
