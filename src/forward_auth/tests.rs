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

fn host(req: &Request<()>) -> &str {
    req.headers()
        .get(HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
}

#[test]
fn traefik_and_caddy_headers_name_the_request() {
    let req = original_request(
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
    let req = original_request(
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
    let req = original_request(
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
fn forwarded_uri_wins_over_original_url_and_the_call_method_is_the_fallback() {
    let req = original_request(
        &Method::HEAD,
        headers(&[
            ("x-forwarded-uri", "/first"),
            ("x-original-url", "http://h.example/second"),
        ]),
    )
    .expect("valid");
    assert_eq!(req.method(), Method::HEAD);
    assert_eq!(req.uri(), "/first");
    assert_eq!(host(&req), "h.example");
}

#[test]
fn a_call_without_a_target_or_with_a_bad_one_is_malformed() {
    assert_eq!(
        original_request(&Method::GET, headers(&[("host", "a")])).unwrap_err(),
        Malformed::NoUri
    );
    assert!(matches!(
        original_request(&Method::GET, headers(&[("x-forwarded-uri", "http://a/b")])),
        Err(Malformed::Invalid(..))
    ));
    assert!(matches!(
        original_request(&Method::GET, headers(&[("x-original-url", "/relative")])),
        Err(Malformed::Invalid(..))
    ));
    assert!(matches!(
        original_request(
            &Method::GET,
            headers(&[("x-forwarded-uri", "/a"), ("x-forwarded-uri", "/b")])
        ),
        Err(Malformed::Repeated(_))
    ));
    assert!(matches!(
        original_request(
            &Method::GET,
            headers(&[("x-forwarded-uri", "/a"), ("x-forwarded-method", "G E T")])
        ),
        Err(Malformed::Invalid(..))
    ));
}
