//! Mutual TLS on every door (issue 39): the public TLS listener asking for client certificates
//! (required or optional) and keying limits on the verified subject and names, with no plain
//! listener; the Envoy rate limit service and ext_authz called by a real Envoy over mTLS (refused
//! without a client certificate, served with one), the RLS certificate rotated under load with no
//! failed call; the forward-auth and admin listeners over mTLS with curl; and `turnstile
//! ratelimit`, run as Envoy Gateway runs envoyproxy/ratelimit, behind a real Envoy. Every CA is
//! made by the test with `openssl` (`support::tls::Pki`).

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::envoy::{bootstrap, Envoy};
use support::tls::{der, try_handshake, Pki, Usage};
use support::{Client, RedisServer, TestGateway, Upstream, LIVENESS};

/// A client certificate: (certificate, key).
type Cert = (PathBuf, PathBuf);

/// curl over HTTPS to `localhost:PORT{path}`, trusting only `ca`, presenting `client` if given:
/// the status, or curl's error when the connection failed (a refused handshake).
async fn curl(
    addr: SocketAddr,
    path: &str,
    ca: &Path,
    client: Option<&Cert>,
    headers: &[(&str, &str)],
) -> Result<u16, String> {
    let mut command = tokio::process::Command::new("curl");
    command
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
        .arg(ca)
        .arg("--resolve")
        .arg(format!("localhost:{}:127.0.0.1", addr.port()));
    if let Some((cert, key)) = client {
        command.arg("--cert").arg(cert).arg("--key").arg(key);
    }
    for (name, value) in headers {
        command.arg("-H").arg(format!("{name}: {value}"));
    }
    command.arg(format!("https://localhost:{}{path}", addr.port()));
    let output = tokio::time::timeout(LIVENESS, command.output())
        .await
        .expect("curl in time")
        .expect("run curl (apt-get install curl)");
    if output.status.success() {
        let status = String::from_utf8_lossy(&output.stdout);
        Ok(status.trim().parse().expect("a status"))
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// `n` GETs of `path` with curl: their statuses (a refused connection fails the test).
async fn statuses(addr: SocketAddr, path: &str, ca: &Path, client: &Cert, n: usize) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let status = curl(addr, path, ca, Some(client), &[]).await;
        out.push(status.unwrap_or_else(|e| panic!("curl with a client certificate: {e}")));
    }
    out
}

fn p(path: &Path) -> String {
    path.display().to_string()
}

/// Replaces `to` with a copy of `from` by rename, as a Secret volume update does.
fn replace(from: &Path, to: &Path) {
    let tmp = to.with_extension("tmp");
    std::fs::copy(from, &tmp).expect("copy");
    std::fs::rename(&tmp, to).expect("rename");
}

