//! The property of issue 9: whatever the spelling of a request's path (dot segments, doubled
//! slashes, %-encoded characters, a trailing slash), host (case, trailing dot, default port,
//! absolute-form) and key values (%-encoding, `+`), and whichever address of its /64 the client
//! uses, it meets the same route and the same counter key.

use http::{HeaderMap, Method, Request, Version};
use proptest::prelude::*;

use super::tests::request;
use super::*;
use crate::keys::{write_key, ClientPrefix, KeyPart, RequestView};
use crate::route::{RequestHead, RouteMatch};

const SAFE: PathOptions = PathOptions {
    normalize_path: true,
    merge_slashes: true,
    escaped_slashes: EscapedSlashes::Reject,
    path_parameters: PathParameters::Reject,
};

/// Characters of a user id and query value: unreserved ones and some that must be escaped.
const VALUE_CHARS: &[u8] = b"abcXYZ019-._~ @!$&'()*+,;=:\"<>\xc3\xa9";

fn value_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(VALUE_CHARS.to_vec()), 1..8)
        .prop_filter("not a dot segment", |v| v != b"." && v != b"..")
}

/// One spelling of `byte` in a path or query: itself when it may appear raw, else `%XX` in either
/// case.
fn spell_byte(byte: u8, raw_ok: bool, lower: bool, raw: bool, out: &mut String) {
    if raw && raw_ok {
        out.push(char::from(byte));
    } else if lower {
        out.push_str(&format!("%{byte:02x}"));
    } else {
        out.push_str(&format!("%{byte:02X}"));
    }
}

fn spell(value: &[u8], in_query: bool, choices: &[(bool, bool)], out: &mut String) {
    for (i, &byte) in value.iter().enumerate() {
        let (raw, lower) = choices[i % choices.len()];
        if in_query && byte == b' ' && raw {
            out.push('+');
            continue;
        }
        // pchar (RFC 3986 §3.3) may appear raw; in a query, not the separators `&`, `=`, `+`.
        let sub_delim = b"!$&'()*+,;=:@".contains(&byte);
        let separator = in_query && b"&=+".contains(&byte);
        let raw_ok = path::is_unreserved(byte) || (sub_delim && !separator);
        spell_byte(byte, raw_ok, lower, raw, out);
    }
}

#[derive(Debug, Clone)]
struct Spelling {
    choices: Vec<(bool, bool)>,
    doubled_slashes: Vec<bool>,
    detour: Option<usize>,
    dot: Option<usize>,
    trailing_slash: bool,
    host_case: Vec<bool>,
    trailing_dot: bool,
    default_port: bool,
    absolute_form: bool,
    client_low_bits: u64,
}

fn spelling_strategy() -> impl Strategy<Value = Spelling> {
    (
        prop::collection::vec(any::<(bool, bool)>(), 1..6),
        prop::collection::vec(any::<bool>(), 3),
        prop::option::of(0..3usize),
        prop::option::of(0..3usize),
        any::<bool>(),
        prop::collection::vec(any::<bool>(), 1..6),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        any::<u64>(),
    )
        .prop_map(
            |(choices, doubled_slashes, detour, dot, trailing_slash, host_case, flags, low)| {
                Spelling {
                    choices,
                    doubled_slashes,
                    detour,
                    dot,
                    trailing_slash,
                    host_case,
                    trailing_dot: flags.0,
                    default_port: flags.1,
                    absolute_form: flags.2,
                    client_low_bits: low,
                }
            },
        )
}

