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

/// The first of `matchers` matching `head`, tested one by one: what the table must answer.
fn first_match(matchers: &[RouteMatch], head: &RequestHead<'_>) -> Option<(usize, Vec<String>)> {
    matchers.iter().enumerate().find_map(|(i, m)| {
        let params = m.matches(head)?;
        let values = (0..MAX_PARAMS)
            .map_while(|p| params.get(head.path, p).map(str::to_string))
            .collect();
        Some((i, values))
    })
}

fn table_fixture() -> Vec<RouteMatch> {
    let mut matchers = Vec::new();
    let mut get_only = pattern("/api/users/{id}").0;
    get_only.set_methods(vec![Method::GET]);
    matchers.push(get_only);
    let mut hosted = RouteMatch::with_prefix("/api/").unwrap();
    hosted.set_host("other.example");
    matchers.push(hosted);
    matchers.push(pattern("/{tenant}/users/{id}").0);
    let mut posts = pattern("/api/users/{id}").0;
    posts.set_methods(vec![Method::POST, Method::PUT]);
    matchers.push(posts);
    matchers.push(RouteMatch::with_prefix("/api").unwrap());
    matchers.push(pattern("/files/{*rest}").0);
    matchers.push(pattern("/{*all}").0);
    matchers.push(pattern("/").0);
    let mut deletes = RouteMatch::default();
    deletes.set_methods(vec![Method::DELETE, Method::GET]);
    matchers.push(deletes);
    matchers
}

#[test]
fn the_route_table_answers_what_testing_every_route_in_order_answers() {
    let matchers = table_fixture();
    let table = RouteTable::new(&matchers);
    let h = HeaderMap::new();
    let paths = [
        "/",
        "/api",
        "/apis",
        "/api/",
        "/api/users/1",
        "/api/users/1/",
        "/api/users",
        "/acme/users/1",
        "/files",
        "/files/",
        "/files/a/b",
        "/x",
        "/x/y/z",
        "*",
        "",
        "/api/users/1/2",
    ];
    for method in [Method::GET, Method::POST, Method::DELETE, Method::PATCH] {
        for path in paths {
            let head = head(&method, path, &h);
            let want = first_match(&matchers, &head);
            let got = match table.find(&matchers, &head) {
                Found::Route(i, params) => Some((
                    i,
                    (0..MAX_PARAMS)
                        .map_while(|p| params.get(path, p).map(str::to_string))
                        .collect(),
                )),
                _ => None,
            };
            assert_eq!(got, want, "{method} {path}");
        }
    }
}

#[test]
fn one_pass_tells_a_405_from_a_404_with_the_allowed_methods_in_config_order() {
    let mut matchers = Vec::new();
    let mut gets = pattern("/api/users/{id}").0;
    gets.set_methods(vec![Method::GET]);
    matchers.push(gets);
    let mut writes = pattern("/{any}/users/{id}").0;
    writes.set_methods(vec![Method::PUT, Method::GET, Method::POST]);
    matchers.push(writes);
    let table = RouteTable::new(&matchers);
    let h = HeaderMap::new();
    let delete = head(&Method::DELETE, "/api/users/7", &h);
    let Found::OtherMethods(from) = table.find(&matchers, &delete) else {
        panic!("a 405")
    };
    let allow = table.allowed_methods(&matchers, &delete, from);
    assert_eq!(allow, [&Method::GET, &Method::PUT, &Method::POST]);
    assert!(matches!(
        table.find(&matchers, &head(&Method::DELETE, "/api/users", &h)),
        Found::Nothing
    ));
}

/// 10,000 routes `/svcN/items/{id}` then one catch-all under `/static/`.
fn many_routes() -> Vec<RouteMatch> {
    let mut matchers: Vec<RouteMatch> = (0..10_000)
        .map(|i| pattern(&format!("/svc{i}/items/{{id}}")).0)
        .collect();
    matchers.push(RouteMatch::with_prefix("/static/").unwrap());
    matchers
}

#[test]
fn regression_a_long_path_without_a_slash_was_tested_against_every_route() {
    let matchers = many_routes();
    let table = RouteTable::new(&matchers);
    let h = HeaderMap::new();
    let long = format!("/{}", "a".repeat(30_000));
    let (found, tested) = table.find_counting(&matchers, &head(&Method::GET, &long, &h));
    assert!(matches!(found, Found::Nothing));
    assert_eq!(tested, 0, "no route can match its first segment");
    // Long and slash-rich, under an indexed first segment: one route tested, whatever the length.
    let deep = format!("/svc9999/{}", "a/".repeat(15_000));
    let (found, tested) = table.find_counting(&matchers, &head(&Method::GET, &deep, &h));
    assert!(matches!(found, Found::Nothing));
    assert_eq!(tested, 1);
    let last = "/svc9999/items/1";
    let (found, tested) = table.find_counting(&matchers, &head(&Method::GET, last, &h));
    assert!(matches!(found, Found::Route(9999, _)));
    assert_eq!(tested, 1);
    let (found, tested) = table.find_counting(&matchers, &head(&Method::GET, "/static/a.css", &h));
    assert!(matches!(found, Found::Route(10_000, _)));
    assert_eq!(tested, 1);
}
