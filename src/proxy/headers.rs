//! Header rewriting between client and upstream.

use std::net::IpAddr;

use http::header::Entry;
use http::header::{CONNECTION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};
use http::{HeaderMap, HeaderName, HeaderValue};

static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Request field maps kept per thread for reuse, at most this many.
const SPARE_MAPS: usize = 64;
/// Maps with room for more fields than this are not kept (the limit bounds what is held).
const SPARE_MAP_FIELDS: usize = 32;

thread_local! {
    static SPARE: std::cell::RefCell<Vec<HeaderMap>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An empty field map with room for `capacity` fields: one that [`recycle`] gave back on this
/// thread when there is one, a new one otherwise.
///
/// Why: a map with room for a request's fields and the ones the proxy adds is over a kilobyte,
/// more than glibc's per-thread cache serves, so allocating and freeing one per request took
/// malloc's slow path both ways (docs/benchmarks.md, issue 14's tenth pass). Kept maps are cleared
/// (their values released) and bounded in number and size.
pub fn field_map(capacity: usize) -> HeaderMap {
    let spare = SPARE.with(|spare| spare.try_borrow_mut().ok().and_then(|mut s| s.pop()));
    match spare {
        Some(map) if map.capacity() >= capacity => map,
        _ => HeaderMap::with_capacity(capacity),
    }
}

/// Gives a request's field map back for [`field_map`] to reuse, once the request is done with.
pub fn recycle(mut map: HeaderMap) {
    if map.capacity() == 0 || map.capacity() > SPARE_MAP_FIELDS {
        return;
    }
    map.clear();
    SPARE.with(|spare| {
        if let Ok(mut spare) = spare.try_borrow_mut() {
            if spare.len() < SPARE_MAPS {
                spare.push(map);
            }
        }
    });
}

/// Whether this HTTP/1.1 request asks to switch protocols (WebSocket and friends).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(UPGRADE) && connection_lists(headers, "upgrade")
}

/// Whether every protocol `Upgrade` lists (RFC 9110 §7.8: `name[/version]`, comma-separated) is
/// in `allowed` (lower-case names). All or nothing: a tunnel once opened carries any protocol.
pub fn upgrade_allowed(headers: &HeaderMap, allowed: &[String]) -> bool {
    let mut any = false;
    for value in headers.get_all(UPGRADE) {
        let Ok(value) = value.to_str() else {
            return false;
        };
        for protocol in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let name = protocol.split('/').next().unwrap_or(protocol).trim();
            if !allowed.iter().any(|a| name.eq_ignore_ascii_case(a)) {
                return false;
            }
            any = true;
        }
    }
    any
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
///
/// In a request (`read` given: the names the config reads), a `Connection` option naming a field
/// the gateway relies on is ignored ([`relied_on`]: `Host`, framing, `Authorization`, the
/// forwarding fields, and `read`): a sender must not list end-to-end fields (§7.6.1), and
/// honouring it would forward a request other than the one the gateway routed and counted. A
/// response's options (`read` is `None`) are all honoured, as the lean exchange honours them.
///
/// Runs twice per proxied request, so it first looks at the names present (one pass, one match
/// on each name's text) and only then removes, instead of a hash lookup per hop-by-hop name.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool, read: Option<&[HeaderName]>) {
    let mut has_connection = false;
    let mut has_fixed = false;
    for name in headers.keys() {
        match name.as_str() {
            "connection" => has_connection = true,
            "keep-alive" | "proxy-connection" | "te" | "trailer" | "transfer-encoding" => {
                has_fixed = true;
            }
            "upgrade" if !upgrade => has_fixed = true,
            _ => {}
        }
    }
    if has_connection {
        remove_connection_and_named(headers, read);
    }
    if has_fixed {
        for name in [
            &KEEP_ALIVE,
            &PROXY_CONNECTION,
            &TE,
            &TRAILER,
            &TRANSFER_ENCODING,
            &UPGRADE,
        ] {
            if !(upgrade && *name == UPGRADE) {
                headers.remove(name);
            }
        }
    }
    if upgrade {
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

/// Removes `Connection` and the fields it names, except `Upgrade` when upgrading. One lookup
/// takes the field and its values together. The names removed anyway (`keep-alive`, the usual
/// one) are skipped before parsing, which would allocate.
fn remove_connection_and_named(headers: &mut HeaderMap, read: Option<&[HeaderName]>) {
    const REMOVED_ANYWAY_OR_KEPT: [&str; 7] = [
        "keep-alive",
        "connection",
        "upgrade",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
    ];
    let Entry::Occupied(entry) = headers.entry(CONNECTION) else {
        return;
    };
    let mut named: Vec<HeaderName> = Vec::new();
    let (_, values) = entry.remove_entry_mult();
    for value in values {
        let Ok(value) = value.to_str() else {
            continue;
        };
        for token in value.split(',').map(str::trim) {
            if REMOVED_ANYWAY_OR_KEPT
                .iter()
                .any(|n| token.eq_ignore_ascii_case(n))
            {
                continue;
            }
            if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
                if !read.is_some_and(|read| relied_on(&name, read)) {
                    named.push(name);
                }
            }
        }
    }
    for name in named {
        headers.remove(name);
    }
}

