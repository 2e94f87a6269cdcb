//! Issue 33, items 6, 7 and 11, and its two chunked-body findings: what of a client's fields
//! reaches the upstream. A name with an underscore is dropped (or refused) on every door; a
//! client's `Connection` list cannot remove a field the gateway relies on; forwarding fields pass
//! only from trusted proxies; a request body reaches the upstream whatever its framing, and a
//! malformed one is the client's 400, not the upstream's 502.

use std::io::BufRead;
use std::net::SocketAddr;

use bytes::Bytes;
use http::Method;
use tokio::io::AsyncWriteExt;

use crate::support::client::{raw_connect, read_response, request};
use crate::support::{metric, Client, TestGateway, Upstream};

/// A real WSGI upstream: Python's `wsgiref`, answering with the `HTTP_*` variables of its
/// environ as JSON. CGI and WSGI fold `-` into `_`, so `X-Key` and `X_Key` are both `HTTP_X_KEY`.
/// Started on a free port it reports itself; stopped by PID on drop.
struct WsgiUpstream {
    addr: SocketAddr,
    child: std::process::Child,
}

const WSGI_APP: &str = r#"
import json
from wsgiref.simple_server import make_server, WSGIRequestHandler

class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass

def app(environ, start_response):
    seen = {k: v for k, v in environ.items() if k.startswith("HTTP_")}
    body = json.dumps(seen).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]

server = make_server("127.0.0.1", 0, app, handler_class=Quiet)
print(server.server_port, flush=True)
server.serve_forever()
"#;

impl WsgiUpstream {
    fn start() -> WsgiUpstream {
        let mut child = std::process::Command::new("python3")
            .args(["-c", WSGI_APP])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3 wsgiref");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("wsgiref's port");
        let port: u16 = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("wsgiref said `{line}`"));
        WsgiUpstream {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
        }
    }
}

impl Drop for WsgiUpstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One route keyed on `header:x-key`, two requests per key, then none for an hour.
fn keyed_on_x_key(server: &str) -> String {
    format!(
        r#"
server:
{server}
upstreams:
  up: {{ url: "http://$UPSTREAM", timeout: 5s }}
routes:
  - name: api
    upstream: up
    policies:
      - name: per_key
        key: ["header:x-key"]
        token_bucket: {{ rate: 1/h, burst: 2 }}
"#
    )
}

/// Every spelling a CGI or WSGI server reads as `HTTP_X_KEY`, none of them `x-key` itself.
const UNDERSCORE_SPELLINGS: [&str; 5] = ["X_Key", "x_key", "X_KEY", "x_Key", "X_key"];

/// Regression (item 6): `X_Key: v` was no key to the gateway and `HTTP_X_KEY` to a WSGI upstream,
/// so 5 of 5 passed a burst of 2. Now, over h1 and h2, requests on which the upstream reads the
/// key are exactly the burst, however the name is spelt.
#[tokio::test]
async fn an_underscore_spelling_of_a_keyed_header_cannot_escape_its_limit() {
    let wsgi = WsgiUpstream::start();
    let gw = TestGateway::with_upstream(&keyed_on_x_key("  {}"), wsgi.addr).await;
    for (client, value) in [(Client::new(), "h1-key"), (Client::http2(), "h2-key")] {
        let mut read_with_key = 0;
        for name in UNDERSCORE_SPELLINGS.iter().chain(&["x-key"; 4]) {
            let reply = client.get_with(&gw.url("/"), &[(name, value)]).await;
            if reply.status == 200 {
                let environ = reply.json();
                if environ["HTTP_X_KEY"] == value {
                    read_with_key += 1;
                }
                if name.contains('_') {
                    assert!(
                        environ.get("HTTP_X_KEY").is_none(),
                        "`{name}` reached the upstream: {environ}"
                    );
                }
            } else {
                assert_eq!(reply.status, 429, "{name}");
            }
        }
        assert_eq!(
            read_with_key, 2,
            "{value}: the upstream read the key past the burst"
        );
    }
}

