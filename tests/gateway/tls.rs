//! TLS (issue 13): the HTTPS public listener (HTTP/1.1 and h2 by ALPN, certificates reloaded
//! when their files change, a handshake timeout) and `https://` upstreams (a private CA, mTLS,
//! a wrong CA, `tls_verify: false`), against a CA made by each test with `openssl`, real NGINX
//! with TLS as the upstream, curl and a rustls client.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

use crate::support::tls::{der, handshake, try_handshake, Pki, TlsConn, Usage};
use crate::support::{GatewayProcess, Nginx, TestGateway, LIVENESS};

/// A gateway with `listen_tls` on a free port serving `cert`/`key`, one `respond` route.
fn listener_yaml(cert: &Path, key: &Path, extra: &str) -> String {
    format!(
        r#"
listen_tls:
  listen: 127.0.0.1:0
  cert: {cert}
  key: {key}
{extra}
routes:
  - name: hello
    respond: {{ body: "hello over tls" }}
"#,
        cert = cert.display(),
        key = key.display(),
    )
}

fn tls_addr(gw: &TestGateway) -> SocketAddr {
    gw.running().tls_addr.expect("the TLS listener is bound")
}

/// curl over HTTPS trusting only `ca`: (HTTP version curl used, status).
async fn curl(addr: SocketAddr, ca: &Path, version_flag: &str) -> (String, String) {
    let output = tokio::time::timeout(
        LIVENESS,
        tokio::process::Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_version} %{http_code}",
            ])
            .arg(version_flag)
            .arg("--cacert")
            .arg(ca)
            .arg("--resolve")
            .arg(format!("localhost:{}:127.0.0.1", addr.port()))
            .arg(format!("https://localhost:{}/", addr.port()))
            .output(),
    )
    .await
    .expect("curl in time")
    .expect("run curl (apt-get install curl)");
    let out = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "curl failed: {out} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (version, status) = out.split_once(' ').expect("version and status");
    (version.to_string(), status.to_string())
}

