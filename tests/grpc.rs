//! gRPC through the gateway (issue 39): a real `grpcio` server behind it as an h2 upstream (h2c
//! and TLS), a real `grpcio` client in front. Unary and streaming calls pass with their trailing
//! metadata; a limited call gets `RESOURCE_EXHAUSTED` with the pushback; a stream is one request
//! to its policies and holds its concurrency lease until it ends, however it ends; the gateway's
//! own failures are gRPC codes.
//!
//! The gateway runs in process; the tests run on a multi-threaded runtime, since the client's
//! commands block the test's own thread while the gateway serves on the workers.

mod support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::grpc::{GrpcClient, GrpcServer, BIDI, CLIENT_STREAM, SERVER_STREAM, UNARY};
use support::tls::{Pki, Usage};
use support::TestGateway;

/// Routes per method of the test service to an h2 upstream at `$UPSTREAM` (`scheme` and any
/// extra upstream fields given), with `policies` (YAML flow list) on the unary method.
fn config(upstream: &str, unary_policies: &str, bidi_policies: &str) -> String {
    format!(
        r#"
upstreams:
  echo:
{upstream}
routes:
  - name: unary
    match: {{ path: "/turnstile.test.Echo/Unary" }}
    upstream: echo
    policies: {unary_policies}
  - name: bidi
    match: {{ path: "/turnstile.test.Echo/Bidi" }}
    upstream: echo
    policies: {bidi_policies}
  - name: echo
    match: {{ prefix: "/turnstile.test.Echo/" }}
    upstream: echo
"#
    )
}

const H2C: &str = "    url: http://$UPSTREAM\n    protocol: h2";

