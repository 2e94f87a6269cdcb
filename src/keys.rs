//! From a request to the identity of a counter.
//!
//! A policy's `key` lists parts (`client_ip`, `header:NAME`, `path:PARAM`, `query:NAME`, `method`,
//! `host`, `jwt:CLAIM`, `client_cert:FIELD`); their values, taken from the canonical request ([`crate::normalize`]) and
//! percent-decoded where they can be encoded, name the counter. Request material is bounded before
//! it becomes a key: a value over [`MAX_KEY_VALUE_BYTES`] is replaced by its SHA-256, and bytes
//! that could confuse a key's structure (or a Redis Cluster hash tag) are percent-escaped.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::net::IpAddr;

use http::{HeaderMap, HeaderName, Method};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use sha2::{Digest, Sha256};

use crate::client_cert::ClientCert;
use crate::normalize::decode;
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
    /// A claim of the request's bearer token, once verified ([`crate::jwt`]).
    Jwt(Box<str>),
    /// A string or number in the JSON request body, at this JSON pointer (`body:model` is
    /// `/model`); read only on routes that name one, up to `server.json_body_limit` bytes.
    Body(Box<str>),
    /// A field of the client certificate the TLS listener verified against its `client_ca`
    /// ([`crate::client_cert`]); absent on a connection without one.
    ClientCert(CertField),
}

/// What a `client_cert:` key part reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertField {
    /// `client_cert:subject`, RFC 4514 (`CN=client-a,O=Example`).
    Subject,
    /// `client_cert:san_dns`, `san_uri`, `san_email`, `san_ip`: every subject alternative name
    /// of that kind, in certificate order, joined by `,`.
    SanDns,
    SanUri,
    SanEmail,
    SanIp,
}

impl CertField {
    pub const NAMES: &'static str = "`subject`, `san_dns`, `san_uri`, `san_email` or `san_ip`";

    pub fn parse(text: &str) -> Option<CertField> {
        Some(match text {
            "subject" => CertField::Subject,
            "san_dns" => CertField::SanDns,
            "san_uri" => CertField::SanUri,
            "san_email" => CertField::SanEmail,
            "san_ip" => CertField::SanIp,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CertField::Subject => "subject",
            CertField::SanDns => "san_dns",
            CertField::SanUri => "san_uri",
            CertField::SanEmail => "san_email",
            CertField::SanIp => "san_ip",
        }
    }

    /// The field of `cert`; `None` when empty (a certificate without that kind of name).
    pub fn of(self, cert: &ClientCert) -> Option<&str> {
        let value = match self {
            CertField::Subject => &cert.subject,
            CertField::SanDns => &cert.san_dns,
            CertField::SanUri => &cert.san_uri,
            CertField::SanEmail => &cert.san_email,
            CertField::SanIp => &cert.san_ip,
        };
        (!value.is_empty()).then_some(&**value)
    }
}

/// A JSON request body read before admission (`crate::usage::request`).
#[derive(Debug, Clone, PartialEq)]
pub struct JsonBody {
    pub value: serde_json::Value,
    /// The body's length in bytes.
    pub bytes: u64,
    /// It names content whose tokens its bytes do not bound (an image, audio, a file).
    pub opaque: bool,
}

/// What key extraction may read from a request, after [`crate::normalize::canonicalize`].
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    pub method: &'a Method,
    /// Canonical (lower-case, no trailing dot, no default port).
    pub host: Option<&'a str>,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub params: &'a PathParams,
    pub client_ip: IpAddr,
    pub client_prefix: ClientPrefix,
    /// The JSON request body, when the route reads it and it was JSON within the limit.
    pub body: Option<&'a JsonBody>,
    /// The client certificate the TLS listener verified, when it asks for one.
    pub client_cert: Option<&'a ClientCert>,
}

/// A request that names a key part more than once: it is refused with 400, since the limiter
/// and the upstream could read different values (issue 9, item 6).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("header `{0}` is a rate-limit key and must be sent once")]
    RepeatedHeader(HeaderName),
    #[error("query parameter `{0}` is a rate-limit key and must be sent once")]
    RepeatedQuery(Box<str>),
}