#[tokio::test]
async fn the_tls_listener_speaks_http1_and_h2_by_alpn() {
    let pki = Pki::new("Turnstile Test CA");
    let (cert, key) = pki.leaf("server", 1, Usage::Server);
    let gw = TestGateway::start(&listener_yaml(&cert, &key, "")).await;
    let addr = tls_addr(&gw);

    let mut h1 = TlsConn::connect(addr, &pki.ca, &[b"http/1.1"]).await;
    assert_eq!(h1.alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert_eq!(h1.get("/").await, (200, "hello over tls".to_string()));
    // No ALPN at all is HTTP/1.1 too.
    let mut plain = TlsConn::connect(addr, &pki.ca, &[]).await;
    assert_eq!(plain.alpn, None);
    assert_eq!(plain.get("/").await.0, 200);

    assert_eq!(
        curl(addr, &pki.ca, "--http2").await,
        ("2".to_string(), "200".to_string())
    );
    assert_eq!(
        curl(addr, &pki.ca, "--http1.1").await,
        ("1.1".to_string(), "200".to_string())
    );
    // The plain listener keeps serving beside it.
    assert_eq!(gw.get("/").await, 200);
}

/// A client whose ALPN offers only protocols the listener does not speak gets the fatal
/// `no_application_protocol` alert (RFC 7301 §3.2), as docs/tls.md says: never a guess at
/// HTTP/1.1 for bytes meant for another protocol.
#[tokio::test]
async fn a_client_offering_only_unknown_alpn_protocols_gets_no_application_protocol() {
    let pki = Pki::new("Turnstile Test CA");
    let (cert, key) = pki.leaf("server", 1, Usage::Server);
    let gw = TestGateway::start(&listener_yaml(&cert, &key, "")).await;
    let addr = tls_addr(&gw);
    for offer in [&[&b"spdy/3.1"[..]][..], &[b"acme-tls/1", b"smtp"], &[b"h3"]] {
        let error = match try_handshake(addr, &pki.ca, offer).await {
            Ok(_) => panic!("a handshake offering only {offer:?} succeeded"),
            Err(e) => e,
        };
        let alert = error
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        assert_eq!(
            alert,
            Some(&rustls::Error::AlertReceived(
                rustls::AlertDescription::NoApplicationProtocol
            )),
            "{offer:?}: {error}"
        );
    }
    // One known protocol among unknown ones is chosen.
    let mut mixed = TlsConn::connect(addr, &pki.ca, &[b"spdy/3.1", b"http/1.1"]).await;
    assert_eq!(mixed.alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert_eq!(mixed.get("/").await.0, 200);
}

/// Waits until a new handshake presents `want` (DER).
async fn wait_for_certificate(addr: SocketAddr, ca: &Path, want: &[u8]) {
    let deadline = Instant::now() + LIVENESS;
    loop {
        let conn = TlsConn::connect(addr, ca, &[b"http/1.1"]).await;
        if conn.peer_cert == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "new handshakes still get the old certificate"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Replaces `dst` by rename, as cert-manager and editors do.
fn replace(src: &Path, dst: &Path) {
    let tmp = dst.with_extension("tmp");
    std::fs::copy(src, &tmp).expect("copy");
    std::fs::rename(&tmp, dst).expect("rename");
}

#[tokio::test]
async fn a_replaced_certificate_serves_new_handshakes_and_established_connections_continue() {
    let pki = Pki::new("Turnstile Test CA");
    let (old_cert, old_key) = pki.leaf("old", 1, Usage::Server);
    let (new_cert, new_key) = pki.leaf("new", 2, Usage::Server);
    let live = pki.dir().join("live");
    std::fs::create_dir(&live).expect("mkdir");
    let (cert, key) = (live.join("tls.crt"), live.join("tls.key"));
    std::fs::copy(&old_cert, &cert).expect("copy");
    std::fs::copy(&old_key, &key).expect("copy");
    let gw = TestGateway::start(&listener_yaml(&cert, &key, "")).await;
    let addr = tls_addr(&gw);

    let mut established = TlsConn::connect(addr, &pki.ca, &[b"http/1.1"]).await;
    assert_eq!(established.peer_cert, der(&old_cert));
    assert_eq!(established.get("/").await.0, 200);

    // The key first, then the certificate: in between the pair does not match, which must not
    // count as a failed reload.
    replace(&new_key, &key);
    replace(&new_cert, &cert);
    wait_for_certificate(addr, &pki.ca, &der(&new_cert)).await;

    // The connection made before the reload is still served, on its old session.
    assert_eq!(
        established.get("/").await,
        (200, "hello over tls".to_string())
    );
    assert_eq!(established.peer_cert, der(&old_cert));
    // Give a second watcher event (both files changed) time to arrive: still one reload.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let reloads = |result| {
        let gw = &gw;
        async move {
            gw.metric(
                "turnstile_tls_certificate_reloads_total",
                &[("listener", "public"), ("result", result)],
            )
            .await
        }
    };
    assert_eq!(reloads("ok").await, 1.0);
    assert_eq!(reloads("error").await, 0.0);
}

#[tokio::test]
async fn a_bad_new_certificate_keeps_the_old_one_serving() {
    let pki = Pki::new("Turnstile Test CA");
    let (good_cert, good_key) = pki.leaf("good", 1, Usage::Server);
    let live = pki.dir().join("live");
    std::fs::create_dir(&live).expect("mkdir");
    let (cert, key) = (live.join("tls.crt"), live.join("tls.key"));
    std::fs::copy(&good_cert, &cert).expect("copy");
    std::fs::copy(&good_key, &key).expect("copy");
    let gw = TestGateway::start(&listener_yaml(&cert, &key, "")).await;
    let addr = tls_addr(&gw);

    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nnot base64!\n").expect("write");
    let deadline = Instant::now() + LIVENESS;
    while gw
        .metric(
            "turnstile_tls_certificate_reloads_total",
            &[("listener", "public"), ("result", "error")],
        )
        .await
        != 1.0
    {
        assert!(
            Instant::now() < deadline,
            "the bad certificate was not seen"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut conn = TlsConn::connect(addr, &pki.ca, &[b"http/1.1"]).await;
    assert_eq!(conn.peer_cert, der(&good_cert));
    assert_eq!(conn.get("/").await.0, 200);
}

#[tokio::test]
async fn a_client_that_never_finishes_its_handshake_is_closed_after_the_timeout() {
    let pki = Pki::new("Turnstile Test CA");
    let (cert, key) = pki.leaf("server", 1, Usage::Server);
    let yaml = listener_yaml(&cert, &key, "")
        .replace("listen_tls:\n", "listen_tls:\n  handshake_timeout: 300ms\n");
    let gw = TestGateway::start(&yaml).await;
    let mut silent = tokio::net::TcpStream::connect(tls_addr(&gw))
        .await
        .expect("connect");
    let started = Instant::now();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(LIVENESS, silent.read(&mut buf))
        .await
        .expect("closed within the liveness bound");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert_eq!(
        gw.metric(
            "turnstile_tls_handshake_failures_total",
            &[("listener", "public"), ("reason", "timeout")]
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_client_silent_after_its_handshake_is_closed_after_header_read_timeout() {
    let pki = Pki::new("Turnstile Test CA");
    let (cert, key) = pki.leaf("server", 1, Usage::Server);
    let gw = TestGateway::start(&listener_yaml(
        &cert,
        &key,
        "server: { header_read_timeout: 400ms }",
    ))
    .await;
    let mut silent = handshake(tls_addr(&gw), &pki.ca, &[b"h2"]).await;
    let started = Instant::now();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(LIVENESS, silent.read(&mut buf))
        .await
        .expect("closed within the liveness bound");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert!(started.elapsed() >= Duration::from_millis(350));
}

#[tokio::test]
async fn the_tls_listener_holds_at_most_max_connections() {
    let pki = Pki::new("Turnstile Test CA");
    let (cert, key) = pki.leaf("server", 1, Usage::Server);
    let gw = TestGateway::start(&listener_yaml(
        &cert,
        &key,
        "server: { max_connections: 1 }",
    ))
    .await;
    let addr = tls_addr(&gw);
    let mut first = TlsConn::connect(addr, &pki.ca, &[b"http/1.1"]).await;
    assert_eq!(first.get("/").await.0, 200);
    // The second waits in the accept backlog: no handshake while the first is open.
    let second = tokio::spawn({
        let ca = pki.ca.clone();
        async move { TlsConn::connect(addr, &ca, &[b"http/1.1"]).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!second.is_finished(), "a second connection was served");
    drop(first);
    let mut second = tokio::time::timeout(LIVENESS, second)
        .await
        .expect("served once the first closed")
        .expect("task");
    assert_eq!(second.get("/").await.0, 200);
}

/// NGINX with TLS (certificate for localhost and 127.0.0.1) that answers with what it saw of the
/// TLS session (the SNI name, the client certificate's subject) and `X-Forwarded-Proto`.
fn nginx_tls(pki: &Pki, verify_client: bool) -> Nginx {
    let (cert, key) = pki.leaf("nginx", 10, Usage::Server);
    let client_auth = if verify_client {
        format!(
            "ssl_client_certificate {}; ssl_verify_client on;",
            pki.ca.display()
        )
    } else {
        String::new()
    };
    Nginx::start_ssl(&format!(
        r#"ssl_certificate {cert};
        ssl_certificate_key {key};
        {client_auth}
        location / {{ return 200 "sni=$ssl_server_name client=$ssl_client_s_dn proto=$http_x_forwarded_proto\n"; }}"#,
        cert = cert.display(),
        key = key.display(),
    ))
}

fn upstream_yaml(url: &str, tls: &str) -> String {
    format!(
        r#"
upstreams:
  up:
    url: "{url}"
{tls}
routes:
  - name: api
    upstream: up
"#
    )
}

#[tokio::test]
async fn an_https_upstream_is_verified_against_its_ca_and_gets_sni() {
    let pki = Pki::new("Upstream CA");
    let nginx = nginx_tls(&pki, false);
    let (cert, key) = pki.leaf("gateway", 2, Usage::Server);
    let url = format!("https://localhost:{}", nginx.addr.port());
    let yaml = format!(
        "listen_tls: {{ listen: 127.0.0.1:0, cert: {}, key: {} }}\n{}",
        cert.display(),
        key.display(),
        upstream_yaml(&url, &format!("    ca: {}", pki.ca.display()))
    );
    let gw = TestGateway::start(&yaml).await;
    let reply = crate::support::Client::new().get(&gw.url("/x")).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.text(), "sni=localhost client= proto=http\n");
    // A second request reuses the pooled TLS connection.
    assert_eq!(gw.get("/y").await, 200);
    // HTTPS end to end: the upstream learns the client came over https.
    let mut conn = TlsConn::connect(tls_addr(&gw), &pki.ca, &[b"http/1.1"]).await;
    assert_eq!(
        conn.get("/z").await,
        (200, "sni=localhost client= proto=https\n".to_string())
    );
}

#[tokio::test]
async fn an_upstream_that_requires_a_client_certificate_gets_one() {
    let pki = Pki::new("Upstream CA");
    let nginx = nginx_tls(&pki, true);
    let (client_cert, client_key) = pki.leaf("gateway-client", 20, Usage::Client);
    let url = format!("https://localhost:{}", nginx.addr.port());

    let without = TestGateway::start(&upstream_yaml(
        &url,
        &format!("    ca: {}", pki.ca.display()),
    ))
    .await;
    // NGINX's own answer to a client without a certificate.
    assert_eq!(without.get("/").await, 400);

    let with = TestGateway::start(&upstream_yaml(
        &url,
        &format!(
            "    ca: {}\n    client_cert: {{ cert: {}, key: {} }}",
            pki.ca.display(),
            client_cert.display(),
            client_key.display()
        ),
    ))
    .await;
    let reply = crate::support::Client::new().get(&with.url("/")).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.text(),
        "sni=localhost client=CN=gateway-client proto=http\n"
    );
}

#[tokio::test]
async fn an_upstream_certificate_from_another_ca_is_a_502_with_a_clear_log() {
    let upstream_pki = Pki::new("Upstream CA");
    let other = Pki::new("Some Other CA");
    let nginx = nginx_tls(&upstream_pki, false);
    let url = format!("https://localhost:{}", nginx.addr.port());
    let mut gw = GatewayProcess::spawn(&upstream_yaml(
        &url,
        &format!("    ca: {}", other.ca.display()),
    ))
    .await;
    let reply = crate::support::Client::new().get(&gw.url("/")).await;
    assert_eq!(reply.status, 502, "{}", reply.text());
    let log = gw.log();
    assert!(
        log.contains("TLS handshake with the upstream failed")
            && log.contains("invalid peer certificate: UnknownIssuer"),
        "{log}"
    );
    gw.signal("TERM");
    gw.wait().await;

    // The same upstream with `tls_verify: false`: served, with a warning at load.
    let yaml = upstream_yaml(&url, "    tls_verify: false");
    let gw = TestGateway::start(&yaml).await;
    let snapshot = turnstile::config::load(&gw.config_path).expect("loads");
    assert!(
        snapshot
            .warnings
            .iter()
            .any(|w| w.to_string().contains("upstreams.up.tls_verify")),
        "{:?}",
        snapshot.warnings
    );
    assert_eq!(gw.get("/").await, 200);
}

/// `turnstile::config::load` of `yaml`: the error text.
fn load_error(dir: &Path, yaml: &str) -> String {
    let path = dir.join("policies.yaml");
    std::fs::write(&path, yaml).expect("write");
    match turnstile::config::load(&path) {
        Ok(_) => panic!("loads:\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn missing_or_bad_tls_files_are_config_errors_naming_field_and_file() {
    let pki = Pki::new("Turnstile Test CA");
    let (cert, key) = pki.leaf("server", 1, Usage::Server);
    let (other_cert, _) = pki.leaf("other", 2, Usage::Server);
    let dir = pki.dir();

    let error = load_error(dir, &listener_yaml(Path::new("missing.pem"), &key, ""));
    assert!(
        error.contains("listen_tls.cert")
            && error.contains(&format!("{}", dir.join("missing.pem").display()))
            && error.contains("No such file"),
        "{error}"
    );
    let error = load_error(dir, &listener_yaml(&cert, &pki.ca, ""));
    assert!(
        error.contains("listen_tls.key") && error.contains("PRIVATE KEY"),
        "{error}"
    );
    let error = load_error(dir, &listener_yaml(&other_cert, &key, ""));
    assert!(
        error.contains("listen_tls:") && error.contains("do not make a usable certificate"),
        "{error}"
    );

    let error = load_error(
        dir,
        &format!(
            "listen: 127.0.0.1:8443\n{}",
            listener_yaml(&cert, &key, "").replace("127.0.0.1:0", "127.0.0.1:8443")
        ),
    );
    assert!(
        error.contains("listen_tls.listen") && error.contains("must differ"),
        "{error}"
    );

    let error = load_error(
        dir,
        &upstream_yaml(
            "https://localhost:8443",
            &format!(
                "    client_cert: {{ cert: {}, key: nope.key }}",
                cert.display()
            ),
        ),
    );
    assert!(
        error.contains("upstreams.up.client_cert.key") && error.contains("nope.key"),
        "{error}"
    );
    let error = load_error(
        dir,
        &upstream_yaml("http://localhost:8080", "    tls_verify: false"),
    );
    assert!(
        error.contains("upstreams.up.tls_verify") && error.contains("https:// upstreams only"),
        "{error}"
    );
}