/// Waits (at most [`LIVENESS`]) until `read` gives `want`.
async fn until<F, Fut>(what: &str, want: f64, mut read: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = f64>,
{
    let deadline = Instant::now() + LIVENESS;
    loop {
        let got = read().await;
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {got}, not {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// --- The public listener -------------------------------------------------------------------

const PUBLIC: &str = r#"
listen: off
listen_tls:
  listen: 127.0.0.1:0
  cert: SERVER_CERT
  key: SERVER_KEY
  client_ca: CLIENT_CA
CLIENT_AUTH
routes:
  - name: api
    respond: { body: "hello" }
    policies:
      - name: per_cert
        key: [KEY]
        token_bucket: { rate: 1/h, burst: 2 }
"#;

fn public_yaml(server: &Cert, ca: &Path, client_auth: &str, key: &str) -> String {
    PUBLIC
        .replace("SERVER_CERT", &p(&server.0))
        .replace("SERVER_KEY", &p(&server.1))
        .replace("CLIENT_CA", &p(ca))
        .replace("CLIENT_AUTH\n", client_auth)
        .replace("KEY", key)
}

#[tokio::test]
async fn the_public_listener_limits_each_client_certificate_and_refuses_the_others() {
    let pki = Pki::new("Turnstile Test CA");
    let server = pki.leaf("server", 1, Usage::Server);
    let subject = "/O=Example, Inc./OU=payments/CN=client-a";
    let a = pki.leaf_with(
        "a",
        2,
        Usage::Client,
        subject,
        "URI:spiffe://example.org/a,DNS:a.example",
    );
    let b = pki.leaf_with(
        "b",
        3,
        Usage::Client,
        "/O=Example, Inc./OU=payments/CN=client-b",
        "DNS:b.example",
    );
    let rogue_pki = Pki::new("Another CA");
    let rogue = rogue_pki.leaf_with("rogue", 4, Usage::Client, subject, "DNS:a.example");

    let gw = TestGateway::start(&public_yaml(&server, &pki.ca, "", "client_cert:subject")).await;
    let addr = gw.running().tls_addr.expect("the TLS listener");

    // TLS only: `listen: off` closed the plain listener.
    assert!(gw.running().public_addr.is_none());
    assert!(tokio::net::TcpStream::connect(gw.public).await.is_err());

    // Each certificate's subject names its counter: exactly two each.
    assert_eq!(statuses(addr, "/", &pki.ca, &a, 3).await, [200, 200, 429]);
    assert_eq!(statuses(addr, "/", &pki.ca, &b, 3).await, [200, 200, 429]);

    // No certificate, or one from another CA with the same subject: no handshake.
    let none = curl(addr, "/", &pki.ca, None, &[]).await;
    assert!(
        none.is_err(),
        "served without a client certificate: {none:?}"
    );
    let other = curl(addr, "/", &pki.ca, Some(&rogue), &[]).await;
    assert!(
        other.is_err(),
        "served a certificate of another CA: {other:?}"
    );
    let failures = [("listener", "public"), ("reason", "error")];
    assert_eq!(
        gw.metric("turnstile_tls_handshake_failures_total", &failures)
            .await,
        2.0
    );

    // The subject as RFC 4514 (OpenSSL's RFC2253 form) writes it, and the names by kind.
    let cert = turnstile::client_cert::ClientCert::from_der(&der(&a.0)).expect("readable");
    let openssl = std::process::Command::new("openssl")
        .args(["x509", "-noout", "-subject", "-nameopt", "RFC2253", "-in"])
        .arg(&a.0)
        .output()
        .expect("openssl");
    let printed = String::from_utf8_lossy(&openssl.stdout);
    assert_eq!(
        printed.trim().strip_prefix("subject="),
        Some(&*cert.subject),
        "ours: {}",
        cert.subject
    );
    assert_eq!(&*cert.subject, "CN=client-a,OU=payments,O=Example\\, Inc.");
    assert_eq!(&*cert.san_uri, "spiffe://example.org/a");
    assert_eq!(&*cert.san_dns, "a.example");
    assert_eq!(&*cert.san_ip, "");
}

#[tokio::test]
async fn an_optional_client_certificate_keys_its_own_counter_and_its_absence_skips_the_policy() {
    let pki = Pki::new("Turnstile Test CA");
    let server = pki.leaf("server", 1, Usage::Server);
    let a = pki.leaf_with("a", 2, Usage::Client, "/CN=a", "URI:spiffe://example.org/a");
    let yaml = public_yaml(
        &server,
        &pki.ca,
        "  client_auth: optional\n",
        "client_cert:san_uri",
    );
    let gw = TestGateway::start(&yaml).await;
    let addr = gw.running().tls_addr.expect("the TLS listener");

    for _ in 0..3 {
        assert_eq!(curl(addr, "/", &pki.ca, None, &[]).await, Ok(200));
    }
    assert_eq!(statuses(addr, "/", &pki.ca, &a, 3).await, [200, 200, 429]);
}

#[tokio::test]
async fn a_replaced_client_ca_verifies_new_handshakes_against_the_new_ca() {
    let old = Pki::new("Old CA");
    let new = Pki::new("New CA");
    let server = old.leaf("server", 1, Usage::Server);
    let old_client = old.leaf("old-client", 2, Usage::Client);
    let new_client = new.leaf("new-client", 3, Usage::Client);
    let ca = old.dir().join("clients-ca.pem");
    std::fs::copy(&old.ca, &ca).expect("copy");
    let gw = TestGateway::start(&public_yaml(&server, &ca, "", "client_ip")).await;
    let addr = gw.running().tls_addr.expect("the TLS listener");
    assert_eq!(
        curl(addr, "/", &old.ca, Some(&old_client), &[]).await,
        Ok(200)
    );
    assert!(curl(addr, "/", &old.ca, Some(&new_client), &[])
        .await
        .is_err());

    replace(&new.ca, &ca);
    let ok = [("listener", "public"), ("result", "ok")];
    until("CA reloads", 1.0, || {
        gw.metric("turnstile_tls_certificate_reloads_total", &ok)
    })
    .await;
    assert_eq!(
        curl(addr, "/", &old.ca, Some(&new_client), &[]).await,
        Ok(200)
    );
    assert!(curl(addr, "/", &old.ca, Some(&old_client), &[])
        .await
        .is_err());
}

// --- The Envoy rate limit service ----------------------------------------------------------

const RLS_CONFIG: &str = "domain: edge
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: user
    value: loader
    rate_limit: {unit: minute, requests_per_unit: 1000000}
";

/// The `rls:` block's `tls:` lines.
fn rls_tls(server: &Cert, ca: &Path) -> String {
    format!(
        "  tls:\n    cert: {}\n    key: {}\n    client_ca: {}\n",
        p(&server.0),
        p(&server.1),
        p(ca)
    )
}

/// Envoy's TLS to a cluster: trusting `ca`, checking the name `localhost`, presenting `client`.
fn upstream_tls(ca: &Path, client: Option<&Cert>) -> String {
    let certificate = client
        .map(|(cert, key)| {
            format!(
                "\n          tls_certificates: [{{certificate_chain: {{filename: \"{}\"}}, private_key: {{filename: \"{}\"}}}}]",
                p(cert),
                p(key)
            )
        })
        .unwrap_or_default();
    format!(
        r#"    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: localhost
        common_tls_context:
          alpn_protocols: [h2]
          validation_context:
            trusted_ca: {{filename: "{ca}"}}
            match_typed_subject_alt_names: [{{san_type: DNS, matcher: {{exact: localhost}}}}]{certificate}
"#,
        ca = p(ca),
    )
}

/// The RLS bootstrap (`support::envoy`) with `failure_mode_deny: true` (a failed call is a 500),
/// TLS to the rate limit service, and at most `per_connection` calls on each of its connections.
fn rls_bootstrap(
    upstream: SocketAddr,
    rls: SocketAddr,
    ca: &Path,
    client: Option<&Cert>,
    per_connection: u32,
) -> String {
    let cluster = "  - name: ratelimit\n    type: STATIC\n    connect_timeout: 1s\n";
    let text = bootstrap(upstream, rls);
    assert!(
        text.contains(cluster),
        "the bootstrap's ratelimit cluster moved"
    );
    text.replace("failure_mode_deny: false", "failure_mode_deny: true")
        .replace(cluster, &format!("{cluster}{}", upstream_tls(ca, client)))
        .replace(
            "explicit_http_config: {http2_protocol_options: {}}",
            &format!(
                "common_http_protocol_options: {{max_requests_per_connection: {per_connection}}}\n        explicit_http_config: {{http2_protocol_options: {{}}}}"
            ),
        )
}

async fn user_statuses(envoy: &Envoy, user: &str, n: usize) -> Vec<u16> {
    let client = Client::new();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let url = format!("http://{}/user", envoy.listener);
        out.push(client.get_with(&url, &[("x-user", user)]).await.status);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_calls_the_rate_limit_service_over_mtls_and_is_refused_without_a_certificate() {
    let pki = Pki::new("Turnstile Test CA");
    let server = pki.leaf("server", 1, Usage::Server);
    let envoy_cert = pki.leaf("envoy", 2, Usage::Client);
    let rls = support::rls::start(&[("edge.yaml", RLS_CONFIG)], &rls_tls(&server, &pki.ca)).await;
    let up = Upstream::start().await;

    let without = Envoy::start(&rls_bootstrap(up.addr, rls.grpc, &pki.ca, None, 1000)).await;
    assert_eq!(
        user_statuses(&without, "alice", 2).await,
        [500, 500],
        "{}",
        without.log()
    );
    let refused = rls
        .metric(
            "turnstile_tls_handshake_failures_total",
            &[("listener", "rls"), ("reason", "error")],
        )
        .await;
    assert!(refused >= 1.0, "{refused}");

    let with = Envoy::start(&rls_bootstrap(
        up.addr,
        rls.grpc,
        &pki.ca,
        Some(&envoy_cert),
        1000,
    ))
    .await;
    assert_eq!(
        user_statuses(&with, "alice", 4).await,
        [200, 200, 200, 429],
        "{}",
        with.log()
    );
    rls.stop().await;
}

/// Envoy reconnects every 20 calls, so handshakes go on all through the load: the certificate is
/// replaced mid-run, and no call fails, before or after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_service_certificate_rotates_under_load_with_no_failed_call() {
    const MAX_CALLS: u64 = 4000;
    const WORKERS: usize = 4;
    let pki = Pki::new("Turnstile Test CA");
    let old = pki.leaf("old", 1, Usage::Server);
    let new = pki.leaf("new", 2, Usage::Server);
    let envoy_cert = pki.leaf("envoy", 3, Usage::Client);
    let live = pki.dir().join("live");
    std::fs::create_dir(&live).expect("mkdir");
    let server = (live.join("tls.crt"), live.join("tls.key"));
    std::fs::copy(&old.0, &server.0).expect("copy");
    std::fs::copy(&old.1, &server.1).expect("copy");
    let rls = support::rls::start(&[("edge.yaml", RLS_CONFIG)], &rls_tls(&server, &pki.ca)).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(&rls_bootstrap(
        up.addr,
        rls.grpc,
        &pki.ca,
        Some(&envoy_cert),
        20,
    ))
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut load = Vec::new();
    for _ in 0..WORKERS {
        let (stop, calls, failed) = (stop.clone(), calls.clone(), failed.clone());
        let url = format!("http://{}/user", envoy.listener);
        load.push(tokio::spawn(async move {
            let client = Client::new();
            while !stop.load(Ordering::Relaxed)
                && calls.fetch_add(1, Ordering::Relaxed) < MAX_CALLS
                && started.elapsed() < LIVENESS
            {
                let reply = client.try_get_with(&url, &[("x-user", "loader")]).await;
                if !matches!(reply, Ok(ref r) if r.status == 200) {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let connections = || envoy.stat("cluster.ratelimit.upstream_cx_total");
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The key first, then the certificate, as a Secret update may land them.
    replace(&new.1, &server.1);
    replace(&new.0, &server.0);
    let ok = [("listener", "rls"), ("result", "ok")];
    until("RLS certificate reloads", 1.0, || {
        rls.metric("turnstile_tls_certificate_reloads_total", &ok)
    })
    .await;
    let at_rotation = connections().await;
    // New handshakes present the new certificate...
    let tls = try_handshake(rls.grpc, &pki.ca, &[b"h2"])
        .await
        .expect("handshake");
    let presented = tls.get_ref().1.peer_certificates().expect("a certificate")[0].to_vec();
    assert_eq!(presented, der(&new.0));
    drop(tls);
    // ...and Envoy keeps making them under load.
    let deadline = Instant::now() + LIVENESS;
    while connections().await < at_rotation + 5 {
        assert!(Instant::now() < deadline, "Envoy made no new connections");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.expect("load task");
    }
    let calls = calls.load(Ordering::Relaxed).min(MAX_CALLS);
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "of {calls} calls; {}",
        envoy.log()
    );
    assert!(calls >= 60, "only {calls} calls");
    assert_eq!(envoy.stat("cluster.upstream.ratelimit.error").await, 0);
    println!(
        "{calls} calls, {} RLS connections ({at_rotation} before the rotation), none failed",
        connections().await
    );
    rls.stop().await;
}

// --- ext_authz and the forward-auth listener -----------------------------------------------

const CHECKS: &str = r#"
forward_auth:
  listen: 127.0.0.1:0
  grpc_listen: 127.0.0.1:0
  tls:
    cert: SERVER_CERT
    key: SERVER_KEY
    client_ca: CLIENT_CA
routes:
  - name: users
    match:
      path: /api/users/{user_id}
    policies:
      - name: per_user
        key: [path:user_id]
        token_bucket: { rate: 1/h, burst: 3 }
"#;

async fn checks(pki: &Pki) -> TestGateway {
    let server = pki.leaf("server", 1, Usage::Server);
    let yaml = CHECKS
        .replace("SERVER_CERT", &p(&server.0))
        .replace("SERVER_KEY", &p(&server.1))
        .replace("CLIENT_CA", &p(&pki.ca));
    TestGateway::start(&yaml).await
}

/// The shipped ext_authz example (`deploy/ingress/envoy-ext-authz.yaml`) on free ports, with TLS
/// to Turnstile.
fn ext_authz_bootstrap(
    grpc: SocketAddr,
    upstream: SocketAddr,
    ca: &Path,
    client: Option<&Cert>,
) -> String {
    let example = std::fs::read_to_string(support::tools::repo_path(
        "deploy/ingress/envoy-ext-authz.yaml",
    ))
    .expect("deploy/ingress/envoy-ext-authz.yaml");
    let cluster = "  - name: turnstile_ext_authz\n    type: STRICT_DNS\n    connect_timeout: 1s\n";
    assert!(
        example.contains(cluster),
        "the example's ext_authz cluster moved"
    );
    example
        .replace("port_value: 9901", "port_value: 0")
        .replace(
            "address: 0.0.0.0, port_value: 10000",
            "address: 127.0.0.1, port_value: 0",
        )
        .replace("port_value: 8083", &format!("port_value: {}", grpc.port()))
        .replace(
            "port_value: 3000",
            &format!("port_value: {}", upstream.port()),
        )
        .replace(cluster, &format!("{cluster}{}", upstream_tls(ca, client)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_calls_ext_authz_over_mtls_and_is_refused_without_a_certificate() {
    let pki = Pki::new("Turnstile Test CA");
    let envoy_cert = pki.leaf("envoy", 2, Usage::Client);
    let gw = checks(&pki).await;
    let grpc = gw.running().ext_authz_addr.expect("grpc_listen");
    let up = Upstream::start().await;
    let get = |envoy: SocketAddr| async move {
        let client = Client::new();
        let mut out = Vec::new();
        for _ in 0..4 {
            out.push(
                client
                    .get(&format!("http://{envoy}/api/users/alice"))
                    .await
                    .status,
            );
        }
        out
    };

    // failure_mode_allow: false, so a call that cannot be made is Envoy's 403.
    let without = Envoy::start(&ext_authz_bootstrap(grpc, up.addr, &pki.ca, None)).await;
    assert_eq!(
        get(without.listener).await[..2],
        [403, 403],
        "{}",
        without.log()
    );
    let labels = [("door", "ext_authz"), ("result", "allowed")];
    assert_eq!(gw.metric("turnstile_door_checks_total", &labels).await, 0.0);

    let with = Envoy::start(&ext_authz_bootstrap(
        grpc,
        up.addr,
        &pki.ca,
        Some(&envoy_cert),
    ))
    .await;
    assert_eq!(
        get(with.listener).await,
        [200, 200, 200, 429],
        "{}",
        with.log()
    );
    assert_eq!(gw.metric("turnstile_door_checks_total", &labels).await, 3.0);
}

#[tokio::test]
async fn the_forward_auth_listener_serves_mtls_checks_to_curl() {
    let pki = Pki::new("Turnstile Test CA");
    let proxy = pki.leaf("nginx", 2, Usage::Client);
    let gw = checks(&pki).await;
    let check = gw.running().forward_auth_addr.expect("forward_auth.listen");
    let original = [
        ("x-forwarded-method", "GET"),
        ("x-forwarded-uri", "/api/users/bob"),
        ("x-forwarded-host", "shop.example"),
    ];
    let mut answers = Vec::new();
    for _ in 0..4 {
        answers.push(curl(check, "/check", &pki.ca, Some(&proxy), &original).await);
    }
    assert_eq!(answers, [Ok(200), Ok(200), Ok(200), Ok(429)]);
    let none = curl(check, "/check", &pki.ca, None, &original).await;
    assert!(
        none.is_err(),
        "a check without a client certificate: {none:?}"
    );
}

// --- The admin listener --------------------------------------------------------------------

#[tokio::test]
async fn the_admin_listener_serves_only_clients_with_a_certificate() {
    let pki = Pki::new("Turnstile Test CA");
    let server = pki.leaf("server", 1, Usage::Server);
    let operator = pki.leaf("operator", 2, Usage::Client);
    let yaml = format!(
        "admin:\n  tls:\n    cert: {}\n    key: {}\n    client_ca: {}\nroutes:\n  - name: api\n    respond: {{ body: \"hello\" }}\n",
        p(&server.0),
        p(&server.1),
        p(&pki.ca)
    );
    let gw = TestGateway::start(&yaml).await;
    let none = curl(gw.admin, "/healthz", &pki.ca, None, &[]).await;
    assert!(
        none.is_err(),
        "the admin listener served a client without a certificate"
    );
    assert_eq!(
        curl(gw.admin, "/readyz", &pki.ca, Some(&operator), &[]).await,
        Ok(200)
    );
    // Plain HTTP gets no answer either.
    let plain = Client::new().try_get(&gw.admin_url("/healthz")).await;
    assert!(plain.is_err(), "{plain:?}");
    let metrics = tokio::process::Command::new("curl")
        .args(["-sS", "--cacert"])
        .arg(&pki.ca)
        .arg("--cert")
        .arg(&operator.0)
        .arg("--key")
        .arg(&operator.1)
        .arg("--resolve")
        .arg(format!("localhost:{}:127.0.0.1", gw.admin.port()))
        .arg(format!("https://localhost:{}/metrics", gw.admin.port()))
        .output()
        .await
        .expect("curl");
    let text = String::from_utf8_lossy(&metrics.stdout);
    // The one without a certificate and the plain-HTTP one.
    let failures = [("listener", "admin"), ("reason", "error")];
    assert_eq!(
        support::metric(&text, "turnstile_tls_handshake_failures_total", &failures),
        Some(2.0),
        "{text}"
    );
}

// --- Config errors ---------------------------------------------------------------------------

#[test]
fn a_missing_client_ca_is_an_error_at_its_file_line_and_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new("Turnstile Test CA");
    let server = pki.leaf("server", 1, Usage::Server);
    std::fs::create_dir(dir.path().join("rls")).expect("mkdir");
    std::fs::write(dir.path().join("rls/edge.yaml"), RLS_CONFIG).expect("write");
    let path = dir.path().join("policies.yaml");
    let yaml = format!(
        "rls:\n  listen: 127.0.0.1:0\n  config: ./rls\n  tls:\n    cert: {}\n    key: {}\n    client_ca: nowhere/ca.pem\n    client_auth: sometimes\n",
        p(&server.0),
        p(&server.1)
    );
    std::fs::write(&path, yaml).expect("write");
    let errors = turnstile::config::load(&path)
        .expect_err("refused")
        .to_string();
    let at = format!("{}:7:", path.display());
    assert!(
        errors
            .lines()
            .any(|l| l.starts_with(&at) && l.contains(": rls.tls.client_ca: cannot read")),
        "{errors}"
    );
    let at = format!("{}:8:", path.display());
    assert!(
        errors
            .lines()
            .any(|l| l.starts_with(&at) && l.contains(": rls.tls.client_auth: `sometimes`")),
        "{errors}"
    );
}

#[test]
fn listen_off_without_listen_tls_leaves_the_routes_no_listener_and_is_refused() {
    let yaml = "listen: off\nroutes:\n  - name: api\n    respond: { body: \"hello\" }\n";
    let errors = turnstile::config::parse(yaml, Path::new("policies.yaml"))
        .expect_err("refused")
        .to_string();
    assert!(
        errors.starts_with("policies.yaml:1:9: listen: is `off`"),
        "{errors}"
    );
}

#[test]
fn a_client_cert_key_part_without_a_client_ca_is_warned_at_its_line() {
    let yaml = "routes:\n  - name: api\n    respond: { body: \"hello\" }\n    policies:\n      - name: per_cert\n        key: [client_cert:subject]\n        token_bucket: { rate: 1/h, burst: 2 }\n";
    let snapshot = turnstile::config::parse(yaml, Path::new("policies.yaml")).expect("loads");
    let warnings: Vec<String> = snapshot.warnings.iter().map(|w| w.to_string()).collect();
    assert!(
        warnings.iter().any(|w| w.starts_with("policies.yaml:6:")
            && w.contains("routes[0].policies[0].key: names a `client_cert:` part")),
        "{warnings:?}"
    );
}

// --- An Envoy Gateway–shaped deployment -----------------------------------------------------

/// The environment Envoy Gateway sets on its `envoy-ratelimit` container
/// (`internal/infrastructure/kubernetes/ratelimit/resource.go`), with its paths (`/data`,
/// `/certs/...`) and the Redis address given as arguments.
fn envoy_gateway_env(data: &Path, certs: &Path, redis: &str) -> Vec<(String, String)> {
    let c = |name: &str| p(&certs.join(name));
    [
        ("REDIS_SOCKET_TYPE", "tcp".to_string()),
        ("REDIS_URL", redis.to_string()),
        ("RUNTIME_ROOT", p(data)),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_string()),
        ("RUNTIME_IGNOREDOTFILES", "true".to_string()),
        ("RUNTIME_WATCH_ROOT", "false".to_string()),
        ("LOG_LEVEL", "info".to_string()),
        ("USE_STATSD", "false".to_string()),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".to_string()),
        (
            "CONFIG_GRPC_XDS_SERVER_URL",
            "envoy-gateway:18001".to_string(),
        ),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".to_string()),
        ("GRPC_SERVER_USE_TLS", "true".to_string()),
        ("GRPC_SERVER_TLS_CERT", c("tls.crt")),
        ("GRPC_SERVER_TLS_KEY", c("tls.key")),
        ("GRPC_SERVER_TLS_CA_CERT", c("ca.crt")),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".to_string()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", c("tls.crt")),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", c("tls.key")),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", c("ca.crt")),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The overrides `deploy/envoy-gateway/envoy-gateway.yaml` gives the rate limit container.
fn deploy_overrides() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(support::tools::repo_path(
        "deploy/envoy-gateway/envoy-gateway.yaml",
    ))
    .expect("deploy/envoy-gateway/envoy-gateway.yaml");
    let doc: serde_json::Value = serde_norway::from_str(&text).expect("YAML");
    let env = &doc["provider"]["kubernetes"]["rateLimitDeployment"]["container"]["env"];
    env.as_array()
        .expect("container.env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().expect("name").to_string(),
                e["value"].as_str().expect("value").to_string(),
            )
        })
        .collect()
}

/// `ratelimit` (a link to the binary, as Envoy Gateway's Deployment runs `/bin/ratelimit`) with
/// `env` and its listeners on free loopback ports: the child, its admin and gRPC addresses.
async fn ratelimit(
    dir: &Path,
    env: &[(String, String)],
) -> Result<(tokio::process::Child, SocketAddr, SocketAddr), String> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let link = dir.join("ratelimit");
    if !link.exists() {
        std::os::unix::fs::symlink(support::process::BINARY, &link).expect("symlink");
    }
    let mut child = tokio::process::Command::new(&link)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", "0")
        .env("HOST", "127.0.0.1")
        .env("PORT", "0")
        .env("TURNSTILE_RATELIMIT_DIR", dir.join("generated"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn ratelimit");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(LIVENESS, lines.next_line())
        .await
        .expect("in time")
        .expect("stdout");
    let Some(line) = line else {
        let mut err = String::new();
        let _ = child
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut err)
            .await;
        return Err(err);
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{name}=")))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
    };
    assert!(line.contains(" public=off "), "{line}");
    Ok((child, field("admin"), field("rls")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turnstile_runs_as_envoy_gateways_rate_limit_service_behind_envoy_over_mtls() {
    let pki = Pki::new("Envoy Gateway CA");
    let dir = tempfile::tempdir().expect("tempdir");
    // The Secret `envoy-rate-limit` mounted at /certs, the config under RUNTIME_ROOT.
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).expect("mkdir");
    let server = pki.leaf("envoy-ratelimit", 1, Usage::Server);
    std::fs::copy(&server.0, certs.join("tls.crt")).expect("copy");
    std::fs::copy(&server.1, certs.join("tls.key")).expect("copy");
    std::fs::copy(&pki.ca, certs.join("ca.crt")).expect("copy");
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("ratelimit/config")).expect("mkdir");
    std::fs::write(data.join("ratelimit/config/edge.yaml"), RLS_CONFIG).expect("write");
    let redis = RedisServer::start();
    let address = redis
        .url()
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_string();

    // As Envoy Gateway sets it, the xDS config source is refused, by name.
    let env = envoy_gateway_env(&data, &certs, &address);
    let refused = ratelimit(dir.path(), &env)
        .await
        .expect_err("xDS is not served");
    assert!(refused.contains("CONFIG_TYPE: GRPC_XDS_SOTW"), "{refused}");

    // With the overrides of deploy/envoy-gateway, it serves.
    let mut env = env;
    for (name, value) in deploy_overrides() {
        env.retain(|(k, _)| *k != name);
        env.push((name, value));
    }
    let (_child, admin, grpc) = ratelimit(dir.path(), &env).await.expect("starts");
    // Envoy Gateway's readiness probe.
    assert_eq!(
        Client::new()
            .get(&format!("http://{admin}/healthcheck"))
            .await
            .status,
        200
    );

    let up = Upstream::start().await;
    let envoy_cert = pki.leaf("envoy", 2, Usage::Client);
    let without = Envoy::start(&rls_bootstrap(up.addr, grpc, &pki.ca, None, 1000)).await;
    assert_eq!(user_statuses(&without, "eve", 2).await, [500, 500]);
    let envoy = Envoy::start(&rls_bootstrap(
        up.addr,
        grpc,
        &pki.ca,
        Some(&envoy_cert),
        1000,
    ))
    .await;
    assert_eq!(
        user_statuses(&envoy, "eve", 4).await,
        [200, 200, 200, 429],
        "{}",
        envoy.log()
    );
    // The counter is in Redis: the store Envoy Gateway's REDIS_URL names.
    let keys = redis.keys();
    assert!(
        keys.iter().any(|k| k.contains("eve")),
        "no counter of eve in Redis: {keys:?}"
    );
}

#[test]
fn docs_envoy_shows_the_envoy_gateway_config_verbatim() {
    let read = |name: &str| {
        std::fs::read_to_string(support::tools::repo_path(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let example = read("deploy/envoy-gateway/envoy-gateway.yaml");
    let fenced = format!("```yaml\n{}\n```", example.trim_end());
    assert!(
        read("docs/envoy.md").contains(&fenced),
        "docs/envoy.md does not show the file"
    );
}