/// The request target and `Host` of one spelling of `GET /api/users/{id}?k={k}` to
/// `api.example`.
fn spelled_request(id: &[u8], k: &[u8], s: &Spelling) -> Request<()> {
    let mut path = String::new();
    let segments: [&[u8]; 3] = [b"api", b"users", id];
    for (i, segment) in segments.iter().enumerate() {
        path.push_str(if s.doubled_slashes[i] { "//" } else { "/" });
        if s.detour == Some(i) {
            path.push_str("zz/../");
        }
        if s.dot == Some(i) {
            path.push_str("./");
        }
        spell(segment, false, &s.choices, &mut path);
    }
    if s.trailing_slash {
        path.push('/');
    }
    path.push_str("?k=");
    spell(k, true, &s.choices, &mut path);
    let mut host: String = "api.example"
        .chars()
        .enumerate()
        .map(|(i, c)| {
            if s.host_case[i % s.host_case.len()] {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect();
    if s.trailing_dot {
        host.push('.');
    }
    if s.default_port {
        host.push_str(":80");
    }
    if s.absolute_form {
        // RFC 9112 §3.2.2: the target's authority wins over a decoy `Host`.
        request(
            Version::HTTP_11,
            &format!("http://{host}{path}"),
            &["decoy.example"],
        )
    } else {
        request(Version::HTTP_11, &path, &[&host])
    }
}

/// The route's parameters and the counter key of `[path:id, query:k, host, client_ip]`, after
/// canonicalisation, for a client in `2001:db8:1:2::/64`.
fn route_and_key(mut req: Request<()>, client_low_bits: u64, opts: PathOptions) -> Option<String> {
    canonicalize(&mut req, opts).ok()?;
    let (mut matcher, _) = RouteMatch::with_pattern("/api/users/{id}").unwrap();
    matcher.set_host("api.example");
    let headers = HeaderMap::new();
    let host = host::host(req.headers());
    let head = RequestHead {
        method: &Method::GET,
        host,
        path: req.uri().path(),
        headers: req.headers(),
    };
    let params = matcher.matches(&head)?;
    let client = (0x2001_0db8_0001_0002_u128 << 64) | u128::from(client_low_bits);
    let view = RequestView {
        method: &Method::GET,
        host,
        path: req.uri().path(),
        query: req.uri().query(),
        headers: &headers,
        params: &params,
        client_ip: std::net::Ipv6Addr::from(client).into(),
        client_prefix: ClientPrefix::default(),
        body: None,
        client_cert: None,
    };
    let parts = [
        KeyPart::PathParam(0),
        KeyPart::Query("k".into()),
        KeyPart::Host,
        KeyPart::ClientIp,
    ];
    let mut key = String::new();
    write_key(&parts, &view, None, &mut key)
        .ok()?
        .then_some(key)
}

fn plain_spelling() -> Spelling {
    Spelling {
        choices: vec![(false, false)],
        doubled_slashes: vec![false; 3],
        detour: None,
        dot: None,
        trailing_slash: false,
        host_case: vec![false],
        trailing_dot: false,
        default_port: false,
        absolute_form: false,
        client_low_bits: 1,
    }
}

proptest! {
    #[test]
    fn every_spelling_meets_the_same_route_and_counter(
        // A `;` in a path is a path parameter, refused by default (`path_parameters`).
        id in value_strategy().prop_filter("no `;` in a path", |v| !v.contains(&b';')),
        k in value_strategy(),
        spelling in spelling_strategy(),
    ) {
        let want = route_and_key(spelled_request(&id, &k, &plain_spelling()), 1, SAFE);
        prop_assert!(want.is_some(), "the canonical spelling must route and key");
        let got = route_and_key(
            spelled_request(&id, &k, &spelling),
            spelling.client_low_bits,
            SAFE,
        );
        prop_assert_eq!(got, want);
    }

    /// With `escaped_slashes: keep`, an id may contain `/`, `\` and `%` (always encoded, in either
    /// case): still one route and one counter.
    #[test]
    fn with_escaped_slashes_kept_every_spelling_meets_the_same_counter(
        id in prop::collection::vec(prop::sample::select(b"ab1/\\%".to_vec()), 1..8),
        spelling in spelling_strategy(),
    ) {
        let keep = PathOptions { escaped_slashes: EscapedSlashes::Keep, ..SAFE };
        let want = route_and_key(spelled_request(&id, b"k", &plain_spelling()), 1, keep);
        prop_assert!(want.is_some(), "the canonical spelling must route and key");
        let got = route_and_key(
            spelled_request(&id, b"k", &spelling),
            spelling.client_low_bits,
            keep,
        );
        prop_assert_eq!(got, want);
    }
}
