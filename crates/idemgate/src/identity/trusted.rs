//! Identity headers set by an authenticating proxy, honoured only from its addresses.

use std::net::IpAddr;

use http::HeaderMap;
use http::header::HeaderName;
use idemgate_core::namespace::Principal;
use ipnet::IpNet;

use super::{Rejected, SetupError, principal};
use crate::config::identity::TrustedHeadersFile;

#[derive(Debug)]
pub struct TrustedHeaders {
    /// tenant, project, subject.
    names: [HeaderName; 3],
    proxies: Vec<IpNet>,
}

impl TrustedHeaders {
    /// # Errors
    /// A header name or a proxy CIDR is invalid.
    pub fn from_file(f: &TrustedHeadersFile) -> Result<Self, SetupError> {
        let name = |n: &str| {
            HeaderName::from_bytes(n.as_bytes()).map_err(|_| SetupError {
                key: "trusted_headers",
                why: format!("`{n}` is not a header name"),
            })
        };
        let proxies = f
            .trusted_proxies
            .iter()
            .map(|p| {
                p.parse::<IpNet>()
                    .or_else(|_| p.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| SetupError {
                        key: "trusted_headers.trusted_proxies",
                        why: format!("`{p}` is not an address or CIDR"),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            names: [name(&f.tenant)?, name(&f.project)?, name(&f.subject)?],
            proxies,
        })
    }

    pub fn header_names(&self) -> &[HeaderName] {
        &self.names
    }

    /// `None` unless the peer is a trusted proxy and it sent the headers.
    pub fn resolve(&self, headers: &HeaderMap, peer: IpAddr) -> Option<Result<Principal, Rejected>> {
        let peer = match peer {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer, IpAddr::V4),
            v4 @ IpAddr::V4(_) => v4,
        };
        if !self.proxies.iter().any(|net| net.contains(&peer)) {
            return None;
        }
        let get = |n: &HeaderName| headers.get(n).and_then(|v| v.to_str().ok()).map(str::trim);
        let [t, p, s] = &self.names;
        let (tenant, subject) = (get(t), get(s));
        if tenant.is_none() && subject.is_none() {
            return None;
        }
        Some(principal(tenant.unwrap_or(""), get(p), subject.unwrap_or("")))
    }
}
