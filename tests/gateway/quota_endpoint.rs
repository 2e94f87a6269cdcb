//! A route's quota endpoint (issue 42): a client reads its own state of the route's policies,
//! keyed from its own request, consuming nothing; asking is limited by its own bucket.

use crate::support::stores::TestStore;
use crate::support::{Client, TestGateway};

const CONFIG: &str = r#"
routes:
  - name: users
    match: { path: "/api/users/{user_id}" }
    respond: { body: user }
    quota_endpoint: "/quota/users/{user_id}"
    policies:
      - { name: per_user, key: ["path:user_id"], sliding_window: { limit: 5, window: 1m } }
      - { name: per_ip, key: [client_ip], sliding_window: { limit: 100, window: 1h } }
      - { name: per_key, key: ["header:x-api-key"], quota: { limit: 1000, per: day } }
"#;

async fn a_client_reads_its_own_remaining_quota_without_consuming_it(store: TestStore) {
    let gw = TestGateway::start(&store.config(CONFIG)).await;
    let c = Client::new();
    for _ in 0..3 {
        assert_eq!(c.get(&gw.url("/api/users/7")).await.status, 200);
    }
    for _ in 0..4 {
        let reply = c.get(&gw.url("/quota/users/7")).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.header("cache-control"), Some("no-store"));
        let body = reply.json();
        assert_eq!(body["route"], "users");
        let policies = body["policies"].as_array().expect("policies");
        let user = &policies[0];
        assert_eq!(user["policy"], "per_user");
        assert_eq!(
            (user["limit"].as_u64(), user["remaining"].as_u64()),
            (Some(5), Some(2))
        );
        assert_eq!(user["reset_seconds"], 60);
        assert_eq!(policies[1]["remaining"], 97);
        // No x-api-key: that policy does not apply to this client.
        assert_eq!(policies[2]["applies"], false);
        // The IETF fields: every enforced policy that applies, and the one with the least left.
        assert_eq!(
            reply.header("ratelimit-policy"),
            Some("\"per_user\";q=5;w=60, \"per_ip\";q=100;w=3600")
        );
        assert_eq!(reply.header("ratelimit"), Some("\"per_user\";r=2;t=60"));
    }
    // The asks consumed nothing: two requests left for user 7.
    let next = c.get(&gw.url("/api/users/7")).await;
    assert_eq!(next.header_u64("x-ratelimit-remaining"), 1);
    // Another user's counter is another key: the ask of /quota/users/8 reads user 8's.
    let other = c.get(&gw.url("/quota/users/8")).await.json();
    assert_eq!(other["policies"][0]["remaining"], 5);
    // The client's own header names its own counter.
    let keyed = c
        .get_with(&gw.url("/quota/users/7"), &[("x-api-key", "k1")])
        .await
        .json();
    assert_eq!(keyed["policies"][2]["remaining"], 1000);
    assert_eq!(keyed["policies"][2]["algorithm"], "quota");
    // A repeated key header is as ambiguous as on the route itself.
    let twice = c
        .get_with(
            &gw.url("/quota/users/7"),
            &[("x-api-key", "a"), ("x-api-key", "b")],
        )
        .await;
    assert_eq!(twice.status, 400);
    // Only the route's own requests were decided: 3, and the one after the asks.
    let decided = |decision| {
        [
            ("route", "users"),
            ("policy", "per_user"),
            ("decision", decision),
        ]
    };
    assert_eq!(
        gw.metric("turnstile_decisions_total", &decided("allowed"))
            .await,
        4.0
    );
}

async fn asking_is_limited_by_its_own_bucket_per_client(store: TestStore) {
    let gw = TestGateway::start(&store.config(CONFIG)).await;
    let c = Client::new();
    let mut statuses = Vec::new();
    for _ in 0..12 {
        statuses.push(c.get(&gw.url("/quota/users/7")).await.status);
    }
    // A burst of 10, refilling one a second: the 11th and 12th asks in this second wait.
    assert_eq!(statuses[..10], [200; 10]);
    assert_eq!(statuses[10..], [429, 429]);
    let refused = c.get(&gw.url("/quota/users/7")).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.json()["policy"], "quota_endpoint");
    assert!(refused.header_u64("retry-after") >= 1);
    let ask = |decision| {
        [
            ("route", "users"),
            ("policy", "quota_endpoint"),
            ("decision", decision),
        ]
    };
    assert_eq!(
        gw.metric("turnstile_decisions_total", &ask("allowed"))
            .await,
        10.0
    );
    assert_eq!(
        gw.metric("turnstile_decisions_total", &ask("limited"))
            .await,
        3.0
    );
    // The route's own policies were never decided, let alone consumed.
    let user = [
        ("route", "users"),
        ("policy", "per_user"),
        ("decision", "allowed"),
    ];
    assert_eq!(gw.metric("turnstile_decisions_total", &user).await, 0.0);
    assert_eq!(
        c.get(&gw.url("/api/users/7"))
            .await
            .header_u64("x-ratelimit-remaining"),
        4
    );
}

crate::store_matrix!(
    a_client_reads_its_own_remaining_quota_without_consuming_it,
    asking_is_limited_by_its_own_bucket_per_client,
);

#[tokio::test]
async fn a_quota_endpoint_must_capture_what_the_route_captures() {
    let bad = CONFIG.replace("/quota/users/{user_id}", "/quota/{id}");
    let err = TestGateway::try_launch(&bad, None, &[])
        .await
        .expect_err("must not load");
    assert!(err.contains(":6:"), "{err}");
    assert!(err.contains("routes[0].quota_endpoint"), "{err}");
    assert!(
        err.contains("({id})") && err.contains("({user_id})"),
        "{err}"
    );
    let taken = CONFIG.replace("name: per_ip", "name: quota_endpoint");
    let err = TestGateway::try_launch(&taken, None, &[])
        .await
        .expect_err("must not load");
    assert!(err.contains("routes[0].quota_endpoint"), "{err}");
}
