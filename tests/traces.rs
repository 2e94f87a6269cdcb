//! OpenTelemetry traces, end to end, against a real OTLP/gRPC receiver (`support::otlp`, on the
//! official opentelemetry-proto definitions): the spans of an admitted and a refused request,
//! their names, parent links and attributes; the incoming W3C trace continued and the upstream
//! told the client span as its parent; ext_authz continuing Envoy's trace; and an unreachable
//! collector costing requests nothing, its failed exports counted.

mod support;

use std::collections::HashMap;

use serde_json::Value;
use support::otlp::OtlpReceiver;
use support::{Client, TestGateway, Upstream, LIVENESS};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

fn config(endpoint: &str, extra: &str) -> String {
    format!(
        r#"
tracing:
  otlp_endpoint: "http://{endpoint}"
  service_name: gw-under-test
{extra}
upstreams:
  up: {{ url: "http://$UPSTREAM" }}
routes:
  - name: api
    match: {{ prefix: /api }}
    upstream: up
    policies:
      - name: per_key
        key: ["header:x-key"]
        token_bucket: {{ rate: 1/h, burst: 1 }}
"#
    )
}

/// The spans of one trace by kind and name (`server GET`), each once in a request's trace.
fn by_name<'a>(spans: &'a [Value], trace_id: &str) -> HashMap<String, &'a Value> {
    let mut named = HashMap::new();
    for span in spans.iter().filter(|s| s["trace_id"] == trace_id) {
        let name = format!(
            "{} {}",
            span["kind"].as_str().unwrap(),
            span["name"].as_str().unwrap()
        );
        assert!(
            named.insert(name.clone(), span).is_none(),
            "{name} twice: {spans:#?}"
        );
    }
    named
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admitted_and_a_refused_request_export_linked_spans_with_their_decisions() {
    let receiver = OtlpReceiver::start();
    let upstream = Upstream::start().await;
    let yaml = config(&receiver.addr.to_string(), "");
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let client = Client::new();
    let admitted = client
        .get_with(
            &gw.url("/api/a"),
            &[
                ("x-key", "k1"),
                ("traceparent", TRACEPARENT),
                ("tracestate", "congo=t61rcWkgMzE"),
            ],
        )
        .await;
    assert_eq!(admitted.status, 200);
    let refused = client.get_with(&gw.url("/api/b"), &[("x-key", "k1")]).await;
    assert_eq!(refused.status, 429);
    // Shutdown flushes the batch processor: every span is exported before it returns.
    gw.shutdown().await;
    let spans = receiver.wait_spans(7).await;
    assert_eq!(
        spans.len(),
        7,
        "4 for the admitted request, 3 for the refused: {spans:#?}"
    );
    assert!(spans.iter().all(|s| s["service"] == "gw-under-test"));

    // The admitted request continues the trace it brought.
    let trace = by_name(&spans, TRACE_ID);
    let mut names: Vec<String> = trace.keys().cloned().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "client GET",
            "internal turnstile.decision",
            "internal turnstile.store",
            "server GET"
        ]
    );
    let server = trace["server GET"];
    let client_span = trace["client GET"];
    assert_eq!(server["name"], "GET");
    assert_eq!(
        server["parent_span_id"], "00f067aa0ba902b7",
        "the incoming span"
    );
    assert_eq!(server["attributes"]["http.request.method"], "GET");
    assert_eq!(server["attributes"]["url.path"], "/api/a");
    assert_eq!(server["attributes"]["turnstile.route"], "api");
    assert_eq!(server["attributes"]["http.response.status_code"], 200);
    let decision = trace["internal turnstile.decision"];
    assert_eq!(decision["kind"], "internal");
    assert_eq!(decision["parent_span_id"], server["span_id"]);
    assert_eq!(decision["attributes"]["turnstile.route"], "api");
    assert_eq!(decision["attributes"]["turnstile.policy"], "per_key");
    assert_eq!(decision["attributes"]["turnstile.decision"], "allowed");
    assert_eq!(decision["attributes"]["turnstile.store"], "memory");
    let store = trace["internal turnstile.store"];
    assert_eq!(store["parent_span_id"], decision["span_id"]);
    assert!(store["start"].as_u64() >= decision["start"].as_u64());
    assert!(store["end"].as_u64() <= decision["end"].as_u64());
    assert_eq!(client_span["name"], "GET");
    assert_eq!(client_span["parent_span_id"], server["span_id"]);
    assert_eq!(client_span["attributes"]["turnstile.upstream"], "up");
    assert_eq!(client_span["attributes"]["http.response.status_code"], 200);
    // The upstream was told the client span as its parent, in the same trace; tracestate as sent.
    let seen = &admitted.json()["headers"];
    let sent_parent = format!(
        "00-{TRACE_ID}-{}-01",
        client_span["span_id"].as_str().unwrap()
    );
    assert_eq!(seen["traceparent"], serde_json::json!([sent_parent]));
    assert_eq!(seen["tracestate"], serde_json::json!(["congo=t61rcWkgMzE"]));

    // The refused request starts a trace of its own: server, decision, store; no upstream call.
    let root = spans
        .iter()
        .find(|s| s["trace_id"] != TRACE_ID && s["kind"] == "server")
        .expect("the refused request's server span");
    assert_eq!(root["parent_span_id"], "", "a root span");
    assert_eq!(root["attributes"]["http.response.status_code"], 429);
    let own = by_name(&spans, root["trace_id"].as_str().unwrap());
    assert_eq!(own.len(), 3, "{own:#?}");
    let decision = own["internal turnstile.decision"];
    assert_eq!(decision["parent_span_id"], root["span_id"]);
    assert_eq!(decision["attributes"]["turnstile.decision"], "limited");
    assert_eq!(decision["attributes"]["turnstile.policy"], "per_key");
    assert_eq!(
        own["internal turnstile.store"]["parent_span_id"],
        decision["span_id"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_authz_continues_the_trace_envoy_sends_in_grpc_metadata() {
    let receiver = OtlpReceiver::start();
    let upstream = Upstream::start().await;
    let extra = "forward_auth: { listen: 127.0.0.1:0, grpc_listen: 127.0.0.1:0 }";
    let gw =
        TestGateway::with_upstream(&config(&receiver.addr.to_string(), extra), upstream.addr).await;
    let grpc = gw.running().ext_authz_addr.expect("ext_authz listener");
    let envoy_span = |trace: &str| format!("00-{trace}-b7ad6b7169203331-01");
    let (first, second) = (
        "0af7651916cd43dd8448eb211c80319c",
        "1af7651916cd43dd8448eb211c80319c",
    );
    let ok = support::ext_authz::check_with_metadata(
        grpc,
        "/api/e",
        &[("x-key", "e1")],
        &[("traceparent", &envoy_span(first))],
    )
    .await;
    assert_eq!(ok.status.map(|s| s.code), Some(0));
    // Without metadata, the original request's traceparent (its headers) is continued.
    let original = format!("00-{second}-00f067aa0ba902b7-01");
    let denied = support::ext_authz::check(
        grpc,
        "/api/e",
        &[("x-key", "e1"), ("traceparent", &original)],
    )
    .await;
    assert_eq!(denied.status.map(|s| s.code), Some(8), "RESOURCE_EXHAUSTED");
    gw.shutdown().await;
    let spans = receiver.wait_spans(6).await;
    assert_eq!(spans.len(), 6, "{spans:#?}");
    for (trace_id, parent, decision, status) in [
        (first, "b7ad6b7169203331", "allowed", 200),
        (second, "00f067aa0ba902b7", "limited", 429),
    ] {
        let own = by_name(&spans, trace_id);
        let server = own["server envoy.service.auth.v3.Authorization/Check"];
        assert_eq!(server["parent_span_id"], parent);
        assert_eq!(server["attributes"]["rpc.method"], "Check");
        assert_eq!(server["attributes"]["http.response.status_code"], status);
        let span = own["internal turnstile.decision"];
        assert_eq!(span["parent_span_id"], server["span_id"]);
        assert_eq!(span["attributes"]["turnstile.decision"], decision);
        assert_eq!(span["attributes"]["turnstile.route"], "api");
        assert_eq!(
            own["internal turnstile.store"]["parent_span_id"],
            span["span_id"]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_fails_no_request_and_its_lost_spans_are_counted() {
    let nowhere = support::upstream::unreachable_addr().await;
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&config(&nowhere.to_string(), ""), upstream.addr).await;
    let client = Client::new();
    const REQUESTS: usize = 10;
    for i in 0..REQUESTS {
        let key = format!("k{i}");
        let reply = client.get_with(&gw.url("/api/a"), &[("x-key", &key)]).await;
        assert_eq!(reply.status, 200, "request {i}");
    }
    // Server, decision, store and upstream client: four spans a request, every one lost, counted
    // when the batch processor's export (every 5 s) fails.
    let name = "turnstile_trace_export_failed_spans_total";
    let deadline = std::time::Instant::now() + LIVENESS;
    loop {
        let failed = gw.metric(name, &[]).await;
        if failed >= (4 * REQUESTS) as f64 {
            assert_eq!(failed, (4 * REQUESTS) as f64);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{name} is {failed}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envoy_service_continues_the_trace_in_its_calls_metadata() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let receiver = OtlpReceiver::start();
    let yaml = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\ntracing: {{ otlp_endpoint: \"http://{}\" }}\n\
         rls: {{ listen: 127.0.0.1:0, config: ./rls }}\nroutes: []\n",
        receiver.addr
    );
    let rls_config = "domain: shop\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n";
    let gw = TestGateway::with_files(&yaml, &[("rls/shop.yaml", rls_config)]).await;
    let rls = gw.rls.expect("rls listener");
    let mut client = RateLimitServiceClient::connect(format!("http://{rls}"))
        .await
        .expect("connect");
    let traces = [
        "2af7651916cd43dd8448eb211c80319c",
        "3af7651916cd43dd8448eb211c80319c",
    ];
    for trace in traces {
        let descriptors = vec![support::rls::descriptor(&[("user", "u")])];
        let mut request = tonic::Request::new(support::rls::request("shop", descriptors));
        let parent = format!("00-{trace}-b7ad6b7169203331-01");
        request
            .metadata_mut()
            .insert("traceparent", parent.parse().unwrap());
        client
            .should_rate_limit(request)
            .await
            .expect("ShouldRateLimit");
    }
    gw.shutdown().await;
    let spans = receiver.wait_spans(6).await;
    assert_eq!(spans.len(), 6, "{spans:#?}");
    for (trace_id, decision, status) in [(traces[0], "allowed", 200), (traces[1], "limited", 429)] {
        let own = by_name(&spans, trace_id);
        let server = own["server envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"];
        assert_eq!(server["parent_span_id"], "b7ad6b7169203331");
        assert_eq!(server["attributes"]["http.response.status_code"], status);
        let span = own["internal turnstile.decision"];
        assert_eq!(span["parent_span_id"], server["span_id"]);
        assert_eq!(span["attributes"]["turnstile.route"], "shop");
        assert_eq!(span["attributes"]["turnstile.decision"], decision);
        assert_eq!(
            own["internal turnstile.store"]["parent_span_id"],
            span["span_id"]
        );
    }
}

/// A delayed request's decision span says so: `turnstile.decision` is `delayed` and
/// `turnstile.delay_ms` its wait for the slot; an admission without a wait carries no delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_request_names_its_wait_on_the_decision_span() {
    let receiver = OtlpReceiver::start();
    let upstream = Upstream::start().await;
    let yaml = config(&receiver.addr.to_string(), "").replace(
        "token_bucket: { rate: 1/h, burst: 1 }",
        "token_bucket: { rate: 4/s, burst: 1 }\n        on_limit: delay\n        max_delay: 1s",
    );
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let client = Client::new();
    for _ in 0..2 {
        let reply = client.get_with(&gw.url("/api/a"), &[("x-key", "k")]).await;
        assert_eq!(reply.status, 200);
    }
    gw.shutdown().await;
    let spans = receiver.wait_spans(8).await;
    let mut decisions: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == "turnstile.decision")
        .collect();
    decisions.sort_by_key(|s| s["start"].as_u64());
    assert_eq!(decisions.len(), 2, "{spans:#?}");
    let (first, second) = (&decisions[0]["attributes"], &decisions[1]["attributes"]);
    assert_eq!(first["turnstile.decision"], "allowed");
    assert_eq!(first["turnstile.delay_ms"], Value::Null);
    assert_eq!(second["turnstile.decision"], "delayed");
    let delay = second["turnstile.delay_ms"].as_f64().expect("a double");
    assert!(delay > 0.0 && delay <= 250.0, "{second}");
}
