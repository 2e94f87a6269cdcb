use std::borrow::Cow;

use http::{Request, Version};

use super::*;

const SAFE: PathOptions = PathOptions {
    normalize_path: true,
    merge_slashes: true,
    escaped_slashes: EscapedSlashes::Reject,
    path_parameters: PathParameters::Reject,
};

fn norm(path: &str) -> Result<String, PathError> {
    normalize_path(path, SAFE).map(Cow::into_owned)
}

#[test]
fn every_spelling_of_one_path_normalises_to_it() {
    for spelling in [
        "/api/users/1",
        "//api/users/1",
        "/api//users/1",
        "/api/./users/1",
        "/api/x/../users/1",
        "/%61pi/users/1",
        "/%61%70%69/users/%31",
        "/api/users/./1",
        "/api/users/1/x/..",
        "/api/%2E/users/1",
        "/api/x/%2e%2E/users/1",
    ] {
        let want = if spelling.ends_with("..") {
            "/api/users/1/"
        } else {
            "/api/users/1"
        };
        assert_eq!(norm(spelling).as_deref(), Ok(want), "{spelling}");
    }
}

#[test]
fn a_canonical_path_is_borrowed() {
    for path in [
        "/",
        "/api/users/1",
        "/a/b/",
        "/a%20b",
        "/x.y/..z/...",
        "/%C3%A9",
    ] {
        assert!(
            matches!(normalize_path(path, SAFE), Ok(Cow::Borrowed(_))),
            "{path}"
        );
    }
}

#[test]
fn dot_segments_follow_rfc_3986_5_2_4() {
    let cases = [
        ("/a/b/c/./../../g", "/a/g"),
        ("/a/b/..", "/a/"),
        ("/a/b/.", "/a/b/"),
        ("/.", "/"),
        ("/a/..", "/"),
        ("/./a", "/a"),
        ("/a/.//b", "/a/b"),
        ("//", "/"),
        ("/a//", "/a/"),
        ("/a//%2E%2E/b", "/b"),
    ];
    for (path, want) in cases {
        assert_eq!(norm(path).as_deref(), Ok(want), "{path}");
    }
}

#[test]
fn escapes_are_upper_cased_and_unreserved_ones_decoded() {
    assert_eq!(norm("/a%7eb%2db").as_deref(), Ok("/a~b-b"));
    assert_eq!(norm("/a%3fb").as_deref(), Ok("/a%3Fb"));
    assert_eq!(norm("/%c3%a9").as_deref(), Ok("/%C3%A9"));
}

#[test]
fn a_path_above_the_root_or_badly_escaped_is_refused() {
    for path in ["/..", "/../x", "/a/../..", "/%2e%2e/x", "/a/./../../b"] {
        assert_eq!(norm(path), Err(PathError::AboveRoot), "{path}");
    }
    for path in ["/%", "/a%2", "/a%zz", "/%%41"] {
        assert_eq!(norm(path), Err(PathError::BadPercent), "{path}");
    }
}

#[test]
fn encoded_slashes_are_refused_or_kept() {
    for path in ["/a%2Fb", "/a%2fb", "/a%5cb", "/a%5C..%5Cb"] {
        assert_eq!(norm(path), Err(PathError::EncodedSlash), "{path}");
    }
    let keep = PathOptions {
        escaped_slashes: EscapedSlashes::Keep,
        ..SAFE
    };
    assert_eq!(
        normalize_path("/a%2fb/./c", keep).as_deref(),
        Ok("/a%2Fb/c")
    );
    assert!(matches!(
        normalize_path("/a%2Fb", keep),
        Ok(Cow::Borrowed(_))
    ));
}

#[test]
fn each_step_can_be_turned_off() {
    let raw = PathOptions {
        normalize_path: false,
        merge_slashes: false,
        escaped_slashes: EscapedSlashes::Keep,
        path_parameters: PathParameters::Keep,
    };
    for path in ["//a/./b/../%61%2f", "/../x", "/a;b/..;/c%3b"] {
        assert_eq!(normalize_path(path, raw).as_deref(), Ok(path));
    }
    let no_merge = PathOptions {
        merge_slashes: false,
        ..SAFE
    };
    assert_eq!(
        normalize_path("//a/./%62", no_merge).as_deref(),
        Ok("//a/b")
    );
    let no_normalize = PathOptions {
        normalize_path: false,
        ..SAFE
    };
    assert_eq!(
        normalize_path("//a/./%62", no_normalize).as_deref(),
        Ok("/a/./%62")
    );
    assert_eq!(
        normalize_path("/%zz", no_normalize),
        Err(PathError::BadPercent)
    );
}

#[test]
fn hosts_are_lower_cased_without_trailing_dot_or_default_port() {
    let cases = [
        ("a.example", "a.example"),
        ("A.Example", "a.example"),
        ("a.example.", "a.example"),
        ("a.example:80", "a.example"),
        ("A.EXAMPLE.:80", "a.example"),
        ("a.example:", "a.example"),
        ("a.example:8080", "a.example:8080"),
        ("a.example:08080", "a.example:8080"),
        ("[2001:DB8::1]:80", "[2001:db8::1]"),
        ("[::1]:9000", "[::1]:9000"),
        ("127.0.0.1:80", "127.0.0.1"),
        ("a:65535", "a:65535"),
        ("a:000000000000000000000080", "a"),
    ];
    for (raw, want) in cases {
        let got = canonical_host(raw).unwrap().unwrap();
        assert_eq!(got, want, "{raw}");
        assert_eq!(matches!(got, Cow::Borrowed(_)), raw == want, "{raw}");
    }
    for bad in [
        "a b",
        "a@b",
        "a:b",
        "a:99999",
        "a:65536",
        "a:4294967376",
        "[::1",
        "[::1]x",
        "a/b",
        "a:1:2",
        "a:+80",
    ] {
        assert_eq!(canonical_host(bad), Err(HostError::Invalid), "{bad}");
    }
    assert_eq!(canonical_host(""), Ok(None));
}

