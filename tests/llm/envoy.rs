//! Through Envoy (`docs/llm.md`, "Through Envoy"): a real Envoy runs the shipped bootstrap
//! (`deploy/envoy/llm-ext-proc.yaml`, only its ports changed), whose `ext_proc` filter points at
//! Turnstile's `ext_proc.listen`, in front of the test upstream. The official SDKs, streaming and
//! not, are charged exactly what the upstream reports; an exhausted budget is refused before the
//! upstream; a client that goes away mid-stream leaves nothing reserved; concurrent streams never
//! spend more than the budget; every failure settles as the gateway settles it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::Method;
use http_body_util::BodyExt;

use super::support::client::{full, request};
use super::support::envoy::Envoy;
use super::support::llm::{sdk, LlmUpstream};
use super::support::stores::TestStore;
use super::support::tools::repo_path;
use super::support::{upstream, Client, Reply, TestGateway};
use super::{config, settled, wait_settled, BUDGET, CHAT, CHAT_STREAM, RESERVE};

/// The shipped bootstrap with the test's addresses: admin and listener on free ports, Turnstile's
/// ext_proc listener and the upstream where they really are.
pub fn bootstrap(ext_proc: SocketAddr, upstream: SocketAddr) -> String {
    std::fs::read_to_string(repo_path("deploy/envoy/llm-ext-proc.yaml"))
        .expect("deploy/envoy/llm-ext-proc.yaml")
        .replace("port_value: 9901", "port_value: 0")
        .replace(
            "address: 0.0.0.0, port_value: 10000",
            "address: 127.0.0.1, port_value: 0",
        )
        .replace(
            "port_value: 8084",
            &format!("port_value: {}", ext_proc.port()),
        )
        .replace(
            "port_value: 8000",
            &format!("port_value: {}", upstream.port()),
        )
}

/// Turnstile (the budgets of `super::config`, an ext_proc listener), and Envoy in front of
/// `upstream` with Turnstile as its external processor.
struct Door {
    gw: TestGateway,
    envoy: Envoy,
}