/// Appends the counter key of `parts` to `out` (which already holds the policy's prefix).
/// Returns `Ok(false)` when a part is absent from the request: the policy then does not apply.
/// Every part is looked at, so a repeated key header is an error even then.
///
/// Values that can be percent-encoded (path parameters, query parameters) are decoded first, so
/// every spelling of a value names one counter; then all are bounded by [`push_bounded`].
/// `claims` are the request's verified token claims (`None`: no valid token, every `jwt:` part
/// is absent).
pub fn write_key(
    parts: &[KeyPart],
    req: &RequestView<'_>,
    claims: Option<&crate::jwt::Claims>,
    out: &mut String,
) -> Result<bool, KeyError> {
    let mut present = true;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        let value: Cow<'_, [u8]> = match part {
            KeyPart::ClientIp => {
                req.client_prefix.push_key(out, req.client_ip);
                continue;
            }
            KeyPart::Header(name) => {
                let mut values = req.headers.get_all(name).iter();
                let first = values.next();
                if values.next().is_some() {
                    return Err(KeyError::RepeatedHeader(name.clone()));
                }
                match first {
                    Some(v) => Cow::Borrowed(v.as_bytes()),
                    None => {
                        present = false;
                        continue;
                    }
                }
            }
            KeyPart::PathParam(index) => match req.params.get(req.path, *index) {
                Some(v) => decode::path_param(v),
                None => {
                    present = false;
                    continue;
                }
            },
            KeyPart::Query(name) => match decode::query_value(req.query, name) {
                Ok(Some(v)) => decode::query_component(v),
                Ok(None) => {
                    present = false;
                    continue;
                }
                Err(decode::Repeated) => return Err(KeyError::RepeatedQuery(name.clone())),
            },
            KeyPart::Method => Cow::Borrowed(req.method.as_str().as_bytes()),
            KeyPart::Host => match req.host {
                Some(h) => Cow::Borrowed(h.as_bytes()),
                None => {
                    present = false;
                    continue;
                }
            },
            KeyPart::Jwt(claim) => match claims.and_then(|c| crate::jwt::claim_value(c, claim)) {
                Some(v) => v,
                None => {
                    present = false;
                    continue;
                }
            },
            KeyPart::Body(pointer) => match req.body.and_then(|b| body_value(&b.value, pointer)) {
                Some(v) => v,
                None => {
                    present = false;
                    continue;
                }
            },
            KeyPart::ClientCert(field) => match req.client_cert.and_then(|c| field.of(c)) {
                Some(v) => Cow::Borrowed(v.as_bytes()),
                None => {
                    present = false;
                    continue;
                }
            },
        };
        if present {
            push_bounded(&value, out);
        }
    }
    Ok(present)
}

/// The string or number at `pointer` in `body`; anything else is absent.
fn body_value<'b>(body: &'b serde_json::Value, pointer: &str) -> Option<Cow<'b, [u8]>> {
    match body.pointer(pointer)? {
        serde_json::Value::String(s) => Some(Cow::Borrowed(s.as_bytes())),
        serde_json::Value::Number(n) => Some(Cow::Owned(n.to_string().into_bytes())),
        _ => None,
    }
}

/// How much of the client's address names its counter: a network, since whoever holds an IPv6
/// /64 can pick any of its 2^64 addresses. `::ffff:a.b.c.d` counts as the IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientPrefix {
    pub ipv4: u8,
    pub ipv6: u8,
}

impl Default for ClientPrefix {
    fn default() -> Self {
        ClientPrefix { ipv4: 32, ipv6: 64 }
    }
}

impl ClientPrefix {
    /// Appends the client's network: the address alone for a whole-address prefix
    /// (`192.0.2.7`), else `network/len` (`2001:db8:1:2::/64`).
    pub fn push_key(&self, out: &mut String, ip: IpAddr) {
        let (network, len) = match ip.to_canonical() {
            IpAddr::V4(v4) if self.ipv4 < 32 => (
                Ipv4Net::new(v4, self.ipv4).map_or(IpAddr::V4(v4), |n| n.network().into()),
                self.ipv4,
            ),
            IpAddr::V6(v6) if self.ipv6 < 128 => (
                Ipv6Net::new(v6, self.ipv6).map_or(IpAddr::V6(v6), |n| n.network().into()),
                self.ipv6,
            ),
            whole => {
                push_ip(out, whole);
                return;
            }
        };
        push_ip(out, network);
        let _ = write!(out, "/{len}");
    }
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

/// Appends one value as a counter key writes it: escaped, or the digest of a long one (what
/// [`check_key_value`] accepts). The quota service's overrides name bucket id values this way.
pub fn push_key_value(value: &[u8], out: &mut String) {
    push_bounded(value, out);
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

/// Whether `part` is one value as a counter key holds it: what [`write_key`] writes for some
/// value (escaped, or the digest of a long one). `Err` gives what a counter key holds instead for
/// the value `part` spells (its escapes read back), when that differs.
pub fn check_key_value(part: &str) -> Result<(), String> {
    let digest = part.strip_prefix('#').is_some_and(|hex| {
        hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    });
    if digest {
        return Ok(());
    }
    let bytes = part.as_bytes();
    let mut value = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                value.push(byte);
                i += 3;
            }
            (byte, _) => {
                value.push(byte);
                i += 1;
            }
        }
    }
    let mut canonical = String::with_capacity(part.len());
    push_bounded(&value, &mut canonical);
    if canonical == part {
        Ok(())
    } else {
        Err(canonical)
    }
}

/// The peers whose `X-Forwarded-For` is believed.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies {
    nets: Vec<IpNet>,
}

impl TrustedProxies {
    /// `::ffff:a.b.c.d/n` ranges become IPv4 ranges: peers are compared in their canonical
    /// (IPv4) form.
    pub fn new(nets: Vec<IpNet>) -> Self {
        let nets = nets.into_iter().map(canonical_net).collect();
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

/// An IPv4-mapped IPv6 range (`::ffff:0:0/96` and narrower) as the IPv4 range it maps.
fn canonical_net(net: IpNet) -> IpNet {
    match (net, net.addr().to_canonical()) {
        (IpNet::V6(v6), IpAddr::V4(v4)) if v6.prefix_len() >= 96 => {
            Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, |n| IpNet::V4(n.trunc()))
        }
        _ => net,
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
