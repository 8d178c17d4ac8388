//! Path templates: parsing never panics; a template without `{}` or `**` matches its own text.
#![no_main]

use idemgate::routes::PathTemplate;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (String, String)| {
    let (template, path) = input;
    if let Ok(t) = PathTemplate::parse(&template) {
        let _ = t.matches(&path);
        if !template.contains(['{', '*']) {
            assert!(t.matches(&template).is_some(), "{template} must match itself");
        }
    }
});