impl Door {
    async fn start(store: &TestStore, upstream: SocketAddr) -> Door {
        let yaml = format!("ext_proc:\n  listen: 127.0.0.1:0\n{}", config(store, ""));
        let gw = TestGateway::with_upstream(&yaml, upstream).await;
        let ext_proc = gw.running().ext_proc_addr.expect("the ext_proc listener");
        let envoy = Envoy::start(&bootstrap(ext_proc, upstream)).await;
        Door { gw, envoy }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.envoy.listener)
    }

    fn post_request(
        &self,
        path: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> http::Request<super::support::client::ReqBody> {
        super::post_request_to(&self.url(path), body, headers)
    }

    async fn post(&self, path: &str, body: &str, headers: &[(&str, &str)]) -> Reply {
        super::post_to(&self.url(path), body, headers).await
    }

    /// (status, body bytes, whether the body ended cleanly).
    async fn post_lossy(
        &self,
        path: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> (u16, Vec<u8>, bool) {
        super::post_lossy_to(&self.url(path), body, headers).await
    }

    /// The `x-ratelimit-remaining` Envoy's client sees on an admitted request (which reserves).
    async fn remaining(&self, path: &str, body: &str, headers: &[(&str, &str)]) -> u64 {
        let reply = self.post(path, body, headers).await;
        assert_eq!(reply.status, 200, "{reply:?}\n{}", self.envoy.log());
        reply.header_u64("x-ratelimit-remaining")
    }

    async fn streams(&self, end: &str) -> f64 {
        self.gw
            .metric("turnstile_ext_proc_streams_total", &[("end", end)])
            .await
    }
}

/// A JSON body and each provider's stream settle to their usage, and the stream reaches the
/// client through Envoy byte for byte.
async fn bodies_and_streams_settle_to_their_usage_through_envoy(store: TestStore) {
    let upstream = LlmUpstream::start();
    let door = Door::start(&store, upstream.addr).await;
    let reply = door.post("/v1/chat/completions", CHAT, &[]).await;
    assert_eq!(reply.status, 200, "{reply:?}\n{}", door.envoy.log());
    assert_eq!(reply.header_u64("x-ratelimit-remaining"), BUDGET - RESERVE);
    let (refunded, reserved, unreported, tokens) = wait_settled(&door.gw, "openai").await;
    assert_eq!(
        (refunded, reserved, unreported, tokens),
        (74.0, 0.0, 0.0, 26.0)
    );
    let chat = door.post("/v1/chat/completions", CHAT_STREAM, &[]).await;
    assert_eq!(chat.status, 200);
    assert!(chat.text().ends_with("data: [DONE]\n\n"), "{}", chat.text());
    assert_eq!(chat.text().matches("data: ").count(), 20 + 4);
    let (_, _, unreported, tokens) = wait_settled(&door.gw, "openai").await;
    assert_eq!((unreported, tokens), (0.0, 52.0));
    assert_eq!(
        door.remaining("/v1/chat/completions", CHAT, &[]).await,
        BUDGET - 52 - RESERVE,
        "the counter holds exactly the usage"
    );
    let messages = door
        .post(
            "/v1/messages",
            r#"{"model":"c","stream":true,"max_tokens":9,"messages":[{"role":"user","content":"one two three"}]}"#,
            &[("x-test-cached", "2")],
        )
        .await;
    assert!(messages.text().contains("event: message_stop"));
    let (refunded, _, unreported, tokens) = wait_settled(&door.gw, "anthropic").await;
    assert_eq!((unreported, tokens, refunded), (0.0, 15.0, 85.0));
    let stats = upstream.stats().await;
    assert_eq!(stats["requests"], 4);
    assert!(
        stats["last_body"]
            .as_str()
            .is_some_and(|b| b.contains(r#""max_tokens":9"#)),
        "the body read before admission went upstream unchanged: {stats}"
    );
    assert_eq!(door.streams("complete").await, 4.0);
    assert_eq!(door.streams("cut").await, 0.0);
    let allowed = [("door", "ext_proc"), ("result", "allowed")];
    assert_eq!(
        door.gw
            .metric("turnstile_door_checks_total", &allowed)
            .await,
        4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_through_envoy_are_metered_exactly() {
    let upstream = LlmUpstream::start();
    let door = Door::start(&TestStore::memory(), upstream.addr).await;
    let (out, openai, anthropic) = super::sdk::run_formats(door.url(""), &upstream).await;
    let (_, reserved, unreported, tokens) = wait_settled(&door.gw, "openai").await;
    assert_eq!(
        (reserved, unreported, tokens),
        (0.0, 0.0, openai as f64),
        "{out}"
    );
    let probe = [("authorization", "Bearer sk-test-1")];
    assert_eq!(
        door.remaining("/v1/chat/completions", CHAT, &probe).await,
        BUDGET - openai - RESERVE
    );
    let (_, _, unreported, tokens) = wait_settled(&door.gw, "anthropic").await;
    assert_eq!((unreported, tokens), (0.0, anthropic as f64), "{out}");
    assert_eq!(
        door.remaining("/v1/messages", r#"{"model":"c","messages":[]}"#, &probe)
            .await,
        BUDGET - anthropic - RESERVE
    );
    assert_eq!(door.streams("complete").await, 8.0);
}

/// Ten streams cut before their usage keep their reservations; the next request, and the SDKs',
/// are refused by Envoy with Turnstile's 429 before the upstream sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_budget_is_refused_through_envoy_before_the_upstream() {
    let upstream = LlmUpstream::start();
    let door = Door::start(&TestStore::memory(), upstream.addr).await;
    let key = [
        ("authorization", "Bearer sk-test-1"),
        ("x-test-mode", "cut"),
    ];
    let messages = r#"{"model":"c","stream":true,"max_tokens":5,"messages":[]}"#;
    // The client sees the stream break, or (the upstream broke before Envoy passed the head on)
    // Envoy's 502.
    let broken = |(status, _, clean): (u16, Vec<u8>, bool)| {
        assert!(
            status == 502 || (status, clean) == (200, false),
            "{status} {clean}"
        );
    };
    for _ in 0..BUDGET / RESERVE {
        broken(
            door.post_lossy("/v1/chat/completions", CHAT_STREAM, &key)
                .await,
        );
        broken(door.post_lossy("/v1/messages", messages, &key).await);
    }
    for route in ["openai", "anthropic"] {
        let (refunded, _, unreported, _) = wait_settled(&door.gw, route).await;
        assert_eq!((refunded, unreported), (0.0, 10.0), "{route}");
    }
    let requests = upstream.stats().await["requests"].clone();
    assert_eq!(requests, 20);
    let refused = door
        .post("/v1/chat/completions", CHAT_STREAM, &key[..1])
        .await;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.header_u64("x-ratelimit-limit"), BUDGET);
    assert_eq!(refused.header_u64("x-ratelimit-remaining"), 0);
    assert!(refused.header_u64("retry-after") > 86_400 * 99);
    assert_eq!(refused.json()["error"], "rate_limited");
    let base = door.url("");
    let out = tokio::task::spawn_blocking(move || sdk("refused", &base))
        .await
        .expect("sdk run");
    assert_eq!(out["status"], 429, "{out}");
    assert_eq!(out["anthropic_status"], 429, "{out}");
    assert_eq!(out["limit"], BUDGET.to_string());
    assert_eq!(out["remaining"], "0");
    assert_eq!(
        upstream.stats().await["requests"],
        requests,
        "refused before the upstream"
    );
    assert_eq!(door.streams("cut").await, 20.0);
    assert_eq!(door.streams("refused").await, 3.0);
}

/// The client goes away mid-stream: Envoy resets the stream, the processing stream ends with
/// it, and the reservation is settled (charged in full: the usage had not gone by).
async fn a_client_gone_mid_stream_through_envoy_leaves_nothing_reserved(store: TestStore) {
    let upstream = LlmUpstream::start();
    let door = Door::start(&store, upstream.addr).await;
    let req = request(Method::POST, &door.url("/v1/chat/completions"))
        .header("authorization", "Bearer sk-1")
        .header("content-type", "application/json")
        .header("x-test-delay-ms", "50")
        .header("x-test-output-tokens", "100")
        .body(full(CHAT_STREAM.to_string()))
        .expect("request");
    let response = Client::new().head(req).await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = body.frame().await.expect("a first event").expect("data");
    assert!(first.data_ref().is_some());
    let reserved = door
        .gw
        .metric(
            "turnstile_cost_reserved_units",
            &[("route", "openai"), ("policy", "tokens")],
        )
        .await;
    assert_eq!(reserved, RESERVE as f64, "held while the stream runs");
    drop(body);
    let (refunded, reserved, unreported, _) = wait_settled(&door.gw, "openai").await;
    assert_eq!((refunded, reserved, unreported), (0.0, 0.0, 1.0));
    assert_eq!(door.streams("cut").await, 1.0);
    assert_eq!(
        door.remaining("/v1/chat/completions", CHAT, &[]).await,
        BUDGET - 2 * RESERVE
    );
}

/// Each failure settles to the gateway's documented charge, nothing left reserved: an upstream
/// 500 is charged `min_cost`, a malformed or huge body the reservation, and a response Envoy
/// made itself (the upstream unreachable: 503) the reservation, as a missing response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_through_envoy_settle_as_the_gateway_settles_them() {
    let upstream = LlmUpstream::start();
    let door = Door::start(&TestStore::memory(), upstream.addr).await;
    let pad = (2 << 20).to_string();
    // (API key, the request's test switches, the status the client gets, the units charged).
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], u16, u64);
    let cases: [Case; 3] = [
        ("Bearer sk-error", &[("x-test-mode", "error")], 500, 1),
        (
            "Bearer sk-malformed",
            &[("x-test-mode", "malformed")],
            200,
            RESERVE,
        ),
        ("Bearer sk-huge", &[("x-test-pad", &pad)], 200, RESERVE),
    ];
    for (i, (key, headers, status, charged)) in cases.into_iter().enumerate() {
        // The probe of the case before has settled (the first case has nothing before it).
        let before = match i {
            0 => settled(&door.gw, "openai").await,
            _ => wait_settled(&door.gw, "openai").await,
        };
        let mut all = vec![("authorization", key)];
        all.extend_from_slice(headers);
        let (got, body, clean) = door.post_lossy("/v1/chat/completions", CHAT, &all).await;
        assert_eq!((got, clean), (status, true), "{key}");
        if key == "Bearer sk-huge" {
            assert!(body.len() > 2 << 20, "the whole body reached the client");
        }
        let after = wait_settled(&door.gw, "openai").await;
        assert_eq!(
            after.0 - before.0,
            (RESERVE - charged) as f64,
            "{key}: refund"
        );
        assert_eq!(after.2 - before.2, 1.0, "{key}: unreported");
        assert_eq!(
            door.remaining("/v1/chat/completions", CHAT, &[("authorization", key)])
                .await,
            BUDGET - charged - RESERVE,
            "{key}: the counter holds exactly the charge"
        );
    }
    // No upstream: Envoy answers 503 itself, which is no response at all.
    let gone = upstream::unreachable_addr().await;
    let lonely = Door::start(&TestStore::memory(), gone).await;
    let reply = lonely.post("/v1/chat/completions", CHAT, &[]).await;
    assert_eq!(reply.status, 503, "{reply:?}");
    let (refunded, reserved, unreported, _) = wait_settled(&lonely.gw, "openai").await;
    assert_eq!((refunded, reserved, unreported), (0.0, 0.0, 1.0));
}

/// Many concurrent streams from two API keys against a 1,000-token budget each: the tokens the
/// upstream reports for a key never exceed it, and demand runs it down to less than one
/// reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_through_envoy_never_exceed_the_budget() {
    const KEYS: [&str; 2] = ["Bearer sk-a", "Bearer sk-b"];
    const BODY: &str = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":40,"messages":[{"role":"user","content":"count to twenty please"}]}"#;
    let upstream = LlmUpstream::start();
    let door = std::sync::Arc::new(Door::start(&TestStore::memory(), upstream.addr).await);
    // Every worker streams until it has been refused 40 times in a row (a second of refusals,
    // longer than a stream runs, so the refunds of the streams before have landed), or the
    // deadline: the budget is then run down to less than one reservation.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tasks = Vec::new();
    for key in KEYS {
        for _ in 0..8 {
            let door = door.clone();
            tasks.push(tokio::spawn(async move {
                let (mut admitted, mut refused, mut streak) = (0u64, 0u64, 0u32);
                for _ in 0..1000 {
                    if Instant::now() > deadline || streak >= 40 {
                        break;
                    }
                    let headers = [
                        ("authorization", key),
                        ("x-test-output-tokens", "40"),
                        ("x-test-delay-ms", "5"),
                    ];
                    let (status, _, clean) = door
                        .post_lossy("/v1/chat/completions", BODY, &headers)
                        .await;
                    match status {
                        200 => {
                            assert!(clean, "the stream ends cleanly");
                            admitted += 1;
                            streak = 0;
                        }
                        429 => {
                            refused += 1;
                            streak += 1;
                            tokio::time::sleep(Duration::from_millis(25)).await;
                        }
                        other => panic!("status {other}"),
                    }
                }
                (admitted, refused)
            }));
        }
    }
    let (mut admitted, mut refused) = (0, 0);
    for task in tasks {
        let (a, r) = task.await.expect("worker");
        admitted += a;
        refused += r;
    }
    wait_settled(&door.gw, "openai").await;
    let stats = upstream.stats().await;
    for key in KEYS {
        let reported = stats["by_key"][key].as_u64().unwrap_or(0);
        assert!(
            reported <= BUDGET,
            "{key}: the upstream reported {reported} tokens of a {BUDGET} budget ({stats})"
        );
        assert!(reported > BUDGET - RESERVE, "{key}: only {reported} used");
        let probe = door
            .post("/v1/chat/completions", BODY, &[("authorization", key)])
            .await;
        assert_eq!(probe.status, 429, "{key}: {reported} used");
    }
    println!(
        "streams admitted {admitted}, refused {refused}: {}",
        stats["by_key"]
    );
    // Each stream uses 7 + 40 tokens: every key ran its budget down to less than a reservation.
    assert!(refused > 0 && admitted >= 2 * ((BUDGET - RESERVE) / 47));
}