/// `reject` refuses such a request (400) before any decision or upstream; `allow` forwards it.
#[tokio::test]
async fn headers_with_underscores_reject_refuses_and_allow_forwards() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &keyed_on_x_key("  headers_with_underscores: reject"),
        upstream.addr,
    )
    .await;
    for client in [Client::new(), Client::http2()] {
        for name in UNDERSCORE_SPELLINGS.iter().chain(&["x-other_", "_x"]) {
            let reply = client.get_with(&gw.url("/"), &[(name, "v")]).await;
            assert_eq!(reply.status, 400, "{name}");
        }
    }
    assert_eq!(upstream.requests(), 0);
    assert_eq!(gw.get("/").await, 200);

    let gw = TestGateway::with_upstream(
        &keyed_on_x_key("  headers_with_underscores: allow"),
        upstream.addr,
    )
    .await;
    let echo = Client::new()
        .get_with(&gw.url("/"), &[("x_custom", "v")])
        .await
        .json();
    assert_eq!(echo["headers"]["x_custom"][0], "v");
}

/// The doors cannot drop a field from what their proxy forwards: unless underscores are allowed,
/// a check carrying one is refused (400), on the HTTP door as on ext_authz's shared path.
#[tokio::test]
async fn the_check_door_refuses_a_request_with_an_underscore_field_unless_allowed() {
    let config = |setting: &str| {
        format!(
            r#"
server:
  headers_with_underscores: {setting}
forward_auth:
  listen: 127.0.0.1:0
routes:
  - name: api
    match: {{ prefix: /api }}
    policies:
      - name: per_key
        key: ["header:x-key"]
        token_bucket: {{ rate: 1/h, burst: 2 }}
"#
        )
    };
    for (setting, want) in [("drop", 400), ("reject", 400), ("allow", 200)] {
        let gw = TestGateway::start(&config(setting)).await;
        let check = gw.running().forward_auth_addr.expect("forward_auth.listen");
        let url = format!("http://{check}/check");
        let call = |headers: Vec<(&'static str, &'static str)>| {
            let url = url.clone();
            async move {
                let mut all = vec![("x-forwarded-uri", "/api/a"), ("x-forwarded-method", "GET")];
                all.extend(headers);
                Client::new().get_with(&url, &all).await.status
            }
        };
        assert_eq!(call(vec![("X_Key", "v")]).await, want, "{setting}");
        assert_eq!(call(vec![("x-key", "v")]).await, 200, "{setting}");
    }
}

/// One ext_authz `Check` of `GET /api/a` from 192.0.2.7 with `headers`: its gRPC status code.
async fn ext_authz_code(grpc: SocketAddr, headers: &[(&str, &str)]) -> i32 {
    crate::support::ext_authz::code(grpc, "/api/a", headers, 0).await
}

/// The same on ext_authz (Envoy passes underscore names by default): `INVALID_ARGUMENT` (3)
/// unless they are allowed.
#[tokio::test]
async fn ext_authz_refuses_a_request_with_an_underscore_field_unless_allowed() {
    for (setting, want) in [("drop", 3), ("reject", 3), ("allow", 0)] {
        let gw = TestGateway::start(&format!(
            r#"
server:
  headers_with_underscores: {setting}
forward_auth:
  grpc_listen: 127.0.0.1:0
routes:
  - name: api
    match: {{ prefix: /api }}
    policies:
      - name: per_key
        key: ["header:x-key"]
        token_bucket: {{ rate: 1/h, burst: 2 }}
"#
        ))
        .await;
        let grpc = gw.running().ext_authz_addr.expect("grpc_listen");
        assert_eq!(
            ext_authz_code(grpc, &[("x_key", "v")]).await,
            want,
            "{setting}"
        );
        assert_eq!(
            ext_authz_code(grpc, &[("x-key", "v")]).await,
            0,
            "{setting}"
        );
    }
}

