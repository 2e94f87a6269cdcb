//! The process: reload, graceful shutdown, `turnstile check`.

use crate::support::{Client, GatewayProcess};

#[tokio::test]
async fn the_binary_serves_on_the_ports_it_prints() {
    let gw = GatewayProcess::spawn(
        r#"
routes:
  - name: hello
    respond: { body: hello }
"#,
    )
    .await;
    let reply = Client::new().get(&gw.url("/")).await;
    assert_eq!(reply.text(), "hello");
    let health = Client::new().get(&gw.admin_url("/healthz")).await;
    assert_eq!(health.status, 200);
}