/// A concurrency policy on a check-only route holds its lease through Envoy until the response
/// ends: a second request while a stream runs is refused, and admitted once it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_held_through_envoy_until_the_response_ends() {
    let upstream = LlmUpstream::start();
    let yaml = r#"
ext_proc:
  listen: 127.0.0.1:0
routes:
  - name: one_at_a_time
    policies:
      - name: in_flight
        key: ["header:authorization"]
        concurrency: { limit: 1 }
"#;
    let gw = TestGateway::start(yaml).await;
    let ext_proc = gw.running().ext_proc_addr.expect("the ext_proc listener");
    let door = Door {
        envoy: Envoy::start(&bootstrap(ext_proc, upstream.addr)).await,
        gw,
    };
    let slow = [("x-test-delay-ms", "20"), ("x-test-output-tokens", "10")];
    let response = Client::new()
        .head(door.post_request("/v1/chat/completions", CHAT_STREAM, &slow))
        .await;
    assert_eq!(response.status(), 200);
    let second = door.post("/v1/chat/completions", CHAT, &[]).await;
    assert_eq!(second.status, 429, "{second:?}");
    let mut body = response.into_body();
    while let Some(frame) = body.frame().await {
        frame.expect("the stream ends cleanly");
    }
    let in_flight = [("route", "one_at_a_time")];
    let deadline = Instant::now() + Duration::from_secs(10);
    while door
        .gw
        .metric("turnstile_in_flight_requests", &in_flight)
        .await
        != 0.0
    {
        assert!(Instant::now() < deadline, "the lease was never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let third = door.post("/v1/chat/completions", CHAT, &[]).await;
    assert_eq!(third.status, 200, "{third:?}");
    assert_eq!(upstream.stats().await["requests"], 2);
}

/// `docs/llm.md` shows the bootstrap these tests run, verbatim.
#[test]
fn the_pages_envoy_bootstrap_is_the_shipped_one() {
    let page = std::fs::read_to_string(repo_path("docs/llm.md")).expect("docs/llm.md");
    let shipped =
        std::fs::read_to_string(repo_path("deploy/envoy/llm-ext-proc.yaml")).expect("bootstrap");
    let fenced = format!("\n{}\n```", shipped.trim_end());
    assert!(
        page.contains(&fenced),
        "docs/llm.md does not show the bootstrap"
    );
}

crate::store_matrix!(
    bodies_and_streams_settle_to_their_usage_through_envoy,
    a_client_gone_mid_stream_through_envoy_leaves_nothing_reserved,
);
