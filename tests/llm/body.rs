//! The JSON request body before admission: `body:` key parts (a budget per model), the
//! reservation its `max_tokens` and bytes bound, and the body forwarded unchanged whatever was
//! read; a body too large or not JSON leaves the part absent.

use super::support::llm::LlmUpstream;
use super::support::stores::TestStore;
use super::support::TestGateway;
use super::{config, post, wait_settled, BUDGET, RESERVE};

/// Per API key and model, with JSON bodies read up to 256 bytes.
fn per_model(store: &TestStore) -> String {
    store.config(&format!(
        r#"
server: {{ json_body_limit: 256 }}
upstreams:
  llm: {{ url: "http://$UPSTREAM" }}
routes:
  - name: openai
    upstream: llm
    policies:
      - name: tokens
        key: ["header:authorization", "body:model"]
        token_bucket: {{ rate: 1/d, burst: {BUDGET} }}
        cost: {{ usage: openai, reserve: true, max_cost: {RESERVE} }}
"#
    ))
}

fn chat(model: &str, pad: usize) -> String {
    format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"one two three{}"}}]}}"#,
        " ".repeat(pad)
    )
}

/// Each model has its own budget; the upstream gets the very bytes the client sent.
async fn each_model_in_the_body_has_its_own_budget(store: TestStore) {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&per_model(&store), upstream.addr).await;
    let a = chat("model-a", 0);
    let first = post(&gw, "/v1/chat/completions", &a, &[]).await;
    assert_eq!(first.header_u64("x-ratelimit-remaining"), BUDGET - RESERVE);
    assert_eq!(
        upstream.stats().await["last_body"],
        a,
        "forwarded unchanged"
    );
    wait_settled(&gw, "openai").await;
    let b = chat("model-b", 0);
    let other = post(&gw, "/v1/chat/completions", &b, &[]).await;
    assert_eq!(
        other.header_u64("x-ratelimit-remaining"),
        BUDGET - RESERVE,
        "model-b's budget is untouched"
    );
    wait_settled(&gw, "openai").await;
    let again = post(&gw, "/v1/chat/completions", &a, &[]).await;
    // model-a: 26 used, then this one's reservation.
    assert_eq!(
        again.header_u64("x-ratelimit-remaining"),
        BUDGET - 26 - RESERVE
    );
}

/// Past `json_body_limit`, or not JSON, the body is not read: `body:model` is absent, so the
/// policy does not apply (as a missing header), and the body still reaches the upstream whole.
async fn a_body_too_large_or_not_json_leaves_the_part_absent(store: TestStore) {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&per_model(&store), upstream.addr).await;
    let big = chat("model-a", 400);
    assert!(big.len() > 256);
    let reply = post(&gw, "/v1/chat/completions", &big, &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-ratelimit-remaining"),
        None,
        "no policy applied"
    );
    assert_eq!(upstream.stats().await["last_body"], big, "forwarded whole");
    let not_json = "model=model-a";
    let reply = post(&gw, "/v1/chat/completions", not_json, &[]).await;
    assert_eq!(
        reply.status, 400,
        "the upstream refuses it; the gateway let it pass"
    );
    assert_eq!(reply.header("x-ratelimit-remaining"), None);
    assert_eq!(upstream.stats().await["last_body"], not_json);
}

/// A reservation is what the request can cost at most: its bytes plus its `max_tokens`, when
/// that is less than `max_cost`; settled to the usage all the same.
async fn a_reservation_is_bounded_by_the_body(store: TestStore) {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&store, ""), upstream.addr).await;
    let body = r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
    let bound = body.len() as u64 + 5;
    assert!(bound < RESERVE);
    let reply = post(&gw, "/v1/chat/completions", body, &[]).await;
    assert_eq!(reply.header_u64("x-ratelimit-remaining"), BUDGET - bound);
    // 1 word + 3, 5 generated (max_tokens).
    let (refunded, _, _, tokens) = wait_settled(&gw, "openai").await;
    assert_eq!((tokens, refunded), (9.0, (bound - 9) as f64));
    let next = post(&gw, "/v1/chat/completions", body, &[]).await;
    assert_eq!(next.header_u64("x-ratelimit-remaining"), BUDGET - 9 - bound);
}

crate::store_matrix!(
    each_model_in_the_body_has_its_own_budget,
    a_body_too_large_or_not_json_leaves_the_part_absent,
    a_reservation_is_bounded_by_the_body,
);
