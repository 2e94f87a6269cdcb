//! LLM token budgets (issue 36, `docs/llm.md`): usage read from JSON bodies and event streams,
//! reservations settled exactly, every failure settled conservatively with nothing left reserved,
//! the official Python SDKs through the gateway, and two instances on one Redis never spending
//! more than the budget.
//!
//! The upstream is `tests/llm/upstream.py`, an OpenAI- and Anthropic-compatible server written
//! from the providers' API references ([`support::llm`]).

#[path = "../support/mod.rs"]
mod support;

mod body;
mod budgets;
mod envoy;
mod failures;
mod fleet;
mod sdk;

use std::time::{Duration, Instant};

use http::Method;
use support::client::{full, request};
use support::stores::TestStore;
use support::{Client, Reply, TestGateway, LIVENESS};

/// The budget of every test: 1000 tokens per API key, refilled by one a day (never in a test).
const BUDGET: u64 = 1000;
/// What admission reserves (`max_cost`).
const RESERVE: u64 = 100;

/// Two routes on `upstream`: Anthropic Messages and every other `/v1/` path as OpenAI, each a
/// reserving token budget per `Authorization` (which the Python SDKs both send).
fn config(store: &TestStore, extra: &str) -> String {
    store.config(&format!(
        r#"
upstreams:
  llm: {{ url: "http://$UPSTREAM" }}
routes:
  - name: anthropic
    match: {{ prefix: /v1/messages }}
    upstream: llm
    policies:
      - name: tokens
        key: ["header:authorization"]
        token_bucket: {{ rate: 1/d, burst: {BUDGET} }}
        cost: {{ usage: anthropic, reserve: true, max_cost: {RESERVE}{extra} }}
  - name: openai
    match: {{ prefix: /v1/ }}
    upstream: llm
    policies:
      - name: tokens
        key: ["header:authorization"]
        token_bucket: {{ rate: 1/d, burst: {BUDGET} }}
        cost: {{ usage: openai, reserve: true, max_cost: {RESERVE}{extra} }}
"#
    ))
}

/// A POST of `body` (JSON) to `url` with `headers` (`Authorization: Bearer sk-1` unless given).
fn post_request_to(
    url: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> http::Request<support::client::ReqBody> {
    let mut builder = request(Method::POST, url).header("content-type", "application/json");
    if !headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("authorization"))
    {
        builder = builder.header("authorization", "Bearer sk-1");
    }
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(full(body.to_string())).expect("request")
}

/// POSTs `body` (JSON) to `url` with `headers`, and reads the whole response.
async fn post_to(url: &str, body: &str, headers: &[(&str, &str)]) -> Reply {
    Client::new()
        .send(post_request_to(url, body, headers))
        .await
}

/// POSTs `body` (JSON) to `path` on the gateway with `headers`, and reads the whole response.
async fn post(gw: &TestGateway, path: &str, body: &str, headers: &[(&str, &str)]) -> Reply {
    post_to(&gw.url(path), body, headers).await
}

/// POSTs to `url` and reads what arrives: (status, body bytes, whether the body ended cleanly).
async fn post_lossy_to(url: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Vec<u8>, bool) {
    use http_body_util::BodyExt;
    let response = Client::new()
        .head(post_request_to(url, body, headers))
        .await;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    loop {
        match body.frame().await {
            Some(Ok(frame)) => bytes.extend_from_slice(frame.data_ref().map_or(&[][..], |d| d)),
            Some(Err(_)) => return (status, bytes, false),
            None => return (status, bytes, true),
        }
    }
}

/// [`post_lossy_to`] the gateway's `path`.
async fn post_lossy(
    gw: &TestGateway,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<u8>, bool) {
    post_lossy_to(&gw.url(path), body, headers).await
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"one two three"}]}"#;
const CHAT_STREAM: &str = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"one two three"}]}"#;

/// What one route's policy `tokens` settled: (units refunded, reserved now, responses without
/// usage, tokens reported in all kinds).
async fn settled(gw: &TestGateway, route: &str) -> (f64, f64, f64, f64) {
    let text = gw.metrics().await;
    let labels = [("route", route), ("policy", "tokens")];
    let get = |name: &str| support::metric(&text, name, &labels).unwrap_or(0.0);
    let tokens: f64 = ["input", "cached_input", "output", "reasoning"]
        .iter()
        .map(|kind| {
            support::metric(
                &text,
                "turnstile_tokens_total",
                &[("route", route), ("policy", "tokens"), ("kind", kind)],
            )
            .unwrap_or(0.0)
        })
        .sum();
    (
        get("turnstile_cost_refunded_total"),
        get("turnstile_cost_reserved_units"),
        get("turnstile_usage_unreported_total"),
        tokens,
    )
}

