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
        client_prefix: ClientPrefix::default(),
        body: None,
        client_cert: None,
    };
    let mut out = String::from("r:p:");
    write_key(parts, &view, None, &mut out)
        .unwrap()
        .then_some(out)
}

/// The key of `parts` for a request to `path` (matched against `pattern`) with `query`, or the
/// error.
fn key_for(
    pattern: &str,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    parts: &[KeyPart],
    client_ip: &str,
    client_prefix: ClientPrefix,
) -> Result<Option<String>, KeyError> {
    let (m, _) = RouteMatch::with_pattern(pattern).unwrap();
    let head = crate::route::RequestHead {
        method: &Method::GET,
        host: None,
        path,
        headers,
    };
    let params = m.matches(&head).unwrap();
    let view = RequestView {
        method: &Method::GET,
        host: None,
        path,
        query,
        headers,
        params: &params,
        client_ip: client_ip.parse().unwrap(),
        client_prefix,
        body: None,
        client_cert: None,
    };
    let mut out = String::new();
    Ok(write_key(parts, &view, None, &mut out)?.then_some(out))
}

#[test]
fn path_parameters_are_percent_decoded_before_they_become_keys() {
    let h = HeaderMap::new();
    let key = |path| {
        key_for(
            "/u/{id}",
            path,
            None,
            &h,
            &[KeyPart::PathParam(0)],
            "192.0.2.1",
            ClientPrefix::default(),
        )
        .unwrap()
    };
    assert_eq!(key("/u/1"), Some("1".to_string()));
    assert_eq!(key("/u/%31"), Some("1".to_string()));
    assert_eq!(key("/u/a%20b"), key("/u/a%20b"));
    assert_eq!(
        key("/u/a%20b"),
        Some("a%20b".to_string()),
        "a space is escaped again"
    );
    assert_eq!(
        key("/u/a+b"),
        Some("a+b".to_string()),
        "`+` is literal in a path"
    );
}

#[test]
fn query_names_and_values_are_form_decoded() {
    let h = HeaderMap::new();
    let key = |query| {
        key_for(
            "/u/{id}",
            "/u/1",
            Some(query),
            &h,
            &[KeyPart::Query("user id".into())],
            "192.0.2.1",
            ClientPrefix::default(),
        )
    };
    let want = Ok(Some("a%20b".to_string()));
    assert_eq!(key("user+id=a+b"), want);
    assert_eq!(key("user%20id=a%20b"), want);
    assert_eq!(key("x=1&user%20id=%61+b"), want);
    assert_eq!(key("user+id=100%"), Ok(Some("100%25".to_string())));
    assert_eq!(key("other=1"), Ok(None));
}

#[test]
fn a_key_header_or_query_parameter_sent_twice_is_refused() {
    let mut h = HeaderMap::new();
    h.append("x-key", "zz".parse().unwrap());
    h.append("x-key", "k1".parse().unwrap());
    let header = KeyPart::Header(HeaderName::from_static("x-key"));
    let got = key_for(
        "/u/{id}",
        "/u/1",
        None,
        &h,
        std::slice::from_ref(&header),
        "192.0.2.1",
        ClientPrefix::default(),
    );
    assert_eq!(
        got,
        Err(KeyError::RepeatedHeader(HeaderName::from_static("x-key")))
    );
    // Even when another part is absent, so the policy would not apply.
    let parts = [KeyPart::Query("absent".into()), header];
    let got = key_for(
        "/u/{id}",
        "/u/1",
        None,
        &h,
        &parts,
        "192.0.2.1",
        ClientPrefix::default(),
    );
    assert!(got.is_err());
    let none = HeaderMap::new();
    let query = [KeyPart::Query("k".into())];
    for q in ["k=1&k=2", "k=1&%6B=1", "k=1&k"] {
        let got = key_for(
            "/u/{id}",
            "/u/1",
            Some(q),
            &none,
            &query,
            "192.0.2.1",
            ClientPrefix::default(),
        );
        assert_eq!(got, Err(KeyError::RepeatedQuery("k".into())), "{q}");
    }
}

