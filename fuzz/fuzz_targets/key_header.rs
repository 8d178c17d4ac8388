//! The `Idempotency-Key` parser: never panics; a parsed key survives quoting; validation agrees
//! with itself.
#![no_main]

use idemgate_core::key::{KeyRules, parse_header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Split on NUL into several header lines.
    let lines: Vec<&[u8]> = data.split(|b| *b == 0).collect();
    let rules = KeyRules::default();
    if let Ok(Some(key)) = parse_header(lines.iter().copied()) {
        let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
        assert_eq!(parse_header([quoted.as_bytes()]).ok().flatten().as_deref(), Some(key.as_str()));
        let _ = rules.validate(&key);
    }
});
