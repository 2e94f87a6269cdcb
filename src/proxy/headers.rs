//! Header rewriting between client and upstream.

use std::net::IpAddr;

use http::header::{CONNECTION, HOST, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};
use http::{HeaderMap, HeaderName, HeaderValue};

static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Whether this HTTP/1.1 request asks to switch protocols (WebSocket and friends).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(UPGRADE) && connection_lists(headers, "upgrade")
}

fn connection_lists(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Removes hop-by-hop fields (RFC 9110 §7.6.1): `Connection`, the fields it names, and the
/// fields every proxy must treat as hop-by-hop. With `upgrade`, `Upgrade` and `Connection:
/// upgrade` survive, because the upgrade must reach the next hop to happen at all.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    if headers.contains_key(CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for name in named {
            if !(upgrade && name == UPGRADE) {
                headers.remove(name);
            }
        }
        headers.remove(CONNECTION);
    }
    for name in [
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &TE,
        &TRAILER,
        &TRANSFER_ENCODING,
    ] {
        headers.remove(name);
    }
    if upgrade {
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(UPGRADE);
    }
}

/// Appends the peer to `X-Forwarded-For` and sets `X-Forwarded-Proto` and `-Host`. A trusted
/// proxy's `-Proto` and `-Host` are kept; anyone else's are replaced by what we saw.
pub fn set_forwarded(
    headers: &mut HeaderMap,
    peer: IpAddr,
    host: Option<HeaderValue>,
    peer_trusted: bool,
) {
    let peer_text = peer.to_string();
    let xff = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prior) if headers.get_all(&X_FORWARDED_FOR).iter().count() == 1 => {
            format!("{prior}, {peer_text}")
        }
        Some(_) => {
            let all: Vec<&str> = headers
                .get_all(&X_FORWARDED_FOR)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            format!("{}, {peer_text}", all.join(", "))
        }
        None => peer_text,
    };
    if let Ok(value) = HeaderValue::from_str(&xff) {
        headers.insert(X_FORWARDED_FOR.clone(), value);
    }
    if !(peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    }
    if !(peer_trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        match host {
            Some(value) => {
                headers.insert(X_FORWARDED_HOST.clone(), value);
            }
            None => {
                headers.remove(&X_FORWARDED_HOST);
            }
        }
    }
}

/// The request's host: the URI authority (HTTP/2, absolute-form) or the `Host` header.
pub fn request_host<'a>(uri: &'a http::Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    uri.authority()
        .map(|a| a.as_str())
        .or_else(|| headers.get(HOST).and_then(|h| h.to_str().ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_connection_and_what_it_names() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn upgrade_survives_when_upgrading() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(UPGRADE, HeaderValue::from_static("websocket"));
        assert!(is_upgrade(&h));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(
            h.get(UPGRADE).map(|v| v.as_bytes()),
            Some(&b"websocket"[..])
        );
        assert_eq!(
            h.get(CONNECTION).map(|v| v.as_bytes()),
            Some(&b"upgrade"[..])
        );
    }

    #[test]
    fn forwarded_headers_append_and_replace() {
        let mut h = HeaderMap::new();
        h.insert(&X_FORWARDED_FOR, HeaderValue::from_static("1.1.1.1"));
        h.insert(&X_FORWARDED_PROTO, HeaderValue::from_static("https"));
        set_forwarded(
            &mut h,
            "10.0.0.1".parse().unwrap(),
            Some(HeaderValue::from_static("example.com")),
            false,
        );
        assert_eq!(h[&X_FORWARDED_FOR], "1.1.1.1, 10.0.0.1");
        assert_eq!(h[&X_FORWARDED_PROTO], "http");
        assert_eq!(h[&X_FORWARDED_HOST], "example.com");
    }
}
