//! The gateway under test, in process: a config written to a temp file, listeners on loopback
//! port 0.
//!
//! [`TestGateway`]: the YAML is used as written (the listen addresses it may name are replaced by
//! the test's own listeners), `$UPSTREAM` in it is replaced by the address of the upstream given to
//! [`TestGateway::with_upstream`], and `reload_with` rewrites the file and re-reads it exactly as
//! SIGHUP does. Files the config refers to (an `rls:` block's directory) can be written beside it
//! ([`TestGateway::with_files`]). A store that connects in the background (Redis) is waited for
//! until `/readyz` says so. Dropping it stops the gateway (the shutdown channel closes with it) and
//! deletes the files.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use tempfile::TempDir;
use tokio::net::TcpListener;
use turnstile::config::ConfigErrors;
use turnstile::metrics::Metrics;
use turnstile::Running;

use super::LIVENESS;

use super::client::Client;

/// A running in-process gateway.
#[derive(Debug)]
pub struct TestGateway {
    pub public: SocketAddr,
    pub admin: SocketAddr,
    /// The Envoy rate limit service's gRPC listener, when the config has an `rls:` block.
    pub rls: Option<SocketAddr>,
    pub config_path: PathBuf,
    upstream: Option<SocketAddr>,
    running: Option<Running>,
    _dir: TempDir,
}

/// One route, `api`, proxying everything to `$UPSTREAM` under `policies` (YAML list items,
/// indented six spaces).
pub fn one_route(policies: &str) -> String {
    format!(
        r#"
upstreams:
  up: {{ url: "http://$UPSTREAM" }}
routes:
  - name: api
    upstream: up
    policies:
{policies}
"#
    )
}

/// Replaces `$UPSTREAM` with `addr` (as `http://IP:PORT`'s authority).
pub fn substitute(yaml: &str, upstream: Option<SocketAddr>) -> String {
    match upstream {
        Some(addr) => yaml.replace("$UPSTREAM", &addr.to_string()),
        None => yaml.to_string(),
    }
}

impl TestGateway {
    /// A gateway whose config needs no upstream (`respond:` routes only).
    pub async fn start(yaml: &str) -> TestGateway {
        Self::launch(yaml, None).await
    }

    /// A gateway whose config refers to `$UPSTREAM`.
    pub async fn with_upstream(yaml: &str, upstream: SocketAddr) -> TestGateway {
        Self::launch(yaml, Some(upstream)).await
    }

    /// A gateway whose config refers to `files` (relative paths, written beside `policies.yaml`;
    /// directories are created).
    pub async fn with_files(yaml: &str, files: &[(&str, &str)]) -> TestGateway {
        Self::try_launch(yaml, None, files)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    async fn launch(yaml: &str, upstream: Option<SocketAddr>) -> TestGateway {
        Self::try_launch(yaml, upstream, &[])
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`TestGateway::with_files`], but a config that does not load or a gateway that does
    /// not start is an `Err` with the message.
    pub async fn try_launch(
        yaml: &str,
        upstream: Option<SocketAddr>,
        files: &[(&str, &str)],
    ) -> Result<TestGateway, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in files {
            let path = dir.path().join(name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).expect("mkdir");
            }
            std::fs::write(path, text).expect("write file");
        }
        let config_path = dir.path().join("policies.yaml");
        std::fs::write(&config_path, substitute(yaml, upstream)).expect("write config");
        let snapshot = turnstile::config::load(&config_path)
            .map_err(|e| format!("test config does not load:\n{e}"))?;
        let public = TcpListener::bind("127.0.0.1:0").await.expect("bind public");
        // With `listen: off` the gateway closes this listener: the address then refuses.
        let public_addr = public.local_addr().expect("public address");
        // `/readyz` is waited for over plain HTTP; an admin listener with TLS is the test's own.
        let plain_admin = snapshot.admin_tls.is_none();
        let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
        let running = turnstile::start(snapshot, Metrics::new(), Some((public, admin)))
            .await
            .map_err(|e| format!("gateway does not start: {e}"))?;
        let gw = TestGateway {
            public: running.public_addr.unwrap_or(public_addr),
            admin: running.admin_addr,
            rls: running.rls_addr,
            config_path,
            upstream,
            running: Some(running),
            _dir: dir,
        };
        if plain_admin {
            gw.wait_ready().await;
        }
        Ok(gw)
    }

    /// Waits (for at most [`LIVENESS`]) until `/readyz` answers 200: a Redis store connects in
    /// the background.
    pub async fn wait_ready(&self) {
        let deadline = std::time::Instant::now() + LIVENESS;
        while self.admin_get("/readyz").await.0 != 200 {
            assert!(
                std::time::Instant::now() < deadline,
                "the gateway never became ready"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// `http://PUBLIC{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.public)
    }

    /// `http://ADMIN{path}`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    pub fn running(&self) -> &Running {
        self.running.as_ref().expect("gateway already shut down")
    }

    /// Rewrites the config file (with `$UPSTREAM` substituted) and reloads it, as SIGHUP does.
    /// `Ok` holds the changed settings that need a restart.
    pub async fn reload_with(&self, yaml: &str) -> Result<Vec<&'static str>, ConfigErrors> {
        write_config(&self.config_path, &substitute(yaml, self.upstream));
        self.running().reload().await
    }

    /// Stops accepting and drains in-flight requests, as on SIGTERM.
    pub async fn shutdown(mut self) {
        if let Some(running) = self.running.take() {
            running.shutdown().await;
        }
    }

    /// The status of a GET on the public listener, on a connection of its own.
    pub async fn get(&self, path: &str) -> u16 {
        one_shot(&self.url(path)).await.status
    }

    /// A GET on the admin listener, on a connection of its own: (status, body).
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        let reply = one_shot(&self.admin_url(path)).await;
        (reply.status, reply.text())
    }

    /// The value of the sample `name{labels}` on the admin listener's `/metrics`, 0 when absent.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        super::metric(&self.metrics().await, name, labels).unwrap_or(0.0)
    }

    /// Sends `GET /api` with `extra` header lines on a raw connection and returns it unread,
    /// so a test can drop it while the request waits (`on_limit: delay`).
    pub async fn open_request(&self, extra: &str) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(self.public)
            .await
            .expect("connect");
        let head = format!("GET /api HTTP/1.1\r\nhost: test\r\n{extra}\r\n");
        stream.write_all(head.as_bytes()).await.expect("write");
        stream
    }

    /// Waits (at most 10 s) until `turnstile_waiting_requests{route="api"}` is `n`.
    pub async fn wait_for_waiting(&self, n: f64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self
            .metric("turnstile_waiting_requests", &[("route", "api")])
            .await
            != n
        {
            assert!(std::time::Instant::now() < deadline, "never {n} waiting");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// The admin listener's `/metrics` text.
    pub async fn metrics(&self) -> String {
        let (status, text) = self.admin_get("/metrics").await;
        assert_eq!(status, 200, "/metrics: {text}");
        text
    }
}

/// A GET with `Connection: close`, so no idle keep-alive connection is left for the gateway's
/// graceful shutdown to wait on.
async fn one_shot(url: &str) -> super::client::Reply {
    Client::new()
        .get_with(url, &[("connection", "close")])
        .await
}

fn write_config(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write config");
}
