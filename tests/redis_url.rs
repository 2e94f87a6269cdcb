//! How the gateway reaches Redis: `rediss://` with a private CA, a password in the URL, the
//! `TURNSTILE_REDIS_URL` override, and what a wrong password does (not ready, failure mode).

mod support;

use std::time::{Duration, Instant};

use support::process::{config_file, with_free_ports};
use support::redis::RedisOptions;
use support::{Client, GatewayProcess, RedisServer};

const READY: Duration = Duration::from_secs(20);

/// A closed route with a bucket of 2 on `url`.
fn config(url: &str) -> String {
    format!(
        "store:\n  type: redis\n  url: {url}\n  timeout: 1s\n  failure_mode: closed\n\
         routes:\n  - name: r\n    match: {{ path: /r }}\n    respond: {{ status: 200, body: \"ok\\n\" }}\n    \
         policies:\n      - name: p\n        key: [method]\n        token_bucket: {{ rate: 1/d, burst: 2 }}\n"
    )
}

async fn spawn(yaml: &str, env: &[(&str, &str)]) -> GatewayProcess {
    let (dir, path) = config_file(&with_free_ports(yaml));
    GatewayProcess::spawn_at(dir, path, env).await
}

async fn wait_status(gw: &GatewayProcess, path: &str, want: u16, limit: Duration) {
    let client = Client::new();
    let deadline = Instant::now() + limit;
    loop {
        let status = client.get(&gw.admin_url(path)).await.status;
        if status == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{path} never answered {want} (last {status}); log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two admitted, then limited: the decisions really ran in Redis.
async fn assert_limits(gw: &GatewayProcess, redis: &RedisServer) {
    let client = Client::new();
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(client.get(&gw.url("/r")).await.status);
    }
    assert_eq!(statuses, [200, 200, 429], "log:\n{}", gw.log());
    let keys = redis.keys();
    assert_eq!(keys, ["turnstile:{r:p:GET}:tb"]);
}

#[tokio::test]
async fn rediss_with_a_password() {
    let redis = RedisServer::start_with(RedisOptions {
        tls: true,
        password: Some("s3cret".to_string()),
        ..RedisOptions::default()
    });
    assert!(redis.url().starts_with("rediss://:s3cret@"));
    let ca = redis.ca_file();
    let gw = spawn(
        &config(&redis.url()),
        &[("SSL_CERT_FILE", ca.to_str().expect("utf-8 path"))],
    )
    .await;
    wait_status(&gw, "/readyz", 200, READY).await;
    assert_limits(&gw, &redis).await;
    assert!(!gw.log().contains("s3cret"), "the password reached the log");
}

#[tokio::test]
async fn a_wrong_password_is_not_ready_and_fails_closed() {
    let redis = RedisServer::start_with(RedisOptions {
        tls: false,
        password: Some("c0rrect-h0rse".to_string()),
        ..RedisOptions::default()
    });
    let url = format!("redis://:wr0ng-h0rse@127.0.0.1:{}", redis.port);
    let gw = spawn(&config(&url), &[]).await;
    // Give it time to try, then it must still say not ready, and the closed route answers 503.
    tokio::time::sleep(Duration::from_secs(2)).await;
    wait_status(&gw, "/readyz", 503, Duration::from_secs(1)).await;
    let reply = Client::new().get(&gw.url("/r")).await;
    assert_eq!(reply.status, 503, "{reply:?}");
    assert!(redis.keys().is_empty());
    // The reason is logged, once, however often fred retries.
    let log = gw.log();
    assert_eq!(
        log.matches("redis connection failed").count(),
        1,
        "log:\n{log}"
    );
    assert!(log.contains("WRONGPASS"), "log:\n{log}");
    assert!(!log.contains("h0rse"), "a password reached the log");
}

#[tokio::test]
async fn the_environment_overrides_store_url() {
    let redis = RedisServer::start();
    // The file points at a port nothing listens on; the environment at the real server.
    let gw = spawn(
        &config("redis://127.0.0.1:1"),
        &[("TURNSTILE_REDIS_URL", &redis.url())],
    )
    .await;
    wait_status(&gw, "/readyz", 200, READY).await;
    assert_limits(&gw, &redis).await;
}