/// Whether the gateway relies on the field `name`, so that a client's `Connection` option may
/// not remove it: `Host` (routed and keyed on), the framing fields, `Authorization` (`jwt:` key
/// parts), every forwarding field ([`is_forwarding`]: the gateway sets or vouches for them), and
/// `read`, the names the config reads (route `headers:`, `header:` key parts, `exempt.headers`).
pub fn relied_on(name: &HeaderName, read: &[HeaderName]) -> bool {
    matches!(
        name.as_str(),
        "host" | "content-length" | "transfer-encoding" | "authorization"
    ) || is_forwarding(name.as_str())
        || read.contains(name)
}

/// Whether a (lower-case) field name is a forwarding field: one a proxy sets to tell the next hop
/// about the client or the request it first received. `Forwarded` (RFC 7239), every
/// `X-Forwarded-*` and `X-Original-*`, and the client-address fields in common use
/// ([`CLIENT_ADDRESS_FIELDS`]). Only a trusted proxy's reach an upstream ([`set_forwarded_as`]).
pub fn is_forwarding(name: &str) -> bool {
    name.starts_with("x-forwarded-")
        || name.starts_with("x-original-")
        || name == "forwarded"
        || CLIENT_ADDRESS_FIELDS.contains(&name)
}

/// The client-address and original-request fields that proxies, CDNs and frameworks set or read
/// besides the `Forwarded`, `X-Forwarded-*` and `X-Original-*` families.
pub const CLIENT_ADDRESS_FIELDS: [&str; 10] = [
    "x-real-ip",
    "x-client-ip",
    "client-ip",
    "true-client-ip",
    "x-cluster-client-ip",
    "cf-connecting-ip",
    "fastly-client-ip",
    "x-proxyuser-ip",
    "x-host",
    "x-rewrite-url",
];

pub use crate::config::Underscores;

/// Whether any field name has an underscore. One pass over the names, usually none.
pub fn has_underscore_name(headers: &HeaderMap) -> bool {
    headers.keys().any(underscored)
}

/// Whether a field name has an underscore. A byte search: `str::contains` sets up a pattern
/// searcher, which for names this short costs more than the search.
fn underscored(name: &HeaderName) -> bool {
    name.as_str().as_bytes().contains(&b'_')
}

/// Applies `policy` to the request's fields: `Err` when the request is to be refused. Costs one
/// look at each name; a map is changed only when a name has an underscore.
pub fn apply_underscores(headers: &mut HeaderMap, policy: Underscores) -> Result<(), &'static str> {
    if policy == Underscores::Allow || !has_underscore_name(headers) {
        return Ok(());
    }
    if policy == Underscores::Reject {
        return Err("a header name contains an underscore");
    }
    remove_names(headers, underscored);
    Ok(())
}

