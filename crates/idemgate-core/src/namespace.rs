//! Principals, scopes and the namespaced key (SPEC sections 1 and 4.1).
//!
//! The store never sees a raw key: it sees `t-{tenant}:{project}:{subject}:{raw}`, so that two
//! callers who pick the same raw key never share a record (Alice can never read Bob's outcome,
//! even with Bob's key). This module owns that mapping, its inverse ([`parse_namespaced`], for
//! the admin API and CLI) and the short digest that logs show instead of the key.
//!
//! The mapping must be injective: two different (scope, principal components in scope, raw key)
//! tuples must never give the same string, or one caller could replay another's response. Three
//! rules make it so:
//!
//! - every component is percent-escaped: every byte outside `A-Z a-z 0-9 . _ ~ -` becomes `%XX`
//!   (uppercase hex), so an escaped component never contains `:` and the four separators are
//!   always the only ones;
//! - a component outside the route's scope is written `*`, which an escaped component can never
//!   be (`*` itself escapes to `%2A`), so `tenant` scope for tenant `*` differs from `global`;
//! - the escaping is canonical (unreserved bytes are never escaped, hex is uppercase), so
//!   [`parse_namespaced`] can refuse anything [`namespaced_key`] would not have written.
//!
//! Raw keys that contain `:` (scheduler keys such as `sched:{id}:{ms}`, allowed by a route's
//! `key_pattern`) are therefore safe: the colon is escaped and cannot forge a prefix.

use std::fmt;

use sha2::{Digest, Sha256};

/// Every namespaced key starts with this (and raw keys may not: the default reserved prefix).
pub const NAMESPACE_PREFIX: &str = "t-";

/// The project of routes that have none.
pub const PROJECT_TENANT: &str = "_tenant";

/// The project of platform-operator routes.
pub const PROJECT_PLATFORM: &str = "_platform";

/// What a component outside the route's scope is written as.
const WILDCARD: &str = "*";

/// How much of the principal a route's keys are shared across.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// One namespace for everyone; anonymous callers allowed.
    Global,
    /// Shared by every caller of a tenant.
    Tenant,
    /// Shared by every caller of a tenant's project.
    Project,
    /// Private to one subject (the default when identity is configured).
    Subject,
}

