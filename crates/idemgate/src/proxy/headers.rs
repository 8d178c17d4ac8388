//! Header work of the proxy: what is never forwarded, the upstream URI and `X-Forwarded-For`,
//! and a replay's response (its headers are written by [`idemgate_core::headers`], as the tower
//! layer's are).

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode, Uri};
use idemgate_core::headers::{self, value as header_value};
use idemgate_core::record::{Millis, StoredResponse};

use crate::body::{Body, full};
use crate::config::Route;
use crate::problem::{Kind, Problem};

/// Headers that describe one connection, never forwarded in either direction (RFC 9110 7.6.1).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];
/// Hop-by-hop too, but not standard names in `http`.
const HOP_BY_HOP_EXTRA: [&str; 2] = ["keep-alive", "proxy-connection"];

pub(super) fn replay(
    route: &Route,
    stored: StoredResponse,
    operation_id: &str,
    expires_at: Millis,
) -> Response<Body> {
    let mut resp = Response::new(full(stored.body.unwrap_or_default()));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    headers::write_replay(
        resp.headers_mut(),
        stored.headers,
        &route.replayed_header,
        operation_id,
        expires_at,
    );
    resp
}

/// Refuses the framings that let a front and a back end disagree on where a request ends.
pub(super) fn check_framing(h: &HeaderMap) -> Result<(), Problem> {
    let lengths = h.get_all(header::CONTENT_LENGTH).iter().count();
    if lengths > 1 {
        return Err(Problem::new(Kind::BadRequest, "several Content-Length headers").close());
    }
    if lengths == 1 && h.contains_key(header::TRANSFER_ENCODING) {
        return Err(Problem::new(Kind::BadRequest, "both Content-Length and Transfer-Encoding").close());
    }
    Ok(())
}

pub(crate) fn strip_hop_by_hop(h: &mut HeaderMap) {
    // The names are compared, not hashed, and only the ones present are removed. Most messages
    // carry none, or only `Connection: keep-alive` (nearly every upstream response), which names
    // no other header: that one is removed without collecting names or splitting the value.
    let is_hop = |n: &HeaderName| HOP_BY_HOP.contains(n) || HOP_BY_HOP_EXTRA.contains(&n.as_str());
    let only_connection = {
        let mut hops = h.keys().filter(|n| is_hop(n));
        match (hops.next(), hops.next()) {
            (None, _) => return,
            (Some(n), None) => *n == header::CONNECTION,
            _ => false,
        }
    };
    if only_connection
        && h.get_all(header::CONNECTION)
            .iter()
            .all(|v| names_no_header(v.as_bytes()))
    {
        h.remove(header::CONNECTION);
        return;
    }
    let mut present: Vec<HeaderName> = h.keys().filter(|n| is_hop(n)).cloned().collect();
    // Headers named in Connection are hop-by-hop too.
    for token in h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !names_no_header(t.as_bytes()))
    {
        if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
            present.push(name);
        }
    }
    for name in present {
        h.remove(name);
    }
}

/// `keep-alive` and `close`, the usual `Connection` tokens, name no header to remove (and a
/// `Keep-Alive` header is removed anyway).
fn names_no_header(token: &[u8]) -> bool {
    let token = token.trim_ascii();
    token.eq_ignore_ascii_case(b"keep-alive") || token.eq_ignore_ascii_case(b"close")
}

pub(super) fn upstream_uri(base: &Uri, incoming: &Uri) -> Result<Uri, ()> {
    let prefix = base.path().trim_end_matches('/');
    let mut parts = base.clone().into_parts();
    parts.path_and_query = match incoming.path_and_query() {
        // An upstream without a path prefix (the usual case) takes the target as it came:
        // `PathAndQuery` is shared bytes, so this neither formats nor parses.
        Some(pq) if prefix.is_empty() && pq.as_str().starts_with('/') => Some(pq.clone()),
        pq => {
            let pq = pq.map_or("/", http::uri::PathAndQuery::as_str);
            Some(format!("{prefix}{pq}").parse().map_err(|_| ())?)
        }
    };
    Uri::from_parts(parts).map_err(|_| ())
}

/// The `X-Forwarded-For` value for a peer. Formatting an address costs more than the rest of
/// the header work of a request, and a connection (often a whole client) sends many requests
/// from one address, so each thread keeps the last one.
pub(super) fn forwarded_for(ip: std::net::IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(std::net::IpAddr, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((cached, value)) if *cached == ip => value.clone(),
        _ => {
            let value = header_value(&ip.to_string());
            *last = Some((ip, value.clone()));
            value
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stripped(pairs: &[(&'static str, &'static str)]) -> Vec<String> {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(*name, HeaderValue::from_static(value));
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<String> = h.keys().map(|n| n.as_str().to_owned()).collect();
        left.sort();
        left
    }

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_stripped() {
        let kept = ("content-type", "application/json");
        assert_eq!(stripped(&[kept]), ["content-type"]);
        assert_eq!(stripped(&[kept, ("connection", "keep-alive")]), ["content-type"]);
        assert_eq!(stripped(&[kept, ("connection", " Close ")]), ["content-type"]);
        assert_eq!(stripped(&[kept, ("keep-alive", "timeout=5")]), ["content-type"]);
        assert_eq!(
            stripped(&[kept, ("connection", "keep-alive, x-private"), ("x-private", "1")]),
            ["content-type"]
        );
        assert_eq!(
            stripped(&[
                ("connection", "keep-alive"),
                ("connection", "x-private"),
                ("x-private", "1"),
                kept
            ]),
            ["content-type"],
            "a second Connection line names a header"
        );
        assert_eq!(
            stripped(&[
                ("connection", "x-private"),
                ("x-private", "1"),
                ("te", "trailers"),
                kept
            ]),
            ["content-type"]
        );
    }
}
