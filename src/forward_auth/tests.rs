use ::http::{HeaderMap, HeaderValue, Method};

use super::*;

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(
            HeaderName::from_bytes(name.as_bytes()).expect("name"),
            HeaderValue::from_str(value).expect("value"),
        );
    }
    map
}

fn auto(method: &Method, headers: HeaderMap) -> Result<Request<()>, Malformed> {
    original_request(method, headers, CheckProxy::Auto)
}

fn host(req: &Request<()>) -> &str {
    req.headers()
        .get(HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
}

#[test]
fn traefik_and_caddy_headers_name_the_request() {
    let req = auto(
        &Method::GET,
        headers(&[
            ("host", "turnstile:8082"),
            ("x-forwarded-method", "POST"),
            ("x-forwarded-uri", "/api/users/7?x=1"),
            ("x-forwarded-host", "shop.example"),
            ("x-api-key", "k1"),
        ]),
    )
    .expect("valid");
    assert_eq!(req.method(), Method::POST);
    assert_eq!(req.uri(), "/api/users/7?x=1");
    assert_eq!(host(&req), "shop.example");
    assert_eq!(req.headers()["x-api-key"], "k1");
    assert!(req.headers().get("x-forwarded-uri").is_none());
    assert!(req.headers().get("x-forwarded-method").is_none());
}

#[test]
fn nginx_headers_name_the_request_and_host_stays() {
    let req = auto(
        &Method::GET,
        headers(&[
            ("host", "shop.example"),
            ("x-original-method", "DELETE"),
            ("x-original-uri", "/a/b"),
        ]),
    )
    .expect("valid");
    assert_eq!(req.method(), Method::DELETE);
    assert_eq!(req.uri(), "/a/b");
    assert_eq!(host(&req), "shop.example");
}

#[test]
fn ingress_nginx_original_url_gives_target_and_host() {
    let req = auto(
        &Method::GET,
        headers(&[
            ("host", "turnstile.svc"),
            ("x-original-method", "PUT"),
            ("x-original-url", "https://Shop.Example/api/users/9?q=2"),
        ]),
    )
    .expect("valid");
    assert_eq!(req.method(), Method::PUT);
    assert_eq!(req.uri(), "/api/users/9?q=2");
    assert_eq!(host(&req), "Shop.Example");
}

#[test]
fn a_call_without_a_target_or_with_a_bad_one_is_malformed() {
    assert_eq!(
        auto(&Method::GET, headers(&[("host", "a")])).unwrap_err(),
        Malformed::NoUri
    );
    assert!(matches!(
        auto(&Method::GET, headers(&[("x-forwarded-uri", "http://a/b")])),
        Err(Malformed::Invalid(..))
    ));
    assert!(matches!(
        auto(&Method::GET, headers(&[("x-original-url", "/relative")])),
        Err(Malformed::Invalid(..))
    ));
    assert!(matches!(
        auto(
            &Method::GET,
            headers(&[("x-forwarded-uri", "/a"), ("x-forwarded-uri", "/b")])
        ),
        Err(Malformed::Repeated(_))
    ));
    assert!(matches!(
        auto(
            &Method::GET,
            headers(&[("x-forwarded-uri", "/a"), ("x-forwarded-method", "G E T")])
        ),
        Err(Malformed::Invalid(..))
    ));
}

#[test]
fn the_call_method_is_the_fallback_without_a_method_field() {
    let req = auto(&Method::HEAD, headers(&[("x-forwarded-uri", "/first")])).expect("valid");
    assert_eq!(req.method(), Method::HEAD);
    assert_eq!(req.uri(), "/first");
}

/// Every naming field a client could add beside the ones its proxy sets.
const SPOOFS: [(&str, &str); 6] = [
    ("x-forwarded-uri", "/nowhere"),
    ("x-forwarded-method", "POST"),
    ("x-forwarded-host", "other.example"),
    ("x-original-uri", "/nowhere"),
    ("x-original-method", "POST"),
    ("x-original-url", "http://other.example/nowhere"),
];

/// What each proxy sends of its own for `GET shop.example/api/users/7`.
fn proxy_call(proxy: CheckProxy) -> Vec<(&'static str, &'static str)> {
    match proxy {
        CheckProxy::Nginx => vec![
            ("host", "shop.example"),
            ("x-original-method", "GET"),
            ("x-original-uri", "/api/users/7"),
        ],
        CheckProxy::IngressNginx => vec![
            ("host", "turnstile.svc"),
            ("x-original-method", "GET"),
            ("x-original-url", "http://shop.example/api/users/7"),
        ],
        CheckProxy::Forwarded | CheckProxy::Auto => vec![
            ("host", "turnstile.svc"),
            ("x-forwarded-method", "GET"),
            ("x-forwarded-uri", "/api/users/7"),
            ("x-forwarded-host", "shop.example"),
        ],
    }
}

#[test]
fn forward_auth_never_believes_a_naming_field_the_client_added() {
    for proxy in [
        CheckProxy::Nginx,
        CheckProxy::IngressNginx,
        CheckProxy::Forwarded,
    ] {
        for spoof in SPOOFS {
            let sent = proxy_call(proxy);
            // The proxy overwrites its own names: a spoof of one of those never arrives.
            if sent.iter().any(|(n, _)| *n == spoof.0) {
                continue;
            }
            let call = headers(&[sent.as_slice(), &[spoof]].concat());
            for named in [proxy, CheckProxy::Auto] {
                let case = format!("{proxy:?} as {named:?}, {spoof:?}");
                match original_request(&Method::GET, call.clone(), named) {
                    Ok(req) => {
                        assert_eq!(req.method(), Method::GET, "{case}");
                        assert_eq!(req.uri(), "/api/users/7", "{case}");
                        assert_eq!(host(&req), "shop.example", "{case}");
                        assert!(req.headers().get(spoof.0).is_none(), "{case}");
                    }
                    Err(e) => {
                        assert_eq!(named, CheckProxy::Auto, "{case}: {e}");
                        assert!(matches!(e, Malformed::Mixed(..)), "{case}: {e}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_named_proxy_needs_its_own_method_and_target_fields() {
    let nginx = headers(&[("host", "a"), ("x-original-uri", "/x")]);
    assert_eq!(
        original_request(&Method::GET, nginx, CheckProxy::Nginx).unwrap_err(),
        Malformed::Missing(X_ORIGINAL_METHOD, "nginx")
    );
    let traefik = headers(&[("x-forwarded-method", "GET"), ("x-original-uri", "/x")]);
    assert_eq!(
        original_request(&Method::GET, traefik, CheckProxy::Forwarded).unwrap_err(),
        Malformed::Missing(X_FORWARDED_URI, "traefik")
    );
}

#[test]
fn auto_refuses_both_nginx_spellings_of_the_target() {
    assert_eq!(
        auto(
            &Method::GET,
            headers(&[("x-original-uri", "/a"), ("x-original-url", "http://h/b")])
        )
        .unwrap_err(),
        Malformed::Mixed(X_ORIGINAL_URI, X_ORIGINAL_URL)
    );
}
