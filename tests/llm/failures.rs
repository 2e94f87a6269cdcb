//! What goes wrong (`docs/llm.md`, "When usage is missing"): each case settles to its documented
//! charge, and nothing stays reserved (`turnstile_cost_reserved_units` back to 0), on both stores.

use http::Method;
use http_body_util::BodyExt;

use super::support::client::{full, request};
use super::support::llm::LlmUpstream;
use super::support::stores::TestStore;
use super::support::{upstream, Client, TestGateway};
use super::{
    config, post, post_lossy, remaining, wait_settled, BUDGET, CHAT, CHAT_STREAM, RESERVE,
};

/// A case: the request's headers, then the units it must be charged in all.
async fn case(
    store: TestStore,
    body: &str,
    headers: &[(&str, &str)],
    charged: u64,
) -> (u16, Vec<u8>, bool) {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&store, ""), upstream.addr).await;
    let got = post_lossy(&gw, "/v1/chat/completions", body, headers).await;
    let (refunded, reserved, unreported, _) = wait_settled(&gw, "openai").await;
    assert_eq!(reserved, 0.0);
    assert_eq!(refunded, (RESERVE - charged) as f64, "charged {charged}");
    assert_eq!(unreported, 1.0);
    assert_eq!(
        remaining(&gw, "/v1/chat/completions", CHAT, &[]).await,
        BUDGET - charged - RESERVE,
        "the counter holds exactly the charge"
    );
    got
}

/// Cut off before the usage chunk: charged the fallback, the whole reservation.
async fn a_stream_cut_before_its_usage_is_charged_the_reservation(store: TestStore) {
    let (status, body, clean) = case(
        store,
        CHAT_STREAM,
        &[("x-test-mode", "cut"), ("x-test-delay-ms", "10")],
        RESERVE,
    )
    .await;
    assert_eq!(status, 200);
    assert!(!clean, "the client sees the stream break");
    // Events a few milliseconds apart reach the client as they come (what hyper had not yet
    // written when the upstream broke may be lost with the connection).
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("\"w0 \""),
        "the first words arrived: {text:?}"
    );
}

/// A stream the client asked no usage for reports none: the reservation stays charged.
async fn a_stream_without_include_usage_is_charged_the_reservation(store: TestStore) {
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}"#;
    let (status, _, clean) = case(store, body, &[], RESERVE).await;
    assert_eq!((status, clean), (200, true));
}

/// An upstream error (500, no usage in its body) is charged `min_cost`, 1: providers bill no
/// tokens for a request they failed.
async fn an_upstream_error_is_charged_min_cost(store: TestStore) {
    let (status, body, _) = case(store, CHAT, &[("x-test-mode", "error")], 1).await;
    assert_eq!(status, 500);
    assert!(String::from_utf8_lossy(&body).contains("server_error"));
}

/// A 200 whose JSON is malformed reports nothing: charged the reservation.
async fn a_malformed_body_is_charged_the_reservation(store: TestStore) {
    let (status, _, _) = case(store, CHAT, &[("x-test-mode", "malformed")], RESERVE).await;
    assert_eq!(status, 200);
}

/// A body larger than `max_body` (1MiB) reaches the client whole, but is not read for its usage.
async fn a_huge_body_passes_whole_and_is_charged_the_reservation(store: TestStore) {
    let pad = (2 << 20).to_string();
    let (status, body, clean) = case(store, CHAT, &[("x-test-pad", &pad)], RESERVE).await;
    assert_eq!((status, clean), (200, true));
    let json: serde_json::Value = serde_json::from_slice(&body).expect("the body, unchanged");
    assert_eq!(json["usage"]["completion_tokens"], 20);
    assert!(body.len() > 2 << 20);
}

