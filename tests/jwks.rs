//! JWT keys that rotate (issue 39): `jwks_url` served over HTTPS by an identity provider in the
//! test (hyper and rustls, a certificate from a CA made with `openssl`), whose keys rotate
//! mid-run; the unknown-`kid` refetch and its rate limit, counted at the server; failed fetches
//! that keep the last good keys; a first fetch that fails; key files rotated under a watch.
//!
//! Tokens are RS256, signed in the test with keys made by `openssl`. Every loop is bounded in
//! count and time.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use jsonwebtoken::{encode, get_current_timestamp, Algorithm, EncodingKey, Header};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::json;

use support::tls::{Pki, Usage};
use support::tools::run_ok;
use support::{Client, TestGateway};

/// One RSA key: its signing half and its JWK (public half) under `kid`.
struct RsaKey {
    signing: EncodingKey,
    modulus: Vec<u8>,
}

impl RsaKey {
    fn jwk(&self, kid: &str) -> serde_json::Value {
        json!({"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256",
               "n": URL_SAFE_NO_PAD.encode(&self.modulus), "e": "AQAB"})
    }
}

/// Three 2048-bit keys, made once per test binary: two the identity provider rotates through,
/// one an attacker's.
fn rsa_keys() -> &'static [RsaKey; 3] {
    static KEYS: OnceLock<[RsaKey; 3]> = OnceLock::new();
    KEYS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        [0, 1, 2].map(|i| {
            let path = dir.path().join(format!("rsa{i}.pem"));
            let path = path.to_str().expect("utf-8");
            let openssl = |args: &[&str]| run_ok("openssl", args, "apt-get install openssl");
            openssl(&[
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-out",
                path,
            ]);
            let text = openssl(&["pkey", "-in", path, "-noout", "-text"]);
            assert!(text.contains("publicExponent: 65537"), "{text}");
            let modulus = openssl(&["rsa", "-in", path, "-noout", "-modulus"]);
            let hex = modulus.trim().trim_start_matches("Modulus=");
            let modulus = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                .collect();
            let pem = std::fs::read(path).expect("read key");
            RsaKey {
                signing: EncodingKey::from_rsa_pem(&pem).expect("rsa key"),
                modulus,
            }
        })
    })
}

fn now() -> u64 {
    get_current_timestamp()
}

fn token(key: &EncodingKey, kid: &str, sub: &str, exp: u64) -> String {
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(kid.into());
    encode(&header, &json!({"sub": sub, "exp": exp}), key).expect("sign")
}

/// What the identity provider answers.
#[derive(Clone)]
enum Answer {
    /// 200 with this JWK Set and `Cache-Control: max-age=N`.
    Keys(String, u64),
    /// 500.
    Error,
    /// 200 with a body that is no JWK Set.
    Garbage,
}

