//! From a request to the identity of a counter.
//!
//! A policy's `key` lists parts (`client_ip`, `header:NAME`, `path:PARAM`, `query:NAME`, `method`,
//! `host`); their values, taken from the request, name the counter. Request material is bounded
//! before it becomes a key: a value over [`MAX_KEY_VALUE_BYTES`] is replaced by its SHA-256, and
//! bytes that could confuse a key's structure (or a Redis Cluster hash tag) are percent-escaped.

use std::fmt::Write as _;
use std::net::IpAddr;

use http::{HeaderMap, HeaderName, Method};
use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::route::PathParams;

/// Longer values are hashed before they become part of a counter key.
pub const MAX_KEY_VALUE_BYTES: usize = 256;

/// One component of a policy key, resolved at config load (a path parameter is an index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    ClientIp,
    Header(HeaderName),
    PathParam(usize),
    Query(Box<str>),
    Method,
    Host,
}

/// What key extraction may read from a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    pub method: &'a Method,
    pub host: Option<&'a str>,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub params: &'a PathParams,
    pub client_ip: IpAddr,
}

/// Appends the counter key of `parts` to `out` (which already holds the policy's prefix).
/// Returns `false` when a part is absent from the request: the policy then does not apply.
pub fn write_key(parts: &[KeyPart], req: &RequestView<'_>, out: &mut String) -> bool {
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        let value: &[u8] = match part {
            KeyPart::ClientIp => {
                push_ip(out, req.client_ip);
                continue;
            }
            KeyPart::Header(name) => match req.headers.get(name) {
                Some(v) => v.as_bytes(),
                None => return false,
            },
            KeyPart::PathParam(index) => match req.params.get(req.path, *index) {
                Some(v) => v.as_bytes(),
                None => return false,
            },
            KeyPart::Query(name) => match query_value(req.query, name) {
                Some(v) => v.as_bytes(),
                None => return false,
            },
            KeyPart::Method => req.method.as_str().as_bytes(),
            KeyPart::Host => match req.host {
                Some(h) => h.as_bytes(),
                None => return false,
            },
        };
        push_bounded(value, out);
    }
    true
}

/// Appends `ip` as `Display` would write it. IPv4 (the common case) skips the `fmt` machinery,
/// which costs more than the rest of a counter key and runs twice per proxied request (the key and
/// `X-Forwarded-For`).
pub fn push_ip(out: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        // Infallible for a String.
        IpAddr::V6(v6) => {
            let _ = write!(out, "{v6}");
        }
    }
}

/// The first value of `name` in a raw query string, as sent (not percent-decoded).
pub fn query_value<'q>(query: Option<&'q str>, name: &str) -> Option<&'q str> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v)
    })
}

/// Writes `#` and the first 128 bits of `value`'s SHA-256 in hex when `value` is longer than
/// [`MAX_KEY_VALUE_BYTES`], and returns whether it did. Every door bounds request material this
/// way before it names a counter; callers escape `#` in the values they write literally, so a
/// digest never equals a literal value.
pub fn push_digest_if_long(value: &[u8], out: &mut String) -> bool {
    if value.len() <= MAX_KEY_VALUE_BYTES {
        return false;
    }
    out.push('#');
    for byte in &Sha256::digest(value)[..16] {
        let _ = write!(out, "{byte:02x}");
    }
    true
}

fn push_bounded(value: &[u8], out: &mut String) {
    if push_digest_if_long(value, out) {
        return;
    }
    for &byte in value {
        if byte.is_ascii_graphic() && !matches!(byte, b'%' | b'|' | b'{' | b'}' | b'#') {
            out.push(byte as char);
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
}

/// The peers whose `X-Forwarded-For` is believed.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies {
    nets: Vec<IpNet>,
}

impl TrustedProxies {
    pub fn new(nets: Vec<IpNet>) -> Self {
        TrustedProxies { nets }
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        self.nets.iter().any(|net| net.contains(ip))
    }

    /// The client's address: the peer itself, unless the peer is a trusted proxy; then the
    /// rightmost `X-Forwarded-For` address that is not a trusted proxy (or the leftmost, when all
    /// are). Anything a client could have forged (left of the first untrusted hop) is ignored.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = peer.to_canonical();
        if self.nets.is_empty() || !self.contains(&peer) {
            return peer;
        }
        let mut client = peer;
        for value in headers.get_all("x-forwarded-for").iter().rev() {
            let Ok(value) = value.to_str() else {
                return client;
            };
            for hop in value.rsplit(',') {
                let Some(ip) = parse_hop(hop) else {
                    return client;
                };
                client = ip;
                if !self.contains(&ip) {
                    return ip;
                }
            }
        }
        client
    }
}

/// One `X-Forwarded-For` element: an IP, possibly `[v6]` or with a port.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Ok(sock) = hop.parse::<std::net::SocketAddr>() {
        return Some(sock.ip().to_canonical());
    }
    hop.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .and_then(|h| h.parse::<IpAddr>().ok())
}

#[cfg(test)]
#[path = "keys_tests.rs"]
mod tests;