/// An absurd usage (a trillion output tokens) is clamped to `max_cost`: the reservation, no more.
async fn an_absurd_usage_is_clamped_to_the_reservation(store: TestStore) {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&store, ""), upstream.addr).await;
    let reply = post(
        &gw,
        "/v1/chat/completions",
        CHAT,
        &[("x-test-report-output", "1000000000000")],
    )
    .await;
    assert_eq!(reply.status, 200);
    let (refunded, reserved, unreported, tokens) = wait_settled(&gw, "openai").await;
    assert_eq!((refunded, reserved, unreported), (0.0, 0.0, 0.0));
    assert_eq!(
        tokens, 1_000_000_000_006.0,
        "the tokens reported are counted as reported"
    );
    assert_eq!(
        remaining(&gw, "/v1/chat/completions", CHAT, &[]).await,
        BUDGET - 2 * RESERVE
    );
}

/// The client goes away mid-stream: the body is dropped before its usage, charged the
/// reservation, and nothing stays reserved.
async fn a_client_that_disconnects_mid_stream_is_charged_the_reservation(store: TestStore) {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&store, ""), upstream.addr).await;
    let req = request(Method::POST, &gw.url("/v1/chat/completions"))
        .header("authorization", "Bearer sk-1")
        .header("x-test-delay-ms", "50")
        .header("x-test-output-tokens", "100")
        .body(full(CHAT_STREAM.to_string()))
        .expect("request");
    let response = Client::new().head(req).await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = body.frame().await.expect("a first event").expect("data");
    assert!(first.data_ref().is_some());
    drop(body);
    let (refunded, reserved, unreported, _) = wait_settled(&gw, "openai").await;
    assert_eq!((refunded, reserved, unreported), (0.0, 0.0, 1.0));
    assert_eq!(
        remaining(&gw, "/v1/chat/completions", CHAT, &[]).await,
        BUDGET - 2 * RESERVE
    );
}

/// No upstream answers (502): no response, so no usage; charged the reservation.
async fn an_unreachable_upstream_is_charged_the_reservation(store: TestStore) {
    let addr = upstream::unreachable_addr().await;
    let gw = TestGateway::with_upstream(&config(&store, ""), addr).await;
    let reply = post(&gw, "/v1/chat/completions", CHAT, &[]).await;
    assert_eq!(reply.status, 502);
    let (refunded, reserved, unreported, _) = wait_settled(&gw, "openai").await;
    assert_eq!((refunded, reserved, unreported), (0.0, 0.0, 1.0));
}

/// Over budget, a stream is refused before the upstream is called, with `Retry-After` and the
/// rate-limit fields in the budget's units.
async fn an_exhausted_budget_refuses_before_the_upstream(store: TestStore) {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&store, ""), upstream.addr).await;
    // Ten cut streams keep their reservations: the budget is spent.
    for _ in 0..BUDGET / RESERVE {
        let (status, _, _) = post_lossy(
            &gw,
            "/v1/chat/completions",
            CHAT_STREAM,
            &[("x-test-mode", "cut")],
        )
        .await;
        assert_eq!(status, 200);
    }
    wait_settled(&gw, "openai").await;
    let refused = post(&gw, "/v1/chat/completions", CHAT_STREAM, &[]).await;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.header_u64("x-ratelimit-limit"), BUDGET);
    assert_eq!(refused.header_u64("x-ratelimit-remaining"), 0);
    // 100 tokens at one a day.
    assert!(refused.header_u64("retry-after") > 86_400 * 99);
    assert_eq!(
        upstream.stats().await["requests"],
        10,
        "the upstream never saw it"
    );
}

crate::store_matrix!(
    a_stream_cut_before_its_usage_is_charged_the_reservation,
    a_stream_without_include_usage_is_charged_the_reservation,
    an_upstream_error_is_charged_min_cost,
    a_malformed_body_is_charged_the_reservation,
    a_huge_body_passes_whole_and_is_charged_the_reservation,
    an_absurd_usage_is_clamped_to_the_reservation,
    a_client_that_disconnects_mid_stream_is_charged_the_reservation,
    an_unreachable_upstream_is_charged_the_reservation,
    an_exhausted_budget_refuses_before_the_upstream,
);