fn code(answer: &Value) -> &str {
    answer["code"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_the_limit_is_admitted_and_the_rest_get_resource_exhausted_with_the_pushback() {
    let server = GrpcServer::start();
    let policies = "[{ name: calls, key: [client_ip], token_bucket: { rate: 1/h, burst: 3 } }]";
    let gw = TestGateway::with_upstream(&config(H2C, policies, "[]"), server.addr).await;
    let mut client = GrpcClient::connect(gw.public);

    let first = client.unary(UNARY, "hello");
    assert_eq!(code(&first), "OK", "{first}");
    assert_eq!(first["messages"], json!(["echo:hello"]));
    assert_eq!(first["initial"]["x-initial"], "unary", "{first}");
    assert_eq!(first["trailing"]["x-trailer"], "unary", "{first}");

    let codes = client.unary_many(UNARY, 4);
    assert_eq!(
        codes,
        ["OK", "OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]
    );

    let refused = client.unary(UNARY, "again");
    assert_eq!(code(&refused), "RESOURCE_EXHAUSTED", "{refused}");
    assert_eq!(
        refused["details"],
        "rate limited by policy calls of route unary"
    );
    let trailing = &refused["trailing"];
    let pushback: u64 = trailing["grpc-retry-pushback-ms"]
        .as_str()
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no pushback: {refused}"));
    // One token an hour, three spent: the next within the hour.
    assert!((1..=3_600_000).contains(&pushback), "{pushback}");
    let retry_after: u64 = trailing["retry-after"].as_str().unwrap().parse().unwrap();
    assert_eq!(retry_after, pushback.div_ceil(1000), "{refused}");

    let mut direct = GrpcClient::connect(server.addr);
    assert_eq!(
        direct.counts()["Unary"],
        3,
        "only admitted calls reach the server"
    );
    // Counted under the refusal's HTTP meaning, though the wire says 200.
    assert_eq!(
        gw.metric(
            "turnstile_decisions_total",
            &[
                ("route", "unary"),
                ("policy", "calls"),
                ("decision", "limited")
            ]
        )
        .await,
        3.0
    );
    assert_eq!(
        gw.metric(
            "turnstile_requests_total",
            &[("route", "unary"), ("code", "429")]
        )
        .await,
        3.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_calls_pass_through_with_their_trailers_and_count_once_each() {
    let server = GrpcServer::start();
    let bidi = "[{ name: streams, key: [client_ip], token_bucket: { rate: 1/h, burst: 2 } }]";
    let gw = TestGateway::with_upstream(&config(H2C, "[]", bidi), server.addr).await;
    let mut client = GrpcClient::connect(gw.public);

    let answer = client.run(json!({"op": "server_stream", "method": SERVER_STREAM, "data": "5"}));
    assert_eq!(code(&answer), "OK", "{answer}");
    assert_eq!(
        answer["messages"],
        json!(["msg0", "msg1", "msg2", "msg3", "msg4"])
    );
    assert_eq!(answer["trailing"]["x-trailer"], "server-stream");

    let answer = client
        .run(json!({"op": "client_stream", "method": CLIENT_STREAM, "messages": ["a", "b", "c"]}));
    assert_eq!(code(&answer), "OK", "{answer}");
    assert_eq!(answer["messages"], json!(["a|b|c"]));
    assert_eq!(answer["trailing"]["x-count"], "3");

    // Each stream is one request to the route's policy, however many messages it carries.
    let messages: Vec<String> = (0..20).map(|i| format!("m{i}")).collect();
    for _ in 0..2 {
        let answer = client.run(json!({"op": "bidi", "method": BIDI, "messages": messages}));
        assert_eq!(code(&answer), "OK", "{answer}");
        assert_eq!(answer["messages"].as_array().unwrap().len(), 20);
        assert_eq!(answer["messages"][19], "echo:m19");
        assert_eq!(answer["trailing"]["x-trailer"], "bidi");
    }
    let answer = client.run(json!({"op": "bidi", "method": BIDI, "messages": ["x"]}));
    assert_eq!(code(&answer), "RESOURCE_EXHAUSTED", "{answer}");
    let mut direct = GrpcClient::connect(server.addr);
    assert_eq!(direct.counts()["Bidi"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_upstream_over_tls_is_chosen_by_alpn() {
    let pki = Pki::new("grpc test CA");
    let (cert, key) = pki.leaf("upstream", 2, Usage::Server);
    let server = GrpcServer::start_tls(&cert, &key);
    let upstream = format!(
        "    url: https://localhost:{}\n    protocol: h2\n    ca: {}",
        server.addr.port(),
        pki.ca.display()
    );
    let gw = TestGateway::start(&config(&upstream, "[]", "[]")).await;
    let mut client = GrpcClient::connect(gw.public);

    let answer = client.unary(UNARY, "over tls");
    assert_eq!(code(&answer), "OK", "{answer}");
    assert_eq!(answer["messages"], json!(["echo:over tls"]));
    assert_eq!(answer["trailing"]["x-trailer"], "unary");

    let answer = client.run(json!({"op": "bidi", "method": BIDI, "messages": ["a", "b"]}));
    assert_eq!(code(&answer), "OK", "{answer}");
    assert_eq!(answer["messages"], json!(["echo:a", "echo:b"]));
    assert_eq!(answer["trailing"]["x-trailer"], "bidi");
}

/// Opens bidi stream `id` and waits for its first echo, retrying (bounded) while the previous
/// stream's lease is still being released: the gateway hears of a cut asynchronously.
fn open_admitted(client: &mut GrpcClient, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        client.run(json!({"op": "open", "id": id, "method": BIDI}));
        let answer = client.run(json!({"op": "send", "id": id, "data": "first"}));
        if code(&answer) == "OK" {
            assert_eq!(answer["messages"], json!(["echo:first"]));
            return;
        }
        assert_eq!(code(&answer), "RESOURCE_EXHAUSTED", "{answer}");
        client.run(json!({"op": "finish", "id": id}));
        assert!(Instant::now() < deadline, "the lease was never released");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_lease_spans_it_and_a_cut_by_either_side_releases_it() {
    let server = GrpcServer::start();
    let bidi = "[{ name: open_streams, key: [method], concurrency: { limit: 1 } }]";
    let gw = TestGateway::with_upstream(&config(H2C, "[]", bidi), server.addr).await;
    let mut client = GrpcClient::connect(gw.public);
    let mut other = GrpcClient::connect(gw.public);
    let in_flight = || gw.metric("turnstile_in_flight_requests", &[("route", "bidi")]);

    // The stream holds the one lease while it is open, between messages too.
    open_admitted(&mut client, "s1");
    std::thread::sleep(Duration::from_millis(200));
    let refused = other.run(json!({"op": "bidi", "method": BIDI, "messages": ["x"]}));
    assert_eq!(code(&refused), "RESOURCE_EXHAUSTED", "{refused}");
    assert_eq!(in_flight().await, 1.0);
    let answer = client.run(json!({"op": "send", "id": "s1", "data": "second"}));
    assert_eq!(answer["messages"], json!(["echo:second"]));

    // The client cuts it: the lease comes back.
    client.run(json!({"op": "cancel", "id": "s1"}));
    open_admitted(&mut other, "s2");

    // The server cuts it: likewise.
    let answer = other.run(json!({"op": "send", "id": "s2", "data": "abort"}));
    assert_eq!(code(&answer), "ABORTED", "{answer}");
    assert_eq!(answer["details"], "the server cut the stream");
    open_admitted(&mut client, "s3");

    // Ended cleanly: trailers arrive, and the lease is back.
    let answer = client.run(json!({"op": "finish", "id": "s3"}));
    assert_eq!(code(&answer), "OK", "{answer}");
    assert_eq!(answer["trailing"]["x-trailer"], "bidi");
    let answer = other.run(json!({"op": "bidi", "method": BIDI, "messages": ["y"]}));
    assert_eq!(code(&answer), "OK", "{answer}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight().await != 0.0 {
        assert!(Instant::now() < deadline, "a lease is still held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_own_failures_are_grpc_codes() {
    let server = GrpcServer::start();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    let yaml = format!(
        r#"
upstreams:
  slow:
    url: http://$UPSTREAM
    protocol: h2
    timeout: 1s
  gone:
    url: http://127.0.0.1:{closed_port}
    protocol: h2
routes:
  - name: slow
    match: {{ path: "/turnstile.test.Echo/Unary" }}
    upstream: slow
  - name: gone
    match: {{ path: "/turnstile.test.Echo/Bidi" }}
    upstream: gone
"#
    );
    let gw = TestGateway::with_upstream(&yaml, server.addr).await;
    let mut client = GrpcClient::connect(gw.public);

    let answer = client.unary(UNARY, "slow");
    assert_eq!(code(&answer), "DEADLINE_EXCEEDED", "{answer}");
    assert_eq!(
        answer["details"],
        "the upstream of route slow did not answer in time"
    );
    let answer = client.run(json!({"op": "bidi", "method": BIDI, "messages": ["x"]}));
    assert_eq!(code(&answer), "UNAVAILABLE", "{answer}");
    assert_eq!(
        answer["details"],
        "the upstream of route gone is unreachable"
    );
    let answer = client.run(json!({"op": "server_stream", "method": SERVER_STREAM, "data": "1"}));
    assert_eq!(code(&answer), "UNIMPLEMENTED", "{answer}");
    assert_eq!(
        gw.metric(
            "turnstile_requests_total",
            &[("route", "slow"), ("code", "5xx")]
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_balanced_round_robin_over_the_targets() {
    let (a, b) = (GrpcServer::start(), GrpcServer::start());
    let upstream = format!(
        "    targets: [http://{}, http://{}]\n    protocol: h2",
        a.addr, b.addr
    );
    let gw = TestGateway::start(&config(&upstream, "[]", "[]")).await;
    let mut client = GrpcClient::connect(gw.public);
    assert_eq!(client.unary_many(UNARY, 10), vec!["OK"; 10]);
    for server in [&a, &b] {
        let mut direct = GrpcClient::connect(server.addr);
        assert_eq!(direct.counts()["Unary"], 5, "round robin: five each");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_dies_mid_stream_releases_the_lease() {
    let server = GrpcServer::start();
    let bidi = "[{ name: open_streams, key: [method], concurrency: { limit: 1 } }]";
    let gw = TestGateway::with_upstream(&config(H2C, "[]", bidi), server.addr).await;
    let mut client = GrpcClient::connect(gw.public);
    open_admitted(&mut client, "s1");
    assert_eq!(
        gw.metric("turnstile_in_flight_requests", &[("route", "bidi")])
            .await,
        1.0
    );
    // Killed: its connection closes under the open stream.
    drop(server);
    let answer = client.run(json!({"op": "send", "id": "s1", "data": "second"}));
    assert_ne!(code(&answer), "OK", "{answer}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while gw
        .metric("turnstile_in_flight_requests", &[("route", "bidi")])
        .await
        != 0.0
    {
        assert!(
            Instant::now() < deadline,
            "the dead stream's lease is still held"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An in-process h2c upstream answering every request with its body, and with response trailers
/// that name the request's trailers (`x-seen-NAME: VALUE`): what a gRPC server could read.
async fn trailer_echo() -> std::net::SocketAddr {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let body = req.into_body().collect().await?;
                        let mut seen = http::HeaderMap::new();
                        for (name, value) in body.trailers().into_iter().flatten() {
                            let name = format!("x-seen-{name}");
                            seen.insert(http::HeaderName::try_from(name).unwrap(), value.clone());
                        }
                        let frames = vec![
                            Ok::<_, hyper::Error>(hyper::body::Frame::data(body.to_bytes())),
                            Ok(hyper::body::Frame::trailers(seen)),
                        ];
                        let body =
                            http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                        Ok::<_, hyper::Error>(http::Response::new(body))
                    },
                );
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                        .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trailers_reach_the_upstream_and_response_trailers_the_client() {
    use http_body_util::BodyExt;
    let upstream = trailer_echo().await;
    let yaml = "upstreams:\n  up: { url: \"http://$UPSTREAM\", protocol: h2 }\nroutes:\n  - name: all\n    upstream: up\n";
    let gw = TestGateway::with_upstream(yaml, upstream).await;

    let tcp = tokio::net::TcpStream::connect(gw.public).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(connection);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", http::HeaderValue::from_static("abc123"));
    let frames = vec![
        Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(bytes::Bytes::from_static(
            b"payload",
        ))),
        Ok(hyper::body::Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let req = http::Request::post(format!("http://{}/stream", gw.public))
        .header("te", "trailers")
        .body(body)
        .unwrap();
    let response = tokio::time::timeout(support::LIVENESS, sender.send_request(req))
        .await
        .expect("answered in time")
        .unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap();
    let trailers = body.trailers().cloned().expect("response trailers");
    assert_eq!(trailers["x-seen-x-checksum"], "abc123");
    assert_eq!(body.to_bytes(), "payload");
}