/// Removes every field whose name `matches`; the map is changed (and a list of names made) only
/// when one does.
fn remove_names(headers: &mut HeaderMap, matches: impl Fn(&HeaderName) -> bool) {
    if !headers.keys().any(&matches) {
        return;
    }
    let names: Vec<HeaderName> = headers.keys().filter(|n| matches(n)).cloned().collect();
    for name in names {
        headers.remove(name);
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
    set_forwarded_as(headers, peer, host, peer_trusted, "http");
}

/// [`set_forwarded`] for a request that arrived over `proto` (`https` on the TLS listener).
///
/// From a peer that is not a trusted proxy, every forwarding field ([`is_forwarding`]) is
/// removed first: the upstream gets only the gateway's own `X-Forwarded-For` (the peer),
/// `-Proto` and `-Host`. A trusted proxy's pass, its `X-Forwarded-For` appended to.
pub fn set_forwarded_as(
    headers: &mut HeaderMap,
    peer: IpAddr,
    host: Option<HeaderValue>,
    peer_trusted: bool,
    proto: &'static str,
) {
    if !peer_trusted {
        remove_forwarding(headers);
    }
    // Prior values are kept when the first one is text (several are joined in order); otherwise
    // the list restarts at the peer. One lookup reads and replaces the field.
    match headers.entry(&X_FORWARDED_FOR) {
        Entry::Occupied(mut entry) => {
            let mut xff = String::with_capacity(48);
            let mut prior = entry.iter();
            if let Some(Ok(first)) = prior.next().map(HeaderValue::to_str) {
                xff.push_str(first);
                for value in prior.filter_map(|v| v.to_str().ok()) {
                    xff.push_str(", ");
                    xff.push_str(value);
                }
                xff.push_str(", ");
            }
            crate::keys::push_ip(&mut xff, peer);
            if let Ok(value) = HeaderValue::try_from(xff) {
                entry.insert(value);
            }
        }
        Entry::Vacant(entry) => {
            if let Some(value) = peer_value(peer) {
                entry.insert(value);
            }
        }
    }
    if !(peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(proto));
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

/// Removes every forwarding field. One look at each name; the map is changed only when one is
/// there (names are lower-case, so the first byte rules most out).
fn remove_forwarding(headers: &mut HeaderMap) {
    remove_names(headers, |name: &HeaderName| {
        matches!(
            name.as_str().as_bytes().first(),
            Some(b'x' | b'f' | b'c' | b't')
        ) && is_forwarding(name.as_str())
    });
}

/// `peer` as a header value. A connection's requests all come from one peer, so the last value
/// made on this thread is kept: cloning it is a reference count, where making it is text, an
/// allocation and a validation.
fn peer_value(peer: IpAddr) -> Option<HeaderValue> {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(IpAddr, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        if let Some((ip, value)) = &*last {
            if *ip == peer {
                return Some(value.clone());
            }
        }
        let mut text = String::with_capacity(46);
        crate::keys::push_ip(&mut text, peer);
        let value = HeaderValue::try_from(text).ok()?;
        *last = Some((peer, value.clone()));
        Some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each test runs on a thread of its own, so the spare maps are this test's alone.
    #[test]
    fn a_recycled_map_comes_back_empty_and_the_spares_are_bounded() {
        let mut used = field_map(7);
        let room = used.capacity();
        assert!(room >= 7, "{room}");
        used.insert("x-a", HeaderValue::from_static("1"));
        used.append("x-b", HeaderValue::from_static("1"));
        used.append("x-b", HeaderValue::from_static("2"));
        recycle(used);
        let again = field_map(7);
        assert!(again.is_empty(), "{again:?}");
        assert_eq!(again.capacity(), room, "the allocation is reused");

        // Too small for what is asked: a new map, and the spare is dropped.
        recycle(again);
        assert!(field_map(room + 1).capacity() > room);
        assert_eq!(SPARE.with(|s| s.borrow().len()), 0);

        // A map with room for many fields is not kept.
        recycle(HeaderMap::with_capacity(SPARE_MAP_FIELDS * 2));
        assert_eq!(SPARE.with(|s| s.borrow().len()), 0);

        // At most SPARE_MAPS are kept.
        for _ in 0..SPARE_MAPS + 5 {
            recycle(HeaderMap::with_capacity(4));
        }
        assert_eq!(SPARE.with(|s| s.borrow().len()), SPARE_MAPS);
    }

    #[test]
    fn strips_connection_and_what_it_names() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false, None);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn upgrade_survives_when_upgrading() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(UPGRADE, HeaderValue::from_static("websocket"));
        assert!(is_upgrade(&h));
        strip_hop_by_hop(&mut h, true, None);
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
    fn only_allowed_upgrade_protocols_pass() {
        let allowed = ["websocket".to_string()];
        let with = |value: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(CONNECTION, HeaderValue::from_static("upgrade"));
            h.insert(UPGRADE, HeaderValue::from_static(value));
            upgrade_allowed(&h, &allowed)
        };
        assert!(with("websocket"));
        assert!(with("WebSocket"));
        assert!(with("websocket/13"));
        assert!(!with("h2c"));
        assert!(!with("websocket, h2c"));
        assert!(!with("h2c, websocket"));
        assert!(!with(""));
        assert!(!upgrade_allowed(&HeaderMap::new(), &allowed));
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
        assert_eq!(h[&X_FORWARDED_FOR], "10.0.0.1");
        assert_eq!(h[&X_FORWARDED_PROTO], "http");
        assert_eq!(h[&X_FORWARDED_HOST], "example.com");
    }

    #[test]
    fn connection_names_fields_in_any_case_and_keep_alive_goes_anyway() {
        let mut h = HeaderMap::new();
        h.insert(
            CONNECTION,
            HeaderValue::from_static("Keep-Alive, X-Secret, close"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("close", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false, None);
        assert_eq!(h.keys().collect::<Vec<_>>(), ["x-kept"]);
    }

    #[test]
    fn connection_cannot_name_away_a_field_the_gateway_relies_on() {
        let mut h = HeaderMap::new();
        h.insert(
            CONNECTION,
            HeaderValue::from_static(
                "Host, Authorization, X-Forwarded-Anything, Forwarded, X-Real-IP, X-Key, X-Hop",
            ),
        );
        for name in [
            "host",
            "authorization",
            "x-forwarded-anything",
            "forwarded",
            "x-real-ip",
            "x-key",
            "x-hop",
        ] {
            h.insert(HeaderName::from_static(name), HeaderValue::from_static("1"));
        }
        strip_hop_by_hop(&mut h, false, Some(&[HeaderName::from_static("x-key")]));
        let mut kept: Vec<_> = h.keys().map(HeaderName::as_str).collect();
        kept.sort_unstable();
        assert_eq!(
            kept,
            [
                "authorization",
                "forwarded",
                "host",
                "x-forwarded-anything",
                "x-key",
                "x-real-ip"
            ]
        );
    }

    #[test]
    fn underscore_names_are_dropped_refused_or_kept() {
        let with = || {
            let mut h = HeaderMap::new();
            h.insert("x_key", HeaderValue::from_static("1"));
            h.insert("_x", HeaderValue::from_static("1"));
            h.insert("x-key", HeaderValue::from_static("1"));
            h
        };
        let mut h = with();
        assert_eq!(apply_underscores(&mut h, Underscores::Drop), Ok(()));
        assert_eq!(h.keys().collect::<Vec<_>>(), ["x-key"]);
        assert!(apply_underscores(&mut with(), Underscores::Reject).is_err());
        let mut h = with();
        assert_eq!(apply_underscores(&mut h, Underscores::Allow), Ok(()));
        assert_eq!(h.len(), 3);
    }

    #[test]
    fn forwarding_fields_are_a_family_and_a_list() {
        for name in [
            "forwarded",
            "x-forwarded-for",
            "x-forwarded-prefix",
            "x-forwarded-whatever",
            "x-original-url",
            "x-real-ip",
            "true-client-ip",
            "cf-connecting-ip",
        ] {
            assert!(is_forwarding(name), "{name}");
        }
        for name in ["x-forwarded", "forwarded-for", "x-key", "host", "cookie"] {
            assert!(!is_forwarding(name), "{name}");
        }
    }

    #[test]
    fn upgrade_without_upgrading_is_dropped() {
        let mut h = HeaderMap::new();
        h.insert(UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        assert!(!is_upgrade(&h));
        strip_hop_by_hop(&mut h, false, None);
        assert_eq!(h.keys().collect::<Vec<_>>(), ["x-kept"]);
    }

    #[test]
    fn forwarded_for_joins_several_prior_values_in_order() {
        let mut h = HeaderMap::new();
        h.append(&X_FORWARDED_FOR, HeaderValue::from_static("1.1.1.1"));
        h.append(
            &X_FORWARDED_FOR,
            HeaderValue::from_static("2.2.2.2, 3.3.3.3"),
        );
        set_forwarded(&mut h, "10.0.0.1".parse().unwrap(), None, true);
        assert_eq!(h[&X_FORWARDED_FOR], "1.1.1.1, 2.2.2.2, 3.3.3.3, 10.0.0.1");
        assert_eq!(h.get_all(&X_FORWARDED_FOR).iter().count(), 1);
        assert!(!h.contains_key(&X_FORWARDED_HOST));
    }

    #[test]
    fn forwarded_for_restarts_when_the_prior_value_is_not_text() {
        let mut h = HeaderMap::new();
        h.insert(
            &X_FORWARDED_FOR,
            HeaderValue::from_bytes(b"1.1.1.1\xff").unwrap(),
        );
        set_forwarded(&mut h, "10.0.0.1".parse().unwrap(), None, true);
        assert_eq!(h[&X_FORWARDED_FOR], "10.0.0.1");
    }

    /// The last peer's value is kept per thread: a different peer must never get it.
    #[test]
    fn forwarded_for_follows_the_peer_when_it_changes() {
        for peer in [
            "10.0.0.1",
            "10.0.0.1",
            "10.0.0.2",
            "2001:db8::1",
            "10.0.0.1",
        ] {
            let mut h = HeaderMap::new();
            set_forwarded(&mut h, peer.parse().unwrap(), None, false);
            assert_eq!(h[&X_FORWARDED_FOR], peer);
        }
    }

    #[test]
    fn forwarded_for_writes_an_ipv6_peer_as_display_does() {
        let mut h = HeaderMap::new();
        set_forwarded(&mut h, "2001:db8::7".parse().unwrap(), None, false);
        assert_eq!(h[&X_FORWARDED_FOR], "2001:db8::7");
        h.insert(&X_FORWARDED_FOR, HeaderValue::from_static("192.0.2.1"));
        set_forwarded(&mut h, "10.1.22.255".parse().unwrap(), None, true);
        assert_eq!(h[&X_FORWARDED_FOR], "192.0.2.1, 10.1.22.255");
    }
}
