use super::*;

fn head<'a>(method: &'a Method, path: &'a str, headers: &'a HeaderMap) -> RequestHead<'a> {
    RequestHead {
        method,
        host: Some("api.example.com:8080"),
        path,
        headers,
    }
}

fn pattern(p: &str) -> (RouteMatch, Vec<String>) {
    RouteMatch::with_pattern(p).unwrap()
}

#[test]
fn params_are_slices_of_the_path() {
    let (m, names) = pattern("/api/users/{user_id}/posts/{post}");
    assert_eq!(names, ["user_id", "post"]);
    let h = HeaderMap::new();
    let path = "/api/users/42/posts/7";
    let params = m.matches(&head(&Method::GET, path, &h)).unwrap();
    assert_eq!(params.get(path, 0), Some("42"));
    assert_eq!(params.get(path, 1), Some("7"));
    assert_eq!(params.get(path, 2), None);
}

#[test]
fn a_param_matches_exactly_one_non_empty_segment() {
    let (m, _) = pattern("/users/{id}");
    let h = HeaderMap::new();
    for miss in ["/users", "/users/", "/users/1/2", "/userz/1", "users/1"] {
        assert!(m.matches(&head(&Method::GET, miss, &h)).is_none(), "{miss}");
    }
}

#[test]
fn catch_all_takes_the_rest_even_when_empty() {
    let (m, _) = pattern("/files/{*rest}");
    let h = HeaderMap::new();
    let path = "/files/a/b/c.txt";
    assert_eq!(
        m.matches(&head(&Method::GET, path, &h))
            .unwrap()
            .get(path, 0),
        Some("a/b/c.txt")
    );
    let path = "/files/";
    assert_eq!(
        m.matches(&head(&Method::GET, path, &h))
            .unwrap()
            .get(path, 0),
        Some("")
    );
    let path = "/files";
    assert_eq!(
        m.matches(&head(&Method::GET, path, &h))
            .unwrap()
            .get(path, 0),
        Some("")
    );
    assert!(m.matches(&head(&Method::GET, "/filesx", &h)).is_none());
}

#[test]
fn bad_patterns_are_rejected_with_a_reason() {
    for (p, why) in [
        ("users/{id}", "start with"),
        ("/a/{*rest}/b", "last segment"),
        ("/a/x{id}", "literal or one whole"),
        ("/a/{id}/{id}", "twice"),
        ("/a/{}", "parameter names"),
    ] {
        let err = RouteMatch::with_pattern(p).unwrap_err();
        assert!(err.contains(why), "{p}: {err}");
    }
}

#[test]
fn methods_host_and_headers_must_all_hold() {
    let mut m = RouteMatch::with_prefix("/api/").unwrap();
    m.set_methods(vec![Method::GET, Method::POST]);
    m.set_host("API.example.com");
    m.add_header(
        HeaderName::from_static("x-tenant"),
        HeaderValue::from_static("acme"),
    );
    let mut h = HeaderMap::new();
    assert!(
        m.matches(&head(&Method::GET, "/api/x", &h)).is_none(),
        "header missing"
    );
    h.insert("x-tenant", HeaderValue::from_static("acme"));
    assert!(
        m.matches(&head(&Method::GET, "/api/x", &h)).is_some(),
        "host matches without its port"
    );
    assert!(m.matches(&head(&Method::DELETE, "/api/x", &h)).is_none());
    assert!(m.matches(&head(&Method::GET, "/other", &h)).is_none());
    let other_host = RequestHead {
        host: Some("evil.example.com"),
        ..head(&Method::GET, "/api/x", &h)
    };
    assert!(m.matches(&other_host).is_none());
}

#[test]
fn a_pattern_matches_with_or_without_one_trailing_slash_with_the_same_params() {
    let h = HeaderMap::new();
    let (m, _) = pattern("/api/users/{id}");
    for path in ["/api/users/1", "/api/users/1/"] {
        let params = m.matches(&head(&Method::GET, path, &h)).unwrap();
        assert_eq!(params.get(path, 0), Some("1"), "{path}");
    }
    for miss in ["/api/users/1//", "/api/users//", "/api/users/"] {
        assert!(m.matches(&head(&Method::GET, miss, &h)).is_none(), "{miss}");
    }
    let (m, _) = pattern("/health/");
    for path in ["/health", "/health/"] {
        assert!(m.matches(&head(&Method::GET, path, &h)).is_some(), "{path}");
    }
    let (m, _) = pattern("/files/{*rest}");
    for path in ["/files/a/b", "/files/a/b/"] {
        let params = m.matches(&head(&Method::GET, path, &h)).unwrap();
        assert_eq!(params.get(path, 0), Some("a/b"), "{path}");
    }
    let (root, _) = pattern("/");
    assert!(root.matches(&head(&Method::GET, "/", &h)).is_some());
}
