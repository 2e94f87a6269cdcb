//! The official `openai` and `anthropic` Python SDKs (PyPI) through the gateway: every format,
//! streamed and not, settles to the usage the SDK itself reports; refusals reach the SDK as
//! 429s with `Retry-After` and the budget's rate-limit fields.

use super::support::llm::{sdk, LlmUpstream};
use super::support::stores::TestStore;
use super::support::TestGateway;
use super::{config, post_lossy, remaining, wait_settled, BUDGET, CHAT, CHAT_STREAM, RESERVE};

/// Runs the SDK script's `formats` against `base` (every format, streamed and not) and checks
/// what the SDKs saw: six calls, the stream whole, and the upstream's reported usage equal to
/// the SDKs'. Returns the script's output and the total tokens of the OpenAI calls and of the
/// Anthropic ones.
pub(super) async fn run_formats(
    base: String,
    upstream: &LlmUpstream,
) -> (serde_json::Value, u64, u64) {
    let out = tokio::task::spawn_blocking(move || sdk("formats", &base))
        .await
        .expect("sdk run");
    let calls = out["usage"].as_array().expect("usage list").clone();
    assert_eq!(calls.len(), 6, "{out}");
    let total = |prefix: &str| -> u64 {
        calls
            .iter()
            .filter(|c| c[0].as_str().is_some_and(|n| n.starts_with(prefix)))
            .map(|c| c[1].as_u64().expect("a count"))
            .sum()
    };
    let (openai, anthropic) = (total("chat") + total("responses"), total("messages"));
    assert_eq!(
        out["chat_stream_words"], 12,
        "the stream reached the SDK whole"
    );
    assert_eq!(upstream.reported().await, openai + anthropic);
    (out, openai, anthropic)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_are_metered_exactly_streamed_and_not() {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&TestStore::memory(), ""), upstream.addr).await;
    let (out, openai, anthropic) = run_formats(gw.url(""), &upstream).await;
    let (refunded, reserved, unreported, tokens) = wait_settled(&gw, "openai").await;
    assert_eq!((reserved, unreported), (0.0, 0.0));
    assert_eq!(tokens, openai as f64, "{out}");
    // Each call reserved at most max_cost (less where its bytes and max_tokens bound it) and
    // was refunded to its usage: the budget holds exactly the usage less the probe's own.
    assert!(refunded >= (4 * RESERVE - openai) as f64 - 2.0 * RESERVE as f64);
    let probe = [("authorization", "Bearer sk-test-1")];
    assert_eq!(
        remaining(&gw, "/v1/chat/completions", CHAT, &probe).await,
        BUDGET - openai - RESERVE
    );
    let (refunded, _, unreported, tokens) = wait_settled(&gw, "anthropic").await;
    assert_eq!((unreported, tokens), (0.0, anthropic as f64), "{out}");
    assert!(refunded > 0.0);
    assert_eq!(
        remaining(
            &gw,
            "/v1/messages",
            r#"{"model":"c","messages":[]}"#,
            &probe
        )
        .await,
        BUDGET - anthropic - RESERVE
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdks_see_a_spent_budget_as_a_429_with_retry_after() {
    let upstream = LlmUpstream::start();
    let gw = TestGateway::with_upstream(&config(&TestStore::memory(), ""), upstream.addr).await;
    // Streams cut before their usage keep their whole reservation: both budgets are spent.
    for _ in 0..BUDGET / RESERVE {
        let (status, _, _) = post_lossy(
            &gw,
            "/v1/chat/completions",
            CHAT_STREAM,
            &[
                ("authorization", "Bearer sk-test-1"),
                ("x-test-mode", "cut"),
            ],
        )
        .await;
        assert_eq!(status, 200);
        let (status, _, _) = post_lossy(
            &gw,
            "/v1/messages",
            r#"{"model":"c","stream":true,"max_tokens":5,"messages":[]}"#,
            &[
                ("authorization", "Bearer sk-test-1"),
                ("x-test-mode", "cut"),
            ],
        )
        .await;
        assert_eq!(status, 200);
    }
    wait_settled(&gw, "openai").await;
    wait_settled(&gw, "anthropic").await;
    let requests = upstream.stats().await["requests"].clone();
    let base = gw.url("");
    let out = tokio::task::spawn_blocking(move || sdk("refused", &base))
        .await
        .expect("sdk run");
    assert_eq!(out["status"], 429, "{out}");
    assert_eq!(out["anthropic_status"], 429, "{out}");
    assert_eq!(out["limit"], BUDGET.to_string());
    assert_eq!(out["remaining"], "0");
    let retry: u64 = out["retry_after"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("Retry-After");
    assert!(retry > 86_400 * 99, "100 tokens at one a day: {retry}");
    assert_eq!(
        upstream.stats().await["requests"],
        requests,
        "refused before the upstream"
    );
}