pub(super) fn request(version: Version, uri: &str, hosts: &[&str]) -> Request<()> {
    let mut req = Request::builder().version(version).uri(uri);
    for host in hosts {
        req = req.header("host", *host);
    }
    req.body(()).unwrap()
}

fn canonical(req: &mut Request<()>) -> Result<(Option<String>, String), Rejection> {
    canonicalize(req, SAFE)?;
    Ok((
        host::host(req.headers()).map(str::to_string),
        req.uri().to_string(),
    ))
}

#[test]
fn absolute_form_authority_wins_over_host() {
    let mut req = request(
        Version::HTTP_11,
        "http://B.example./x//y?q=%61",
        &["a.example"],
    );
    assert_eq!(
        canonical(&mut req),
        Ok((Some("b.example".into()), "/x/y?q=%61".into()))
    );
}

#[test]
fn h2_authority_and_a_conflicting_host_are_refused() {
    let mut agree = request(Version::HTTP_2, "http://a.example/x", &["A.example:80"]);
    assert_eq!(
        canonical(&mut agree).unwrap().0.as_deref(),
        Some("a.example")
    );
    let mut conflict = request(Version::HTTP_2, "http://a.example/x", &["b.example"]);
    assert_eq!(canonical(&mut conflict), Err(HostError::Conflict.into()));
}

#[test]
fn two_host_headers_are_refused() {
    let mut req = request(Version::HTTP_11, "/x", &["a.example", "a.example"]);
    assert_eq!(canonical(&mut req), Err(HostError::Duplicate.into()));
}

#[test]
fn only_http_1_0_may_omit_host() {
    let mut old = request(Version::HTTP_10, "/x", &[]);
    assert_eq!(canonical(&mut old), Ok((None, "/x".into())));
    let mut new = request(Version::HTTP_11, "/x", &[]);
    assert_eq!(canonical(&mut new), Err(HostError::Missing.into()));
    // An empty Host is allowed (the target has no authority), and no host to route on.
    let mut empty = request(Version::HTTP_11, "/x", &[""]);
    assert_eq!(canonical(&mut empty), Ok((None, "/x".into())));
}

#[test]
fn a_canonical_request_is_left_alone() {
    let mut req = request(Version::HTTP_11, "/api/users/1?x=%41", &["a.example"]);
    let before = req.headers().get("host").unwrap().as_bytes().as_ptr();
    assert_eq!(
        canonical(&mut req),
        Ok((Some("a.example".into()), "/api/users/1?x=%41".into()))
    );
    assert_eq!(
        req.headers().get("host").unwrap().as_bytes().as_ptr(),
        before
    );
}

/// Every spelling of a `;` path parameter that Tomcat, Jetty or Spring would cut off.
const PARAMETER_SPELLINGS: &[&str] = &[
    "/u/rt1;",
    "/u/rt1;x=1",
    "/u/rt1;jsessionid=ABC",
    "/u/;/rt1",
    "/rw/a/..;/..;/admin",
    "/rw/a/.;/admin",
    "/rw/a/..;x=1/admin",
    "/;/admin",
    "/a;b/c;d",
    "/u/rt1%3B",
    "/u/rt1%3b",
    "/u/rt1%3Bx=1",
    "/rw/a/..%3B/admin",
];

#[test]
fn regression_path_parameters_passed_normalisation() {
    for path in PARAMETER_SPELLINGS {
        assert_eq!(norm(path), Err(PathError::PathParameter), "{path}");
    }
}

#[test]
fn path_parameters_are_stripped_before_dot_segments_when_configured() {
    let strip = PathOptions {
        path_parameters: PathParameters::Strip,
        ..SAFE
    };
    for (path, want) in [
        ("/u/rt1;", "/u/rt1"),
        ("/u/rt1;x=1", "/u/rt1"),
        ("/u/rt1;jsessionid=ABC/", "/u/rt1/"),
        ("/u/;x/rt1", "/u/rt1"),
        ("/rw/a/b/..;/..;/admin", "/rw/admin"),
        ("/rw/a/.;/admin", "/rw/a/admin"),
        ("/a;b/c;d", "/a/c"),
        ("/a/;x", "/a/"),
    ] {
        assert_eq!(normalize_path(path, strip).as_deref(), Ok(want), "{path}");
    }
    assert_eq!(
        normalize_path("/a/..;/..;/admin", strip),
        Err(PathError::AboveRoot)
    );
    // An encoded `;` is refused even so: an upstream may decode it before it splits.
    for path in ["/u/rt1%3B", "/u/rt1%3b", "/a/..%3B/b"] {
        assert_eq!(
            normalize_path(path, strip),
            Err(PathError::PathParameter),
            "{path}"
        );
    }
    let keep = PathOptions {
        path_parameters: PathParameters::Keep,
        ..SAFE
    };
    assert!(matches!(
        normalize_path("/a;b=1/c", keep),
        Ok(Cow::Borrowed("/a;b=1/c"))
    ));
    assert_eq!(
        normalize_path("/a/..;/c%3b", keep).as_deref(),
        Ok("/a/..;/c%3B")
    );
}
