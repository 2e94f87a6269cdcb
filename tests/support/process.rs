//! The real `turnstile` binary as a child process, for what only a process can show: signals,
//! exit codes, several instances sharing a store.
//!
//! [`GatewayProcess::spawn`] prepends `listen: 127.0.0.1:0` and `admin_listen: 127.0.0.1:0` to the
//! YAML (so tests never pick ports), writes it to a temporary file, runs `turnstile run --config
//! FILE` and reads the `turnstile listening public=ADDR admin=ADDR` line from its stdout. The child
//! is killed on drop if it is still running. Its stderr (the log) is collected for assertions.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};

use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};

use super::LIVENESS;

/// The path of the binary Cargo built for these tests.
pub const BINARY: &str = env!("CARGO_BIN_EXE_turnstile");

/// A running `turnstile run`.
#[derive(Debug)]
pub struct GatewayProcess {
    pub public: SocketAddr,
    pub admin: SocketAddr,
    pub config_path: PathBuf,
    child: Child,
    stderr: Arc<Mutex<String>>,
    _dir: TempDir,
}

/// Writes `yaml` to a fresh temporary directory; returns the directory guard and the file path.
pub fn config_file(yaml: &str) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, yaml).expect("write config");
    (dir, path)
}

/// `listen` and `admin_listen` on free loopback ports, then `yaml`.
pub fn with_free_ports(yaml: &str) -> String {
    format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{yaml}")
}

impl GatewayProcess {
    /// Starts the binary on `yaml` (plus free-port listeners) and waits until it listens.
    pub async fn spawn(yaml: &str) -> GatewayProcess {
        let (dir, config_path) = config_file(&with_free_ports(yaml));
        Self::spawn_at(dir, config_path, &[]).await
    }

    /// [`GatewayProcess::spawn`] with `workers` worker threads (1 runs tokio's single-threaded
    /// scheduler, more its work-stealing one), after checking in the log that they took effect.
    pub async fn spawn_with_workers(yaml: &str, workers: usize) -> GatewayProcess {
        let (dir, config_path) = config_file(&with_free_ports(yaml));
        let workers = workers.to_string();
        let gw = Self::spawn_at(dir, config_path, &[("TURNSTILE_WORKERS", &workers)]).await;
        let started = format!("workers={workers}");
        let deadline = std::time::Instant::now() + LIVENESS;
        while !gw.log().contains(&started) {
            assert!(
                std::time::Instant::now() < deadline,
                "no {started} in the log:\n{}",
                gw.log()
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        gw
    }

    /// Starts the binary on an existing config file, with extra environment variables.
    pub async fn spawn_at(dir: TempDir, config_path: PathBuf, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(BINARY);
        command
            .args(["run", "--config"])
            .arg(&config_path)
            .env("TURNSTILE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("spawn turnstile");

        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err_pipe = child.stderr.take().expect("stderr");
        let sink = stderr.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err_pipe.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                sink.lock().expect("stderr lock").push_str(&text);
            }
        });

        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(LIVENESS, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("turnstile did not say it listens; log:\n{}", text(&stderr)))
            .expect("read stdout")
            .unwrap_or_else(|| panic!("turnstile exited early; log:\n{}", text(&stderr)));
        let (public, admin) = parse_listening(&line)
            .unwrap_or_else(|| panic!("unexpected first stdout line: {line:?}"));
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

        GatewayProcess {
            public,
            admin,
            config_path,
            child,
            stderr,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("child still running")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.public)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// The value of the sample `name{labels}` on the admin listener's `/metrics`, 0 when absent.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let reply = super::Client::new().get(&self.admin_url("/metrics")).await;
        super::metric(&reply.text(), name, labels).unwrap_or(0.0)
    }

    /// Sends `signal` (e.g. "TERM", "HUP") to the child with `kill`, by PID.
    pub fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits for the child to exit (failing the test after [`LIVENESS`]).
    pub async fn wait(&mut self) -> ExitStatus {
        tokio::time::timeout(LIVENESS, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("turnstile did not exit; log:\n{}", self.log()))
            .expect("wait for turnstile")
    }

    /// Everything the child wrote to stderr so far.
    pub fn log(&self) -> String {
        text(&self.stderr)
    }
}

fn text(buffer: &Mutex<String>) -> String {
    buffer.lock().expect("stderr lock").clone()
}

/// Parses `turnstile listening public=ADDR admin=ADDR`.
pub fn parse_listening(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    let rest = line.strip_prefix("turnstile listening ")?;
    let mut public = None;
    let mut admin = None;
    for field in rest.split_whitespace() {
        match field.split_once('=') {
            Some(("public", addr)) => public = addr.parse().ok(),
            Some(("admin", addr)) => admin = addr.parse().ok(),
            _ => {}
        }
    }
    Some((public?, admin?))
}

/// `turnstile check --config PATH`: exit code, stdout, stderr.
pub fn check(path: &Path) -> (Option<i32>, String, String) {
    let output = std::process::Command::new(BINARY)
        .args(["check", "--config"])
        .arg(path)
        .env_remove("TURNSTILE_CONFIG")
        .output()
        .expect("run turnstile check");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}