#[test]
fn client_ip_keys_are_network_prefixes_and_mapped_ipv4_is_ipv4() {
    let h = HeaderMap::new();
    let key = |ip: &str, prefix: ClientPrefix| {
        key_for(
            "/u/{id}",
            "/u/1",
            None,
            &h,
            &[KeyPart::ClientIp],
            ip,
            prefix,
        )
        .unwrap()
        .unwrap()
    };
    let default = ClientPrefix::default();
    assert_eq!(
        key("2001:db8:1:2:aaaa:bbbb:cccc:dddd", default),
        "2001:db8:1:2::/64"
    );
    assert_eq!(key("2001:db8:1:2::1", default), "2001:db8:1:2::/64");
    assert_eq!(key("2001:db8:1:3::1", default), "2001:db8:1:3::/64");
    assert_eq!(key("192.0.2.77", default), "192.0.2.77");
    assert_eq!(key("::ffff:192.0.2.77", default), "192.0.2.77");
    let wide = ClientPrefix {
        ipv4: 24,
        ipv6: 128,
    };
    assert_eq!(key("::ffff:192.0.2.77", wide), "192.0.2.0/24");
    assert_eq!(key("2001:db8::7", wide), "2001:db8::7");
}

#[test]
fn an_ipv4_mapped_trusted_range_trusts_the_ipv4_peer() {
    let trusted = TrustedProxies::new(vec!["::ffff:10.0.0.0/104".parse().unwrap()]);
    assert!(trusted.contains(&"10.1.2.3".parse().unwrap()));
    let mut h = HeaderMap::new();
    h.insert("x-forwarded-for", "::ffff:198.51.100.9".parse().unwrap());
    assert_eq!(
        trusted.client_ip("::ffff:10.0.0.1".parse().unwrap(), &h),
        "198.51.100.9".parse::<IpAddr>().unwrap()
    );
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

/// `jwt:CLAIM` parts read verified claims only, bounded and escaped like any request material.
#[test]
fn jwt_claims_are_bounded_and_absent_without_verified_claims() {
    let (m, _) = RouteMatch::with_pattern("/").unwrap();
    let headers = HeaderMap::new();
    let head = crate::route::RequestHead {
        method: &Method::GET,
        host: None,
        path: "/",
        headers: &headers,
    };
    let params = m.matches(&head).unwrap();
    let view = RequestView {
        method: &Method::GET,
        host: None,
        path: "/",
        query: None,
        headers: &headers,
        params: &params,
        client_ip: "192.0.2.1".parse().unwrap(),
        client_prefix: ClientPrefix::default(),
        body: None,
        client_cert: None,
    };
    let claims = crate::jwt::Claims::from_map(
        &serde_json::from_value(serde_json::json!({
            "sub": "a|b{c}", "tenant": 42, "long": "x".repeat(MAX_KEY_VALUE_BYTES + 1), "roles": ["x"]
        }))
        .unwrap(),
        None,
    );
    let key = |parts: &[&str], claims: Option<&crate::jwt::Claims>| {
        let parts: Vec<KeyPart> = parts.iter().map(|p| KeyPart::Jwt((*p).into())).collect();
        let mut out = String::new();
        write_key(&parts, &view, claims, &mut out)
            .unwrap()
            .then_some(out)
    };
    assert_eq!(
        key(&["sub", "tenant"], Some(&claims)).as_deref(),
        Some("a%7Cb%7Bc%7D|42")
    );
    let long = key(&["long"], Some(&claims)).unwrap();
    assert_eq!(long.len(), 1 + 32, "a digest: {long}");
    assert!(long.starts_with('#'));
    assert_eq!(key(&["roles"], Some(&claims)), None);
    assert_eq!(key(&["sub"], None), None, "no verified token");
}

/// Every value a counter key holds passes `check_key_value`, and nothing else does: an override
/// key is accepted exactly when some request could name it.
#[test]
fn check_key_value_accepts_exactly_what_a_counter_key_holds() {
    let long = "x".repeat(MAX_KEY_VALUE_BYTES + 1);
    for value in [
        "acme",
        "a b",
        "a|b",
        "100%",
        "{tag}",
        "#1",
        "é",
        "",
        long.as_str(),
    ] {
        let mut written = String::new();
        push_bounded(value.as_bytes(), &mut written);
        assert_eq!(
            check_key_value(&written),
            Ok(()),
            "{value:?} written {written:?}"
        );
    }
    for (part, canonical) in [
        ("a b", "a%20b"),
        ("a%41", "aA"),
        ("a%7c", "a%7C"),
        ("100%", "100%25"),
        ("{t}", "%7Bt%7D"),
        ("#1", "%231"),
    ] {
        assert_eq!(check_key_value(part), Err(canonical.to_owned()), "{part}");
    }
}
