//! The framing guard: never panics, and its verdicts do not depend on how the bytes were split
//! across reads (an attacker controls the split).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<u8>, u8)| {
    let (bytes, split) = input;
    let whole = idemgate::framing::verdicts_for(&[&bytes]);
    let step = usize::from(split.max(1));
    let chunks: Vec<&[u8]> = bytes.chunks(step).collect();
    assert_eq!(idemgate::framing::verdicts_for(&chunks), whole);
});