/// A `header:` key part (or route header match) naming an underscore could never be read unless
/// underscores are allowed: the config says so, at the field.
#[test]
fn a_key_part_named_with_an_underscore_is_a_config_error_unless_allowed() {
    let keyed = |server: &str| {
        keyed_on_x_key(server)
            .replace("header:x-key", "header:x_key")
            .replace("$UPSTREAM", "127.0.0.1:9")
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, keyed("  {}")).unwrap();
    let text = turnstile::config::load(&path)
        .expect_err("an unreadable key part")
        .to_string();
    assert!(text.contains("policies.yaml"), "{text}");
    assert!(text.contains("routes[0].policies[0].key"), "{text}");
    assert!(text.contains("headers_with_underscores"), "{text}");
    std::fs::write(&path, keyed("  headers_with_underscores: allow")).unwrap();
    turnstile::config::load(&path).expect("allowed");
    std::fs::write(&path, keyed("  headers_with_underscores: maybe")).unwrap();
    let text = turnstile::config::load(&path)
        .expect_err("not an action")
        .to_string();
    assert!(text.contains("server.headers_with_underscores"), "{text}");
}

// ---- item 7: Connection options ----

/// Regression (item 7): `Connection: host` removed the `Host` the request was routed and keyed
/// on; the upstream got its own default authority and no `X-Forwarded-Host`. No field the gateway
/// relies on can be removed that way; an extension field the client names still is.
#[tokio::test]
async fn a_connection_option_cannot_remove_a_field_the_gateway_relies_on() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        r#"
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: shop
    match: { host: shop.example, headers: { x-tenant: t1 } }
    upstream: up
    policies:
      - name: per_key
        key: ["header:x-key"]
        token_bucket: { rate: 1/h, burst: 5 }
"#,
        upstream.addr,
    )
    .await;
    let relied_on = "Host, X-Forwarded-For, x-forwarded-proto, X-Forwarded-Host, Forwarded, \
                     Authorization, Content-Length, X-Key, x-tenant, x-real-ip";
    let request = format!(
        "POST /a HTTP/1.1\r\nHost: shop.example\r\nConnection: {relied_on}, X-Hop\r\n\
         X-Key: k1\r\nx-tenant: t1\r\nAuthorization: Bearer t\r\nX-Hop: 1\r\n\
         Content-Length: 5\r\n\r\nhello"
    );
    let mut stream = raw_connect(gw.public, request.as_bytes()).await;
    let (head, body, _) = read_response(&mut stream, Vec::new()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let echo: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let h = &echo["headers"];
    assert_eq!(h["host"][0], "shop.example", "{echo}");
    assert_eq!(h["x-forwarded-host"][0], "shop.example", "{echo}");
    assert_eq!(h["x-forwarded-for"][0], "127.0.0.1", "{echo}");
    assert_eq!(h["x-forwarded-proto"][0], "http", "{echo}");
    assert_eq!(h["x-key"][0], "k1", "{echo}");
    assert_eq!(h["x-tenant"][0], "t1", "{echo}");
    assert_eq!(h["authorization"][0], "Bearer t", "{echo}");
    assert_eq!(echo["body_len"], 5, "{echo}");
    assert!(
        h.get("x-hop").is_none(),
        "a hop-by-hop extension is removed: {echo}"
    );
    assert!(h.get("connection").is_none(), "{echo}");
}

// ---- item 11: forwarding fields ----

/// Forwarding fields a client might send, each with a forged value.
const FORGED: [(&str, &str); 16] = [
    (
        "forwarded",
        "for=203.0.113.9;host=admin.example;proto=https",
    ),
    ("x-forwarded-for", "203.0.113.9"),
    ("x-forwarded-host", "admin.example"),
    ("x-forwarded-proto", "https"),
    ("x-forwarded-port", "8443"),
    ("x-forwarded-prefix", "/admin"),
    ("x-forwarded-server", "admin.example"),
    ("x-forwarded-ssl", "on"),
    ("x-forwarded-scheme", "https"),
    ("x-real-ip", "203.0.113.9"),
    ("x-client-ip", "203.0.113.9"),
    ("true-client-ip", "203.0.113.9"),
    ("x-original-forwarded-for", "203.0.113.9"),
    ("x-original-url", "/admin"),
    ("cf-connecting-ip", "203.0.113.9"),
    ("x-cluster-client-ip", "203.0.113.9"),
];

