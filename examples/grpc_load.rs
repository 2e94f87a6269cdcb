//! The gRPC unary benchmark's two ends (`bench/grpc.sh`): a fast gRPC upstream, and a bounded load
//! generator of unary calls over HTTP/2 with prior knowledge.
//!
//! cargo run --release --example grpc_load -- upstream
//!     Serves h2c on a free loopback port (printed as `listening PORT`): every call is answered
//!     with its own message and `grpc-status: 0` in the trailers, as a gRPC echo server would.
//! cargo run --release --example grpc_load -- load --addr 127.0.0.1:8080 --seconds 10 \
//!     --requests 2000000 --connections 4 --concurrency 64
//!     Unary calls to `/bench.Echo/Unary` from `--concurrency` tasks over `--connections`
//!     connections until `--seconds` pass or `--requests` are sent. Prints one line:
//!     `calls N seconds S rps R p50_ms A p99_ms B not_ok K errors E` (`not_ok`: answered with a
//!     grpc-status other than 0; `errors`: no answer).

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// One gRPC message: the compressed flag, the length, the bytes (gRPC over HTTP/2,
/// "Length-Prefixed-Message").
fn frame(message: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    Bytes::from(out)
}

type EchoBody = http_body_util::StreamBody<
    futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>,
>;

async fn echo(req: Request<Incoming>) -> Result<Response<EchoBody>, Infallible> {
    let message = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let frames = vec![Ok(Frame::data(message)), Ok(Frame::trailers(trailers))];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut response = Response::new(body);
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    Ok(response)
}

async fn upstream() -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening {}", listener.local_addr()?.port());
    loop {
        let (tcp, _) = listener.accept().await?;
        let _ = tcp.set_nodelay(true);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(echo);
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

struct Load {
    addr: String,
    seconds: u64,
    requests: u64,
    connections: usize,
    concurrency: usize,
}

fn parse_load(mut it: impl Iterator<Item = String>) -> Result<Load, String> {
    let mut load = Load {
        addr: "127.0.0.1:8080".into(),
        seconds: 10,
        requests: 1_000_000,
        connections: 4,
        concurrency: 64,
    };
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("{flag}: not a number"))
        };
        match flag.as_str() {
            "--addr" => load.addr = value.clone(),
            "--seconds" => load.seconds = num()?.clamp(1, 600),
            "--requests" => load.requests = num()?.max(1),
            "--connections" => load.connections = num()?.clamp(1, 256) as usize,
            "--concurrency" => load.concurrency = num()?.clamp(1, 4096) as usize,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(load)
}

/// What one task saw.
#[derive(Default)]
struct Seen {
    latencies_us: Vec<u32>,
    not_ok: u64,
    errors: u64,
}

async fn run(load: Load) -> Result<(), String> {
    let mut senders = Vec::new();
    for _ in 0..load.connections {
        let tcp = tokio::net::TcpStream::connect(&load.addr)
            .await
            .map_err(|e| format!("connect {}: {e}", load.addr))?;
        let _ = tcp.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake::<_, Full<Bytes>>(TokioIo::new(tcp))
            .await
            .map_err(|e| format!("h2 handshake: {e}"))?;
        tokio::spawn(connection);
        senders.push(sender);
    }
    let uri: http::Uri = format!("http://{}/bench.Echo/Unary", load.addr)
        .parse()
        .map_err(|e| format!("{e}"))?;
    let body = frame(b"turnstile-bench!");
    let started = Instant::now();
    let until = started + Duration::from_secs(load.seconds);
    let budget = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(load.requests));
    let mut tasks = Vec::new();
    for i in 0..load.concurrency {
        let mut sender = senders[i % senders.len()].clone();
        let (uri, body, budget) = (uri.clone(), body.clone(), budget.clone());
        tasks.push(tokio::spawn(async move {
            let mut seen = Seen::default();
            while Instant::now() < until
                && budget
                    .fetch_update(
                        std::sync::atomic::Ordering::Relaxed,
                        std::sync::atomic::Ordering::Relaxed,
                        |n| n.checked_sub(1),
                    )
                    .is_ok()
            {
                let mut req = Request::post(uri.clone()).body(Full::new(body.clone()));
                if let Ok(req) = &mut req {
                    let h = req.headers_mut();
                    h.insert("content-type", HeaderValue::from_static("application/grpc"));
                    h.insert("te", HeaderValue::from_static("trailers"));
                }
                let Ok(req) = req else { break };
                let sent = Instant::now();
                let answered = match sender.send_request(req).await {
                    Ok(response) => response.into_body().collect().await.ok(),
                    Err(_) => None,
                };
                match answered {
                    Some(body) => {
                        let ok = body
                            .trailers()
                            .and_then(|t| t.get("grpc-status"))
                            .is_some_and(|s| s == "0");
                        if !ok {
                            seen.not_ok += 1;
                        }
                        let us = sent.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                        seen.latencies_us.push(us);
                    }
                    None => seen.errors += 1,
                }
            }
            seen
        }));
    }
    let mut all = Seen::default();
    for task in tasks {
        let seen = task.await.map_err(|e| format!("task: {e}"))?;
        all.latencies_us.extend(seen.latencies_us);
        all.not_ok += seen.not_ok;
        all.errors += seen.errors;
    }
    let seconds = started.elapsed().as_secs_f64();
    all.latencies_us.sort_unstable();
    let calls = all.latencies_us.len();
    let percentile = |p: f64| {
        if calls == 0 {
            return 0.0;
        }
        let rank = ((p / 100.0 * calls as f64).ceil() as usize).clamp(1, calls);
        f64::from(all.latencies_us[rank - 1]) / 1000.0
    };
    println!(
        "calls {calls} seconds {seconds:.3} rps {:.1} p50_ms {:.3} p99_ms {:.3} not_ok {} errors {}",
        calls as f64 / seconds,
        percentile(50.0),
        percentile(99.0),
        all.not_ok,
        all.errors
    );
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let outcome = match args.next().as_deref() {
        Some("upstream") => upstream().await.map_err(|e| e.to_string()),
        Some("load") => match parse_load(args) {
            Ok(load) => run(load).await,
            Err(e) => Err(e),
        },
        _ => Err(
            "usage: grpc_load upstream | grpc_load load [--addr A] [--seconds S] \
                  [--requests N] [--connections C] [--concurrency K]"
                .into(),
        ),
    };
    if let Err(e) = outcome {
        eprintln!("grpc_load: {e}");
        std::process::exit(2);
    }
}
