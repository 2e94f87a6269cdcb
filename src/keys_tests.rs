use super::*;
use crate::route::RouteMatch;

fn key_of(parts: &[KeyPart], headers: &HeaderMap, query: Option<&str>) -> Option<String> {
    let (m, _) = RouteMatch::with_pattern("/u/{id}").unwrap();
    let head = crate::route::RequestHead {
        method: &Method::GET,
        host: Some("h.example"),
        path: "/u/7",
        headers,
    };
    let params = m.matches(&head).unwrap();
    let view = RequestView {
        method: &Method::GET,
        host: Some("h.example"),
        path: "/u/7",
        query,
        headers,
        params: &params,
        client_ip: "192.0.2.1".parse().unwrap(),
    };
    let mut out = String::from("r:p:");
    write_key(parts, &view, &mut out).then_some(out)
}

#[test]
fn every_part_kind_contributes_its_value() {
    let mut h = HeaderMap::new();
    h.insert("x-api-key", "k1".parse().unwrap());
    let parts = [
        KeyPart::ClientIp,
        KeyPart::Header(HeaderName::from_static("x-api-key")),
        KeyPart::PathParam(0),
        KeyPart::Query("plan".into()),
        KeyPart::Method,
        KeyPart::Host,
    ];
    assert_eq!(
        key_of(&parts, &h, Some("a=1&plan=gold")).as_deref(),
        Some("r:p:192.0.2.1|k1|7|gold|GET|h.example")
    );
}

#[test]
fn an_absent_part_means_the_policy_does_not_apply() {
    let h = HeaderMap::new();
    assert_eq!(
        key_of(
            &[KeyPart::Header(HeaderName::from_static("x-api-key"))],
            &h,
            None
        ),
        None
    );
    assert_eq!(
        key_of(&[KeyPart::Query("plan".into())], &h, Some("other=1")),
        None
    );
}

#[test]
fn structural_bytes_are_escaped_so_keys_stay_unambiguous() {
    let mut h = HeaderMap::new();
    h.insert("x-a", "a|b{c}%".parse().unwrap());
    let key = key_of(&[KeyPart::Header(HeaderName::from_static("x-a"))], &h, None).unwrap();
    assert_eq!(key, "r:p:a%7Cb%7Bc%7D%25");
}

#[test]
fn long_values_are_hashed_and_stay_distinct() {
    let long_a = "a".repeat(MAX_KEY_VALUE_BYTES) + "1";
    let long_b = "a".repeat(MAX_KEY_VALUE_BYTES) + "2";
    let key = |v: &str| {
        let mut h = HeaderMap::new();
        h.insert("x-a", v.parse().unwrap());
        key_of(&[KeyPart::Header(HeaderName::from_static("x-a"))], &h, None).unwrap()
    };
    let (a, b) = (key(&long_a), key(&long_b));
    assert_ne!(a, b);
    assert_eq!(a.len(), "r:p:#".len() + 32);
    // At the limit, the value is kept as is.
    assert_eq!(
        key(&"z".repeat(MAX_KEY_VALUE_BYTES)).len(),
        4 + MAX_KEY_VALUE_BYTES
    );
}

fn xff(value: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("x-forwarded-for", value.parse().unwrap());
    h
}

#[test]
fn forwarded_for_is_believed_only_from_trusted_peers() {
    let trusted = TrustedProxies::new(vec!["10.0.0.0/8".parse().unwrap()]);
    let h = xff("203.0.113.9");
    assert_eq!(
        trusted.client_ip("198.51.100.1".parse().unwrap(), &h),
        "198.51.100.1".parse::<IpAddr>().unwrap()
    );
    assert_eq!(
        trusted.client_ip("10.1.1.1".parse().unwrap(), &h),
        "203.0.113.9".parse::<IpAddr>().unwrap()
    );
}

#[test]
fn the_rightmost_untrusted_hop_is_the_client() {
    let trusted = TrustedProxies::new(vec!["10.0.0.0/8".parse().unwrap()]);
    // The client forged the first entry; the trusted proxies appended the rest.
    let h = xff("1.2.3.4, 203.0.113.9, 10.0.0.2");
    assert_eq!(
        trusted.client_ip("10.0.0.1".parse().unwrap(), &h),
        "203.0.113.9".parse::<IpAddr>().unwrap()
    );
    // Several header lines read as one list, in order.
    let mut h = xff("1.2.3.4");
    h.append("x-forwarded-for", "203.0.113.7".parse().unwrap());
    assert_eq!(
        trusted.client_ip("10.0.0.1".parse().unwrap(), &h),
        "203.0.113.7".parse::<IpAddr>().unwrap()
    );
    // All trusted: the leftmost.
    let h = xff("10.9.9.9, 10.0.0.2");
    assert_eq!(
        trusted.client_ip("10.0.0.1".parse().unwrap(), &h),
        "10.9.9.9".parse::<IpAddr>().unwrap()
    );
    // Garbage stops the walk at the last hop we could trust.
    let h = xff("203.0.113.9, not-an-ip");
    assert_eq!(
        trusted.client_ip("10.0.0.1".parse().unwrap(), &h),
        "10.0.0.1".parse::<IpAddr>().unwrap()
    );
}

#[test]
fn ipv4_mapped_peers_are_canonical() {
    let none = TrustedProxies::default();
    let peer: IpAddr = "::ffff:192.0.2.5".parse().unwrap();
    assert_eq!(
        none.client_ip(peer, &HeaderMap::new()),
        "192.0.2.5".parse::<IpAddr>().unwrap()
    );
}

#[test]
fn push_ip_writes_what_display_writes() {
    let mut ips: Vec<IpAddr> = ["::1", "2001:db8::7", "::ffff:10.0.0.1", "fe80::1:2:3:4"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    for octet in 0..=255u8 {
        ips.push(IpAddr::from([octet, 255 - octet, octet / 7, 100]));
    }
    for ip in ips {
        let mut out = String::from("prefix:");
        push_ip(&mut out, ip);
        assert_eq!(out, format!("prefix:{ip}"));
    }
}