impl Scope {
    /// The lowercase name, as written in the config file.
    #[must_use]
    pub fn as_str(&self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Tenant => "tenant",
            Scope::Project => "project",
            Scope::Subject => "subject",
        }
    }

    /// Whether building a key in this scope needs an authenticated principal.
    #[must_use]
    pub fn needs_principal(&self) -> bool {
        !matches!(self, Scope::Global)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who is calling, as resolved by the identity layer (SPEC section 7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub tenant: String,
    /// [`PROJECT_TENANT`] when the route has no project, [`PROJECT_PLATFORM`] for operators.
    pub project: String,
    /// `{type}:{id}`, type one of `user`, `service`, `client`, `tenant_member`.
    pub subject: String,
}

impl Principal {
    pub fn new(tenant: impl Into<String>, project: impl Into<String>, subject: impl Into<String>) -> Self {
        Self {
            tenant: tenant.into(),
            project: project.into(),
            subject: subject.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    #[error("scope {0} needs an authenticated principal")]
    MissingPrincipal(Scope),
}

/// `t-{tenant}:{project}:{subject}:{raw}`, every component escaped, components outside `scope`
/// written `*`: global is `t-*:*:*:{raw}`, tenant `t-{tenant}:*:*:{raw}`, project
/// `t-{tenant}:{project}:*:{raw}`, subject all four.
///
/// [`Scope::Global`] ignores the principal; every other scope needs one.
///
/// # Errors
///
/// [`NamespaceError::MissingPrincipal`] for a scope other than global without a principal.
pub fn namespaced_key(
    scope: Scope,
    principal: Option<&Principal>,
    raw: &str,
) -> Result<String, NamespaceError> {
    let caller = principal.map(|p| (p.tenant.as_str(), p.project.as_str(), p.subject.as_str()));
    namespaced_key_of(scope, caller, raw)
}

/// [`namespaced_key`] from the caller's tenant, project and subject, borrowed: a route that
/// puts its own project in place of the caller's passes it without copying the principal.
///
/// # Errors
///
/// [`NamespaceError::MissingPrincipal`] for a scope other than global without a caller.
pub fn namespaced_key_of(
    scope: Scope,
    caller: Option<(&str, &str, &str)>,
    raw: &str,
) -> Result<String, NamespaceError> {
    let (tenant, project, subject) = match (scope, caller) {
        (Scope::Global, _) => (None, None, None),
        (_, None) => return Err(NamespaceError::MissingPrincipal(scope)),
        (Scope::Tenant, Some((t, _, _))) => (Some(t), None, None),
        (Scope::Project, Some((t, p, _))) => (Some(t), Some(p), None),
        (Scope::Subject, Some((t, p, s))) => (Some(t), Some(p), Some(s)),
    };
    let components = [tenant, project, subject];
    // Sized exactly, so that building the key is one allocation.
    let len = NAMESPACE_PREFIX.len()
        + components
            .iter()
            .map(|c| c.map_or(WILDCARD.len(), escaped_len) + 1)
            .sum::<usize>()
        + escaped_len(raw);
    let mut out = String::with_capacity(len);
    out.push_str(NAMESPACE_PREFIX);
    for component in components {
        match component {
            Some(c) => escape_into(c, &mut out),
            None => out.push_str(WILDCARD),
        }
        out.push(':');
    }
    escape_into(raw, &mut out);
    debug_assert_eq!(out.len(), len);
    Ok(out)
}

/// A namespaced key taken apart by [`parse_namespaced`]. Components outside `scope` are `None`;
/// components inside it are `Some`, unescaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespacedParts {
    pub scope: Scope,
    pub tenant: Option<String>,
    pub project: Option<String>,
    pub subject: Option<String>,
    pub raw: String,
}

/// The inverse of [`namespaced_key`], for the admin API and CLI (`records inspect KEY`).
///
/// Returns `None` for anything `namespaced_key` could not have produced: a missing prefix, the
/// wrong number of components, a wildcard pattern that matches no scope (`t-*:p:*:k`), a
/// non-canonical escape (`%3a`, `%41`) or a byte that should have been escaped. So whenever this
/// returns `Some(parts)`, rebuilding the key from `parts` gives back exactly `s`.
#[must_use]
pub fn parse_namespaced(s: &str) -> Option<NamespacedParts> {
    let rest = s.strip_prefix(NAMESPACE_PREFIX)?;
    let mut it = rest.split(':');
    let (tenant, project, subject, raw) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if it.next().is_some() {
        return None;
    }
    let component = |c: &str| -> Option<Option<String>> {
        if c == WILDCARD {
            Some(None)
        } else {
            unescape(c).map(Some)
        }
    };
    let (tenant, project, subject) = (component(tenant)?, component(project)?, component(subject)?);
    // Scopes nest: a wildcard may only be followed by wildcards.
    let scope = match (&tenant, &project, &subject) {
        (None, None, None) => Scope::Global,
        (Some(_), None, None) => Scope::Tenant,
        (Some(_), Some(_), None) => Scope::Project,
        (Some(_), Some(_), Some(_)) => Scope::Subject,
        _ => return None,
    };
    Some(NamespacedParts {
        scope,
        tenant,
        project,
        subject,
        raw: unescape(raw)?,
    })
}

/// Short digest for logs: the first 16 hex characters of the SHA-256 of the namespaced key. Lets
/// an operator correlate log lines and find a record (by recomputing it) without the logs ever
/// holding a key.
#[must_use]
pub fn key_digest(namespaced: &str) -> String {
    let digest = Sha256::digest(namespaced.as_bytes());
    hex::encode(&digest[..8])
}

/// The RFC 3986 unreserved bytes, `A-Z a-z 0-9 . _ ~ -`: what a component keeps unescaped, and
/// (not by chance) the default character set of raw keys.
pub(crate) fn is_unreserved(b: u8) -> bool {
    UNRESERVED[usize::from(b)]
}

/// [`is_unreserved`] as a table: one load per byte instead of a chain of range checks.
const UNRESERVED: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let byte = b as u8;
        table[b] = byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'~' | b'-');
        b += 1;
    }
    table
};