fn forward_all(client_ip: &str) -> String {
    format!(
        r#"
{client_ip}
upstreams:
  up: {{ url: "http://$UPSTREAM" }}
routes:
  - name: all
    upstream: up
"#
    )
}

/// Regression (item 11): `Forwarded`, `X-Real-IP`, `X-Forwarded-Port` and `-Prefix` from an
/// untrusted client reached the upstream as sent. Now every forwarding field from a client that
/// is not a trusted proxy is removed, or replaced by the gateway's own, over h1 and h2.
#[tokio::test]
async fn forwarding_fields_from_an_untrusted_client_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&forward_all(""), upstream.addr).await;
    for client in [Client::new(), Client::http2()] {
        let echo = client.get_with(&gw.url("/"), &FORGED).await.json();
        let h = echo["headers"].as_object().unwrap();
        for (name, _) in FORGED {
            match name {
                "x-forwarded-for" => assert_eq!(h[name], serde_json::json!(["127.0.0.1"])),
                "x-forwarded-proto" => assert_eq!(h[name], serde_json::json!(["http"])),
                "x-forwarded-host" => assert_ne!(h[name][0], "admin.example"),
                _ => assert!(!h.contains_key(name), "{name} reached the upstream: {echo}"),
            }
        }
    }
}

/// From a trusted proxy the same fields pass as sent (`X-Forwarded-For` appended to).
#[tokio::test]
async fn forwarding_fields_from_a_trusted_proxy_pass() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all("client_ip:\n  trusted_proxies: [127.0.0.1/32]"),
        upstream.addr,
    )
    .await;
    let echo = Client::new().get_with(&gw.url("/"), &FORGED).await.json();
    let h = &echo["headers"];
    for (name, value) in FORGED {
        let want = if name == "x-forwarded-for" {
            format!("{value}, 127.0.0.1")
        } else {
            value.to_string()
        };
        assert_eq!(h[name][0], want.as_str(), "{name}: {echo}");
    }
}

// ---- request bodies ----

/// Regression: a malformed chunked body was answered `502 upstream_unreachable` and counted as
/// the upstream's error. It is the client's: 400, nothing recorded against the upstream.
#[tokio::test]
async fn a_malformed_chunked_body_is_the_clients_400_not_the_upstreams_502() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&forward_all(""), upstream.addr).await;
    for bad in ["ZZ\r\n", "5\r\nhelloXX", "-1\r\n"] {
        let request = format!(
            "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n{bad}"
        );
        let mut stream = raw_connect(gw.public, request.as_bytes()).await;
        let (head, _, _) = read_response(&mut stream, Vec::new()).await;
        assert!(head.starts_with("HTTP/1.1 400"), "{bad:?}: {head}");
    }
    let metrics = gw.metrics().await;
    let target = upstream.addr.to_string();
    for outcome in ["error", "ok"] {
        let labels = [
            ("upstream", "up"),
            ("target", target.as_str()),
            ("outcome", outcome),
        ];
        assert_eq!(
            metric(&metrics, "turnstile_upstream_requests_total", &labels).unwrap_or(0.0),
            0.0,
            "{outcome}"
        );
    }
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("turnstile_upstream_errors_total{") && !l.ends_with(" 0")),
        "an upstream error was counted"
    );
}

