//! The config loader: any text is either a config or a clear error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let _ = idemgate::config::Config::from_yaml(text);
});