/// An HTTPS server of one JWKS document; it counts what it served.
struct Idp {
    addr: SocketAddr,
    answer: Arc<Mutex<Answer>>,
    /// Answers with keys, and failures (500 or garbage), served so far.
    served_keys: Arc<AtomicUsize>,
    served_failures: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Idp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Idp {
    async fn start(pki: &Pki, answer: Answer) -> Idp {
        let (cert, key) = pki.leaf("idp", 2, Usage::Server);
        let chain = CertificateDer::pem_file_iter(&cert)
            .expect("cert")
            .collect::<Result<Vec<_>, _>>()
            .expect("pem");
        let key = PrivateKeyDer::from_pem_file(&key).expect("key");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let answer = Arc::new(Mutex::new(answer));
        let served_keys = Arc::new(AtomicUsize::new(0));
        let served_failures = Arc::new(AtomicUsize::new(0));
        let (a, k, f) = (answer.clone(), served_keys.clone(), served_failures.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, a, k, f) = (acceptor.clone(), a.clone(), k.clone(), f.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let answer = a.lock().expect("lock").clone();
                        let response = http::Response::builder();
                        let response = if req.uri().path() != "/jwks" {
                            response.status(404).body(Full::new(Bytes::new()))
                        } else {
                            match answer {
                                Answer::Keys(body, max_age) => {
                                    k.fetch_add(1, Ordering::SeqCst);
                                    response
                                        .header("content-type", "application/json")
                                        .header("cache-control", format!("max-age={max_age}"))
                                        .body(Full::new(Bytes::from(body)))
                                }
                                Answer::Error => {
                                    f.fetch_add(1, Ordering::SeqCst);
                                    response.status(500).body(Full::new(Bytes::new()))
                                }
                                Answer::Garbage => {
                                    f.fetch_add(1, Ordering::SeqCst);
                                    response.body(Full::new(Bytes::from_static(b"<html>")))
                                }
                            }
                        };
                        async move { response }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Idp {
            addr,
            answer,
            served_keys,
            served_failures,
            task,
        }
    }

    fn set(&self, answer: Answer) {
        *self.answer.lock().expect("lock") = answer;
    }

    fn fetches(&self) -> usize {
        self.served_keys.load(Ordering::SeqCst) + self.served_failures.load(Ordering::SeqCst)
    }
}

/// A JWK Set of `(key index, kid)`.
fn jwks(keys: &[(usize, &str)]) -> String {
    let all = rsa_keys();
    json!({"keys": keys.iter().map(|(i, kid)| all[*i].jwk(kid)).collect::<Vec<_>>()}).to_string()
}

/// A route that answers 200 to a verified token and 401 to any other, with a per-user limit far
/// above what the test sends.
fn config(idp: &Idp, pki: &Pki, timing: &str) -> String {
    format!(
        r#"
jwt:
  jwks_url: https://127.0.0.1:{port}/jwks
  jwks_ca: {ca}
{timing}
routes:
  - name: api
    respond: {{ status: 200, body: ok }}
    require_jwt: true
    policies:
      - {{ name: per_user, key: [jwt:sub], token_bucket: {{ rate: 1000/s, burst: 100000 }} }}
"#,
        port = idp.addr.port(),
        ca = pki.ca.display(),
    )
}

async fn status(client: &Client, gw: &TestGateway, token: &str) -> u16 {
    let auth = format!("Bearer {token}");
    client
        .get_with(&gw.url("/"), &[("authorization", &auth)])
        .await
        .status
}

async fn loads(gw: &TestGateway, result: &str) -> f64 {
    gw.metric(
        "turnstile_jwt_key_loads_total",
        &[("source", "jwks_url"), ("result", result)],
    )
    .await
}

/// Waits (bounded) until `done` holds; panics with `what` otherwise.
async fn eventually<F, Fut>(what: &str, bound: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + bound;
    while !done().await {
        assert!(Instant::now() < deadline, "not within {bound:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the gateway has installed two more good fetches than `since`: the later one
/// began after whatever changed at the server before this call.
async fn two_more_fetches(gw: &TestGateway, since: f64) {
    eventually("two more good fetches", Duration::from_secs(15), || async {
        loads(gw, "ok").await >= since + 2.0
    })
    .await;
}

/// The identity provider publishes key 1 beside key 0, then signs with it, then drops key 0,
/// while a client sends valid and forged tokens without pause. Every valid token is admitted and
/// every forged one refused; a token of the dropped key, cached since its first use, stops being
/// accepted once the set without its key is installed.
#[tokio::test]
async fn keys_rotate_at_the_url_and_no_valid_request_fails_nor_a_forged_one_passes() {
    let keys = rsa_keys();
    let pki = Pki::new("idp-ca");
    let idp = Idp::start(&pki, Answer::Keys(jwks(&[(0, "k0")]), 1)).await;
    let timing = "  jwks_refresh: 1s\n  jwks_refresh_min: 500ms\n  jwks_refresh_max: 1s";
    let gw = TestGateway::with_files(&config(&idp, &pki, timing), &[]).await;
    assert_eq!(idp.fetches(), 1, "fetched once before serving");

    // The phase says which key signs: 0, then 1 (once key 1 is published and fetched).
    let phase = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let exp = now() + 600;
    let traffic = {
        let (phase, stop, url) = (phase.clone(), stop.clone(), gw.url("/"));
        tokio::spawn(async move {
            let client = Client::new();
            let forged = [
                // The attacker's key under each real kid, and under one nobody has.
                token(&keys[2].signing, "k0", "mallory", exp),
                token(&keys[2].signing, "k1", "mallory", exp),
                token(&keys[2].signing, "k9", "mallory", exp),
                // Algorithm confusion: HS256 with a public modulus as the secret.
                {
                    let mut header = Header::new(Algorithm::HS256);
                    header.kid = Some("k0".into());
                    let secret = EncodingKey::from_secret(&keys[0].modulus);
                    encode(&header, &json!({"sub": "mallory", "exp": exp}), &secret).expect("sign")
                },
                // Expired.
                token(&keys[0].signing, "k0", "eve", now() - 120),
            ];
            let (mut valid, mut valid_ok, mut bad, mut bad_refused) = (0, 0, 0, 0);
            let deadline = Instant::now() + Duration::from_secs(60);
            // Signed once (RSA signing is slow in a debug build): five users per key.
            let valid_tokens: Vec<Vec<String>> = (0..2)
                .map(|k| {
                    (0..5)
                        .map(|u| {
                            token(&keys[k].signing, &format!("k{k}"), &format!("user{u}"), exp)
                        })
                        .collect()
                })
                .collect();
            let mut i = 0usize;
            while !stop.load(Ordering::SeqCst) && i < 20_000 && Instant::now() < deadline {
                let signer = phase.load(Ordering::SeqCst);
                let auth = format!("Bearer {}", valid_tokens[signer][i % 5]);
                valid += 1;
                let status = client
                    .get_with(&url, &[("authorization", &auth)])
                    .await
                    .status;
                if status == 200 {
                    valid_ok += 1;
                } else {
                    eprintln!("valid token of k{signer} answered {status}");
                }
                let auth = format!("Bearer {}", forged[i % forged.len()]);
                bad += 1;
                if client
                    .get_with(&url, &[("authorization", &auth)])
                    .await
                    .status
                    == 401
                {
                    bad_refused += 1;
                }
                i += 1;
            }
            (valid, valid_ok, bad, bad_refused)
        })
    };

    let client = Client::new();
    let old = token(&keys[0].signing, "k0", "user0", exp);
    assert_eq!(status(&client, &gw, &old).await, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Publish key 1 beside key 0; once fetched, sign with it.
    let before = loads(&gw, "ok").await;
    idp.set(Answer::Keys(jwks(&[(0, "k0"), (1, "k1")]), 1));
    two_more_fetches(&gw, before).await;
    phase.store(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Drop key 0: its tokens, cached ones included, stop once the set without it is in force.
    let before = loads(&gw, "ok").await;
    idp.set(Answer::Keys(jwks(&[(1, "k1")]), 1));
    two_more_fetches(&gw, before).await;
    assert_eq!(status(&client, &gw, &old).await, 401, "key 0 is gone");
    tokio::time::sleep(Duration::from_millis(500)).await;

    stop.store(true, Ordering::SeqCst);
    let (valid, valid_ok, bad, bad_refused) = traffic.await.expect("traffic");
    assert!(valid > 20, "too little traffic to mean anything: {valid}");
    assert_eq!(valid_ok, valid, "every valid token admitted");
    assert_eq!(bad_refused, bad, "every forged or expired token refused");
    // The five users' tokens of each key were verified once each and then served from the cache.
    let hits = gw
        .metric("turnstile_jwt_token_cache_total", &[("result", "hit")])
        .await;
    assert!(hits > 0.0, "the cache answered no repeated token");
    assert_eq!(loads(&gw, "failed").await, 0.0);
}

/// Tokens with kids nobody has ask for refetches, but the identity provider sees at most one per
/// `jwks_refresh_min`: 300 of them in a burst make exactly one. That refetch also brings a key
/// published since, so its tokens verify without waiting for the hour-long refresh.
#[tokio::test]
async fn unknown_kids_make_one_refetch_per_min_interval() {
    let keys = rsa_keys();
    let pki = Pki::new("idp-ca");
    let idp = Idp::start(&pki, Answer::Keys(jwks(&[(0, "k0")]), 3600)).await;
    let timing = "  jwks_refresh_min: 5s\n  jwks_refresh_max: 1h\n  jwks_refresh: 1h";
    let started = Instant::now();
    let gw = TestGateway::with_files(&config(&idp, &pki, timing), &[]).await;
    assert_eq!(idp.fetches(), 1);

    idp.set(Answer::Keys(jwks(&[(0, "k0"), (1, "k1")]), 3600));
    let client = Client::new();
    let exp = now() + 600;
    let fresh = token(&keys[1].signing, "k1", "dave", exp);
    assert_eq!(status(&client, &gw, &fresh).await, 401, "not fetched yet");
    // Signed once; each copy names another kid in its header (the signature no longer matches,
    // but a kid nobody has is refused before any signature check).
    let template = token(&keys[2].signing, "random", "mallory", exp);
    let (_, rest) = template.split_once('.').expect("a JWS");
    for i in 0..300 {
        let header = json!({"alg": "RS256", "typ": "JWT", "kid": format!("random-{i}")});
        let forged = format!("{}.{rest}", URL_SAFE_NO_PAD.encode(header.to_string()));
        assert_eq!(status(&client, &gw, &forged).await, 401);
    }
    assert!(
        started.elapsed() < Duration::from_millis(4500),
        "the burst must end within jwks_refresh_min of the first fetch to count exactly; it \
         took {:?}",
        started.elapsed()
    );
    assert_eq!(idp.fetches(), 1, "no refetch before jwks_refresh_min");
    let unknown = gw.metric("turnstile_jwt_unknown_kid_total", &[]).await;
    assert_eq!(unknown, 301.0);

    eventually("the refetch", Duration::from_secs(15), || async {
        idp.fetches() == 2
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "refetched too soon"
    );
    eventually(
        "the published key in force",
        Duration::from_secs(5),
        || async { status(&client, &gw, &fresh).await == 200 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(idp.fetches(), 2, "one refetch for the whole burst");
}

/// A URL that fails (500, then a body that is no JWK Set) keeps the last good keys in force:
/// fresh tokens of the old key (each a cache miss) keep verifying. Every failure the server
/// served is counted once; when the URL recovers with a rotated set, it applies.
#[tokio::test]
async fn failed_fetches_keep_the_last_good_keys_and_are_counted() {
    let keys = rsa_keys();
    let pki = Pki::new("idp-ca");
    let idp = Idp::start(&pki, Answer::Keys(jwks(&[(0, "k0")]), 1)).await;
    let timing = "  jwks_refresh: 1s\n  jwks_refresh_min: 500ms\n  jwks_refresh_max: 1s";
    let gw = TestGateway::with_files(&config(&idp, &pki, timing), &[]).await;
    let client = Client::new();
    let exp = now() + 600;

    let mut n = 0;
    for failure in [Answer::Error, Answer::Garbage] {
        let before = idp.served_failures.load(Ordering::SeqCst);
        idp.set(failure);
        let deadline = Instant::now() + Duration::from_secs(15);
        while idp.served_failures.load(Ordering::SeqCst) < before + 2 {
            assert!(Instant::now() < deadline, "no failed fetches");
            n += 1;
            let fresh = token(&keys[0].signing, "k0", &format!("user{n}"), exp);
            assert_eq!(status(&client, &gw, &fresh).await, 200, "the last good key");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    eventually(
        "each failure counted once",
        Duration::from_secs(5),
        || async {
            loads(&gw, "failed").await == idp.served_failures.load(Ordering::SeqCst) as f64
        },
    )
    .await;

    idp.set(Answer::Keys(jwks(&[(1, "k1")]), 1));
    let rotated = token(&keys[1].signing, "k1", "user0", exp);
    eventually(
        "the rotated set after recovery",
        Duration::from_secs(15),
        || async { status(&client, &gw, &rotated).await == 200 },
    )
    .await;
    let old = token(&keys[0].signing, "k0", "someone", exp);
    assert_eq!(status(&client, &gw, &old).await, 401);
}

/// A gateway whose first fetch fails still starts: tokens it cannot verify are refused as any
/// unverifiable token is, and the keys apply as soon as a retry gets them.
#[tokio::test]
async fn a_failed_first_fetch_starts_the_gateway_and_retries() {
    let keys = rsa_keys();
    let pki = Pki::new("idp-ca");
    let idp = Idp::start(&pki, Answer::Error).await;
    let gw = TestGateway::with_files(&config(&idp, &pki, ""), &[]).await;
    let client = Client::new();
    let valid = token(&keys[0].signing, "k0", "alice", now() + 600);
    assert_eq!(status(&client, &gw, &valid).await, 401);
    assert!(loads(&gw, "failed").await >= 1.0);
    idp.set(Answer::Keys(jwks(&[(0, "k0")]), 300));
    // Retries back off from 1 s.
    eventually(
        "the keys after a retry",
        Duration::from_secs(10),
        || async { status(&client, &gw, &valid).await == 200 },
    )
    .await;
}

/// A CA other than the one that signed the server's certificate: no keys, however good.
#[tokio::test]
async fn a_jwks_url_whose_certificate_does_not_chain_to_jwks_ca_gives_no_keys() {
    let keys = rsa_keys();
    let pki = Pki::new("idp-ca");
    let other = Pki::new("another-ca");
    let idp = Idp::start(&pki, Answer::Keys(jwks(&[(0, "k0")]), 300)).await;
    let gw = TestGateway::with_files(&config(&idp, &other, ""), &[]).await;
    let client = Client::new();
    let valid = token(&keys[0].signing, "k0", "alice", now() + 600);
    assert_eq!(status(&client, &gw, &valid).await, 401);
    assert!(loads(&gw, "failed").await >= 1.0);
    assert_eq!(idp.fetches(), 0, "the handshake failed before any request");
}

/// `jwks_file` is watched as the config is: a rotated file applies without a reload, and a bad
/// one keeps the keys in force (counted).
#[tokio::test]
async fn a_rotated_jwks_file_applies_and_a_bad_one_keeps_the_keys() {
    let keys = rsa_keys();
    let yaml = r#"
jwt:
  jwks_file: keys/jwks.json
routes:
  - name: api
    respond: { status: 200, body: ok }
    require_jwt: true
    policies:
      - { name: per_user, key: [jwt:sub], token_bucket: { rate: 1000/s, burst: 100000 } }
"#;
    let gw = TestGateway::with_files(yaml, &[("keys/jwks.json", &jwks(&[(0, "k0")]))]).await;
    let file = gw.config_path.parent().expect("dir").join("keys/jwks.json");
    let client = Client::new();
    let exp = now() + 600;
    let old = token(&keys[0].signing, "k0", "alice", exp);
    let new = token(&keys[1].signing, "k1", "alice", exp);
    assert_eq!(status(&client, &gw, &old).await, 200);
    assert_eq!(status(&client, &gw, &new).await, 401);

    write_by_rename(&file, &jwks(&[(1, "k1")]));
    eventually(
        "the rotated file in force",
        Duration::from_secs(10),
        || async { status(&client, &gw, &new).await == 200 },
    )
    .await;
    assert_eq!(
        status(&client, &gw, &old).await,
        401,
        "cached, but its key is gone"
    );

    let failed = || async {
        gw.metric(
            "turnstile_jwt_key_loads_total",
            &[("source", "jwks_file"), ("result", "failed")],
        )
        .await
    };
    std::fs::write(&file, "{ not json").expect("write");
    eventually("the bad file counted", Duration::from_secs(10), || async {
        failed().await == 1.0
    })
    .await;
    assert_eq!(
        status(&client, &gw, &new).await,
        200,
        "the keys in force stay"
    );
}

fn write_by_rename(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// A reload with the same key sources keeps the running keys and schedule: no fetch. A reload to
/// a URL that gives no keys fails, and the running config and keys keep serving.
#[tokio::test]
async fn a_reload_keeps_the_running_keys_or_fails_on_a_url_that_gives_none() {
    let keys = rsa_keys();
    let pki = Pki::new("idp-ca");
    let idp = Idp::start(&pki, Answer::Keys(jwks(&[(0, "k0")]), 3600)).await;
    let broken = Idp::start(&pki, Answer::Error).await;
    let timing = "  jwks_refresh: 1h\n  jwks_refresh_max: 1h";
    let yaml = config(&idp, &pki, timing);
    let gw = TestGateway::with_files(&yaml, &[]).await;
    let client = Client::new();
    let valid = token(&keys[0].signing, "k0", "alice", now() + 600);
    assert_eq!(status(&client, &gw, &valid).await, 200);

    gw.reload_with(&yaml).await.expect("same sources");
    assert_eq!(
        idp.fetches(),
        1,
        "the running ring carried over, no refetch"
    );
    assert_eq!(status(&client, &gw, &valid).await, 200);

    let errors = gw
        .reload_with(&config(&broken, &pki, timing))
        .await
        .expect_err("a URL that gives no keys");
    let text = errors.to_string();
    assert!(
        text.contains("jwt.jwks_url: the first fetch failed"),
        "{text}"
    );
    assert!(text.contains("policies.yaml:3:"), "names the line: {text}");
    assert_eq!(status(&client, &gw, &valid).await, 200, "the running keys");
    // The failed reload's ring is gone, and its retries with it (the first would come after 1 s).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        broken.fetches(),
        1,
        "no retry of a config that never served"
    );
}