/// The length of `component` once escaped: each byte outside the unreserved set takes three.
fn escaped_len(component: &str) -> usize {
    component.len() + 2 * component.bytes().filter(|&b| !is_unreserved(b)).count()
}

fn escape_into(component: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    // Unreserved bytes are copied a run at a time. A run is ASCII, so it starts and ends on
    // char boundaries; an empty one may not (between the bytes of `é`), hence `run < i`.
    let mut run = 0;
    for (i, b) in component.bytes().enumerate() {
        if is_unreserved(b) {
            continue;
        }
        if run < i {
            out.push_str(&component[run..i]);
        }
        out.push('%');
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0x0f)]));
        run = i + 1;
    }
    out.push_str(&component[run..]);
}

/// Strict inverse of [`escape_into`]: only canonical escapes are accepted, so that each string
/// has at most one decoding and each decoding exactly one string.
fn unescape(component: &str) -> Option<String> {
    fn hex_digit(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let bytes = component.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if is_unreserved(b) {
            out.push(b);
            i += 1;
        } else if b == b'%' {
            let hi = hex_digit(*bytes.get(i + 1)?)?;
            let lo = hex_digit(*bytes.get(i + 2)?)?;
            let decoded = (hi << 4) | lo;
            if is_unreserved(decoded) {
                return None;
            }
            out.push(decoded);
            i += 3;
        } else {
            return None;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn alice() -> Principal {
        Principal::new("acme", "billing", "user:alice")
    }

    /// Rebuilds the key from parsed parts (the test-side inverse of `parse_namespaced`).
    fn rebuild(p: &NamespacedParts) -> String {
        let principal = p.tenant.as_ref().map(|t| {
            Principal::new(
                t.clone(),
                p.project.clone().unwrap_or_default(),
                p.subject.clone().unwrap_or_default(),
            )
        });
        namespaced_key(p.scope, principal.as_ref(), &p.raw).unwrap()
    }

    #[test]
    fn scope_names() {
        for (s, name) in [
            (Scope::Global, "global"),
            (Scope::Tenant, "tenant"),
            (Scope::Project, "project"),
            (Scope::Subject, "subject"),
        ] {
            assert_eq!(s.as_str(), name);
            assert_eq!(s.to_string(), name);
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<Scope>(&format!("\"{name}\"")).unwrap(), s);
        }
        assert!(serde_json::from_str::<Scope>("\"Global\"").is_err());
        assert!(!Scope::Global.needs_principal());
        assert!(Scope::Subject.needs_principal());
    }

    #[test]
    fn key_shapes_per_scope() {
        let p = alice();
        let k = |s| namespaced_key(s, Some(&p), "order-1").unwrap();
        assert_eq!(k(Scope::Global), "t-*:*:*:order-1");
        assert_eq!(k(Scope::Tenant), "t-acme:*:*:order-1");
        assert_eq!(k(Scope::Project), "t-acme:billing:*:order-1");
        assert_eq!(k(Scope::Subject), "t-acme:billing:user%3Aalice:order-1");
    }

    #[test]
    fn global_ignores_the_principal() {
        assert_eq!(
            namespaced_key(Scope::Global, None, "k").unwrap(),
            namespaced_key(Scope::Global, Some(&alice()), "k").unwrap()
        );
    }

    #[test]
    fn other_scopes_need_a_principal() {
        for s in [Scope::Tenant, Scope::Project, Scope::Subject] {
            let e = namespaced_key(s, None, "k").unwrap_err();
            assert!(matches!(e, NamespaceError::MissingPrincipal(x) if x == s));
            assert_eq!(
                e.to_string(),
                format!("scope {s} needs an authenticated principal")
            );
        }
    }

    #[test]
    fn escaping() {
        let p = Principal::new("a:b", "*", "100%");
        assert_eq!(
            namespaced_key(Scope::Subject, Some(&p), "sched:1:2 é/").unwrap(),
            "t-a%3Ab:%2A:100%25:sched%3A1%3A2%20%C3%A9%2F"
        );
        // The unreserved set stays as is, `_` included.
        let p = Principal::new("A-z_0.9~", PROJECT_TENANT, "service:webhook-ingest");
        assert_eq!(
            namespaced_key(Scope::Project, Some(&p), "x").unwrap(),
            "t-A-z_0.9~:_tenant:*:x"
        );
    }

    #[test]
    fn colons_cannot_forge_a_prefix() {
        // Without escaping, these two would both be "t-acme:billing:*:x".
        let forged = namespaced_key(Scope::Tenant, Some(&alice()), "billing:*:x").unwrap();
        let real = namespaced_key(Scope::Project, Some(&alice()), "x").unwrap();
        assert_ne!(forged, real);
    }

    #[test]
    fn wildcard_tenant_differs_from_global() {
        let star = Principal::new("*", "*", "*");
        let keys: Vec<_> = [Scope::Global, Scope::Tenant, Scope::Project, Scope::Subject]
            .into_iter()
            .map(|s| namespaced_key(s, Some(&star), "k").unwrap())
            .collect();
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn empty_components_are_not_wildcards() {
        let empty = Principal::new("", "", "");
        let k = namespaced_key(Scope::Subject, Some(&empty), "").unwrap();
        assert_eq!(k, "t-:::");
        let parts = parse_namespaced(&k).unwrap();
        assert_eq!(parts.scope, Scope::Subject);
        assert_eq!(parts.tenant.as_deref(), Some(""));
        assert_eq!(parts.raw, "");
    }

    #[test]
    fn parse_examples() {
        let parts = parse_namespaced("t-acme:billing:user%3Aalice:order-1").unwrap();
        assert_eq!(
            parts,
            NamespacedParts {
                scope: Scope::Subject,
                tenant: Some("acme".into()),
                project: Some("billing".into()),
                subject: Some("user:alice".into()),
                raw: "order-1".into(),
            }
        );
        let g = parse_namespaced("t-*:*:*:a%3Ab").unwrap();
        assert_eq!((g.scope, g.tenant, g.raw.as_str()), (Scope::Global, None, "a:b"));
    }

    #[test]
    fn parse_refuses_what_namespaced_key_never_writes() {
        for s in [
            "",
            "t-",
            "x-*:*:*:k",
            "T-*:*:*:k",
            "t-*:*:*",     // three components
            "t-*:*:*:k:l", // five
            "t-*:p:*:k",   // wildcard before a value
            "t-a:*:s:k",
            "t-*:*:*:*",   // raw is never a wildcard
            "t-a:b:c:%3a", // lowercase hex
            "t-a:b:c:%41", // escaped unreserved byte
            "t-a:b:c:%4",  // truncated escape
            "t-a:b:c:%",
            "t-a:b:c:%ZZ",
            "t-a:b:c:a b", // unescaped byte
            "t-a:b:c:é",
            "t-a:b:c:%C3", // not UTF-8 once decoded
            "t-**:*:*:k",
        ] {
            assert_eq!(parse_namespaced(s), None, "{s}");
        }
    }

    #[test]
    fn digest_is_16_hex_chars_and_hides_the_key() {
        let k = namespaced_key(Scope::Subject, Some(&alice()), "secret-key").unwrap();
        let d = key_digest(&k);
        assert_eq!(d.len(), 16);
        assert!(
            d.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(d, key_digest(&k));
        assert_ne!(d, key_digest("t-*:*:*:secret-key"));
        // sha256("") starts with e3b0c442...
        assert_eq!(key_digest(""), "e3b0c44298fc1c14");
    }

    // ---- property tests ----

    /// A small alphabet full of the characters that matter to the encoding (separators, escape
    /// char, wildcard, hex digits, `t-`), so that near-collisions are actually explored.
    const TRICKY: &str = "[a:%*t2A_~-é]{0,4}";

    fn scope() -> impl Strategy<Value = Scope> {
        prop_oneof![
            Just(Scope::Global),
            Just(Scope::Tenant),
            Just(Scope::Project),
            Just(Scope::Subject),
        ]
    }

    fn principal(component: &'static str) -> impl Strategy<Value = Principal> {
        (component, component, component).prop_map(|(t, p, s)| Principal::new(t, p, s))
    }

    /// The tuple the key must be injective over: the scope, the components it keeps, the raw key.
    fn identity(scope: Scope, p: &Principal, raw: &str) -> (Scope, Vec<String>, String) {
        let kept = match scope {
            Scope::Global => vec![],
            Scope::Tenant => vec![p.tenant.clone()],
            Scope::Project => vec![p.tenant.clone(), p.project.clone()],
            Scope::Subject => vec![p.tenant.clone(), p.project.clone(), p.subject.clone()],
        };
        (scope, kept, raw.to_owned())
    }

    /// Splits `u` into tenant, project, subject and raw key at three cut points. A cut may
    /// swallow the character it falls on, the way a separator would: from `a:b:c`, both
    /// (`a:b`, `c`) and (`a`, `b:c`) come out, which is how a colon-blind encoding collides.
    fn cut(u: &str, cuts: [(usize, bool); 3]) -> (Principal, String) {
        let chars: Vec<char> = u.chars().collect();
        let mut cuts = cuts.map(|(c, swallow)| (c % (chars.len() + 1), swallow));
        cuts.sort_unstable();
        let mut parts = Vec::with_capacity(4);
        let mut start = 0;
        for (at, swallow) in cuts {
            let at = at.max(start);
            parts.push(chars[start..at].iter().collect::<String>());
            start = if swallow && at < chars.len() { at + 1 } else { at };
        }
        parts.push(chars[start..].iter().collect());
        let raw = parts.pop().unwrap_or_default();
        (
            Principal::new(parts[0].clone(), parts[1].clone(), parts[2].clone()),
            raw,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn round_trip(s in scope(), p in principal(".{0,8}"), raw in ".{0,16}") {
            let key = namespaced_key(s, Some(&p), &raw).unwrap();
            prop_assert!(key.starts_with(NAMESPACE_PREFIX));
            let parts = parse_namespaced(&key).unwrap();
            prop_assert_eq!(parts.scope, s);
            prop_assert_eq!(&parts.raw, &raw);
            let (_, kept, _) = identity(s, &p, &raw);
            let got: Vec<String> = [&parts.tenant, &parts.project, &parts.subject]
                .into_iter()
                .flatten()
                .cloned()
                .collect();
            prop_assert_eq!(got, kept);
            prop_assert_eq!(rebuild(&parts), key);
        }

        #[test]
        fn different_tuples_never_collide(
            u in "[a:%*t2A_-é]{0,8}",
            s1 in scope(), c1 in any::<[(usize, bool); 3]>(),
            s2 in scope(), c2 in any::<[(usize, bool); 3]>(),
        ) {
            // Both tuples are cut from the same string at different places (and read in
            // different scopes), so they share their characters and only differ by boundaries:
            // exactly where a weak encoding collides.
            let (p1, raw1) = cut(&u, c1);
            let (p2, raw2) = cut(&u, c2);
            let k1 = namespaced_key(s1, Some(&p1), &raw1).unwrap();
            let k2 = namespaced_key(s2, Some(&p2), &raw2).unwrap();
            prop_assert_eq!(identity(s1, &p1, &raw1) == identity(s2, &p2, &raw2), k1 == k2);
        }

        #[test]
        fn shifting_characters_between_components_never_collides(
            s in scope(), p in principal(TRICKY), raw in TRICKY, cut in 0usize..4,
        ) {
            // Move the last character of one component into the next: a classic boundary attack.
            let original = namespaced_key(s, Some(&p), &raw).unwrap();
            let mut parts = [p.tenant.clone(), p.project.clone(), p.subject.clone(), raw.clone()];
            let i = cut % 3;
            if let Some(c) = parts[i].pop() {
                parts[i + 1].insert(0, c);
                let q = Principal::new(parts[0].clone(), parts[1].clone(), parts[2].clone());
                let shifted = namespaced_key(s, Some(&q), &parts[3]).unwrap();
                let same = identity(s, &p, &raw) == identity(s, &q, &parts[3]);
                prop_assert_eq!(same, original == shifted);
            }
        }

        #[test]
        fn every_parsable_string_is_canonical(s in "t-[a:%*3AaF2C]{0,14}") {
            if let Some(parts) = parse_namespaced(&s) {
                prop_assert_eq!(rebuild(&parts), s);
            }
        }

        #[test]
        fn parse_never_panics(s in ".{0,40}") {
            let _ = parse_namespaced(&s);
        }
    }
}