/// Regression: a GET's chunked body was dropped while its `Content-Length` body was forwarded.
/// Both framings reach the upstream, over h1 (raw) and h2 (with and without `content-length`).
#[tokio::test]
async fn a_gets_body_reaches_the_upstream_whatever_its_framing() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&forward_all(""), upstream.addr).await;
    for framing in [
        "Content-Length: 5\r\n\r\nhello",
        "Transfer-Encoding: chunked\r\n\r\n2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n",
    ] {
        // Alone on a connection (hyper serves it from the first byte), and after a bodiless GET
        // the lean path served on the same connection (handed to hyper with what was read).
        for after_lean in [false, true] {
            let request = format!("GET / HTTP/1.1\r\nHost: x\r\n{framing}");
            let first = if after_lean {
                "GET / HTTP/1.1\r\nHost: x\r\n\r\n"
            } else {
                request.as_str()
            };
            let mut stream = raw_connect(gw.public, first.as_bytes()).await;
            let (head, body, rest) = read_response(&mut stream, Vec::new()).await;
            let (head, body) = if after_lean {
                assert!(head.starts_with("HTTP/1.1 200"), "{head}");
                assert!(rest.is_empty());
                stream.write_all(request.as_bytes()).await.unwrap();
                let (head, body, _) = read_response(&mut stream, rest).await;
                (head, body)
            } else {
                (head, body)
            };
            assert!(head.starts_with("HTTP/1.1 200"), "{framing:?}: {head}");
            let echo: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(
                echo["body_len"], 5,
                "{framing:?}, after lean {after_lean}: {echo}"
            );
        }
    }
    for with_length in [true, false] {
        let mut req = request(Method::GET, &gw.url("/"));
        if with_length {
            req = req.header("content-length", "5");
        }
        let (tx, body) = crate::support::client::channel_body();
        let send = tokio::spawn({
            let req = req.body(body).unwrap();
            async move { Client::http2().send(req).await }
        });
        tx.send(Bytes::from_static(b"he")).await.unwrap();
        tx.send(Bytes::from_static(b"llo")).await.unwrap();
        drop(tx);
        let reply = send.await.unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.json()["body_len"],
            5,
            "h2, content-length: {with_length}"
        );
    }
}

// ---- the docs ----

/// Loads `yaml` plus one route, as a config file would be.
fn load_with_a_route(yaml: &str, name: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("policies.yaml");
    let config = format!(
        "{yaml}\nupstreams:\n  up: {{ url: \"http://127.0.0.1:9\" }}\nroutes:\n  - name: all\n    upstream: up\n"
    );
    std::fs::write(&path, config).expect("write");
    turnstile::config::load(&path)
        .map(|_| ())
        .map_err(|e| format!("{name}: {e}"))
}

/// The config snippets in docs/hardening.md's sections on these defences, and README's `server:`
/// block (which names `headers_with_underscores`), load as written.
#[test]
fn the_docs_config_snippets_for_these_defences_load() {
    let hardening = std::fs::read_to_string(crate::support::tools::repo_path("docs/hardening.md"))
        .expect("docs/hardening.md");
    let mut snippets = 0;
    for section in hardening.split("\n### ").filter(|s| {
        s.starts_with("Header names with underscores")
            || s.starts_with("Forwarding fields pass only from trusted proxies")
            || s.starts_with("Slow bodies")
    }) {
        for block in section.split("```yaml\n").skip(1) {
            let yaml = block.split("```").next().unwrap_or("");
            load_with_a_route(yaml, "docs/hardening.md").unwrap();
            snippets += 1;
        }
    }
    assert_eq!(snippets, 3);

    let readme =
        std::fs::read_to_string(crate::support::tools::repo_path("README.md")).expect("README.md");
    let server: Vec<&str> = readme
        .lines()
        .skip_while(|line| *line != "server:")
        .enumerate()
        .take_while(|(i, line)| *i == 0 || line.starts_with(' '))
        .map(|(_, line)| line)
        .collect();
    let server = server.join("\n");
    assert!(
        server.contains("headers_with_underscores: drop")
            && server.contains("min_body_rate: 1KiB/s"),
        "{server}"
    );
    load_with_a_route(&server, "README.md server:").unwrap();
}
