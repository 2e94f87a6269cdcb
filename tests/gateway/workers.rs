//! Connection workers (`--workers N` above one): each accepted connection lives on one worker
//! thread, handed out in turn, and each worker keeps its own idle upstream connections.

use std::time::Instant;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::support::client::{raw_connect, read_response};
use crate::support::gateway::substitute;
use crate::support::{GatewayProcess, Upstream, LIVENESS};

const GET: &[u8] = b"GET /w HTTP/1.1\r\nHost: x\r\n\r\n";

/// One request on `stream`: its status line.
async fn exchange(stream: &mut TcpStream) -> String {
    stream.write_all(GET).await.expect("write");
    let (head, _, rest) = read_response(stream, Vec::new()).await;
    assert!(rest.is_empty(), "bytes past the response: {rest:?}");
    head.lines().next().unwrap_or_default().to_string()
}

/// Waits until each worker's gauge reads `want` (the gauge of a connection that just closed
/// falls when its task ends).
async fn wait_worker_connections(gw: &GatewayProcess, want: [f64; 2]) {
    let deadline = Instant::now() + LIVENESS;
    loop {
        let mut seen = [0.0; 2];
        for (i, seen) in seen.iter_mut().enumerate() {
            let worker = (i + 1).to_string();
            *seen = gw
                .metric("turnstile_worker_connections", &[("worker", &worker)])
                .await;
        }
        if seen == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "connections per worker: {seen:?}, expected {want:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A gateway of `workers` workers forwarding everything to a fresh upstream.
async fn forwarding(workers: usize) -> (Upstream, GatewayProcess) {
    let upstream = Upstream::start().await;
    let yaml = substitute(crate::FORWARD_ALL, Some(upstream.addr));
    let gw = GatewayProcess::spawn_with_workers(&yaml, workers).await;
    (upstream, gw)
}

#[tokio::test]
async fn connections_are_spread_over_the_workers_and_each_keeps_its_own_upstream_connections() {
    let (upstream, gw) = forwarding(2).await;
    wait_worker_connections(&gw, [0.0, 0.0]).await;
    let (requests, dialled) = (upstream.requests(), upstream.connections());

    // Four keep-alive connections, one request each in turn: two land on each worker.
    let mut clients = Vec::new();
    for _ in 0..4 {
        let mut stream = raw_connect(gw.public, GET).await;
        let (head, _, _) = read_response(&mut stream, Vec::new()).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        clients.push(stream);
    }
    wait_worker_connections(&gw, [2.0, 2.0]).await;
    // Each request in turn found the connection its worker's previous one left idle: one
    // upstream connection per worker. A pool shared by the workers would have dialled one.
    for _ in 0..3 {
        for client in &mut clients {
            assert_eq!(exchange(client).await, "HTTP/1.1 200 OK");
        }
    }
    assert_eq!(upstream.requests() - requests, 16);
    assert_eq!(upstream.connections() - dialled, 2);

    drop(clients);
    wait_worker_connections(&gw, [0.0, 0.0]).await;
}

#[tokio::test]
async fn one_worker_serves_on_the_main_runtime_with_no_worker_series() {
    let (_upstream, gw) = forwarding(1).await;
    let mut stream = raw_connect(gw.public, GET).await;
    let (head, _, _) = read_response(&mut stream, Vec::new()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let text = crate::support::Client::new()
        .get(&gw.admin_url("/metrics"))
        .await
        .text();
    assert!(!text.contains("turnstile_worker_connections{"), "{text}");
    assert!(text.contains("turnstile_open_connections{listener=\"public\"} 1"));
}