/// Waits until every admitted request of `route` is settled: the reserved gauge, raised at
/// admission, falls back to 0 once each refund has landed in the store. Returns [`settled`].
async fn wait_settled(gw: &TestGateway, route: &str) -> (f64, f64, f64, f64) {
    let deadline = Instant::now() + LIVENESS;
    loop {
        let text = gw.metrics().await;
        let reserved = support::metric(
            &text,
            "turnstile_cost_reserved_units",
            &[("route", route), ("policy", "tokens")],
        );
        if reserved == Some(0.0) {
            return settled(gw, route).await;
        }
        assert!(
            Instant::now() < deadline,
            "{route} not settled: {reserved:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The `x-ratelimit-remaining` a request with `headers` is admitted with now (it reserves too).
async fn remaining(gw: &TestGateway, path: &str, body: &str, headers: &[(&str, &str)]) -> u64 {
    let reply = post(gw, path, body, headers).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    reply.header_u64("x-ratelimit-remaining")
}

/// input + output of a chat completion body.
fn chat_total(reply: &Reply) -> u64 {
    let usage = &reply.json()["usage"];
    usage["prompt_tokens"].as_u64().expect("prompt_tokens")
        + usage["completion_tokens"]
            .as_u64()
            .expect("completion_tokens")
}

/// A JSON body's usage is what the reservation settles to: the next admission finds the budget
/// less exactly that usage (and its own reservation), on both stores.
async fn a_json_body_settles_to_its_usage(store: TestStore) {
    let upstream = support::llm::LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&store, ""), upstream.addr).await;
    let reply = post(&gw, "/v1/chat/completions", CHAT, &[]).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header_u64("x-ratelimit-remaining"), BUDGET - RESERVE);
    let used = chat_total(&reply);
    assert_eq!(used, 6 + 20, "3 words + 3 for the message, 20 generated");
    let (refunded, reserved, unreported, tokens) = wait_settled(&gw, "openai").await;
    assert_eq!(
        (refunded, reserved, unreported),
        ((RESERVE - used) as f64, 0.0, 0.0)
    );
    assert_eq!(tokens, used as f64);
    assert_eq!(
        remaining(&gw, "/v1/chat/completions", CHAT, &[]).await,
        BUDGET - used - RESERVE
    );
    assert_eq!(upstream.reported().await, 2 * used);
}

/// Each provider's stream settles from its final events (OpenAI's usage chunk, Responses'
/// `response.completed`, Anthropic's `message_start` + `message_delta`), and reaches the client
/// byte for byte.
async fn streams_settle_from_their_final_events(store: TestStore) {
    let upstream = support::llm::LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&store, ""), upstream.addr).await;
    let chat = post(&gw, "/v1/chat/completions", CHAT_STREAM, &[]).await;
    assert_eq!(chat.status, 200);
    assert!(chat.text().ends_with("data: [DONE]\n\n"), "{}", chat.text());
    let responses = post(
        &gw,
        "/v1/responses",
        r#"{"model":"m","stream":true,"input":"one two three","max_output_tokens":7}"#,
        &[],
    )
    .await;
    assert!(responses.text().contains("event: response.completed"));
    let (_, _, unreported, tokens) = wait_settled(&gw, "openai").await;
    // Chat: 6 in + 20 out; Responses: 6 in + 7 out (max_output_tokens).
    assert_eq!((unreported, tokens), (0.0, 39.0));
    assert_eq!(
        remaining(&gw, "/v1/chat/completions", CHAT, &[]).await,
        BUDGET - 39 - RESERVE
    );
    let messages = post(
        &gw,
        "/v1/messages",
        r#"{"model":"c","stream":true,"max_tokens":9,"messages":[{"role":"user","content":"one two three"}]}"#,
        &[("x-api-key", "sk-a"), ("x-test-cached", "2")],
    )
    .await;
    assert!(messages.text().contains("event: message_stop"));
    let (refunded, _, unreported, tokens) = wait_settled(&gw, "anthropic").await;
    // 4 input not cached + 2 cache reads + 9 output; its 97 bytes + 9 are more than max_cost,
    // which it reserved.
    assert_eq!((unreported, tokens, refunded), (0.0, 15.0, 85.0));
    // This one reserves its 42 bytes and max_tokens 1.
    let small = r#"{"model":"c","max_tokens":1,"messages":[]}"#;
    let again = post(&gw, "/v1/messages", small, &[("x-api-key", "sk-a")]).await;
    assert_eq!(
        again.header_u64("x-ratelimit-remaining"),
        BUDGET - 15 - (small.len() as u64 + 1)
    );
}

crate::store_matrix!(
    a_json_body_settles_to_its_usage,
    streams_settle_from_their_final_events
);
