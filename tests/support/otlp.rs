//! A real OTLP/gRPC receiver: `tests/fixtures/otlp/receiver.py`, on the official
//! `opentelemetry-proto` definitions and `grpcio` (PyPI), recording every span it receives.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

use super::tools::repo_path;
use super::LIVENESS;

/// The receiver process; killed by its PID on drop.
pub struct OtlpReceiver {
    pub addr: SocketAddr,
    child: Child,
    out: PathBuf,
    _dir: tempfile::TempDir,
}

impl OtlpReceiver {
    /// Starts the receiver on a free loopback port and waits until it listens.
    pub fn start() -> OtlpReceiver {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("spans.jsonl");
        let mut child = Command::new("python3")
            .arg(repo_path("tests/fixtures/otlp/receiver.py"))
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 (test.sh installs opentelemetry-proto and grpcio from PyPI)");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the receiver's first line");
        let port: u16 = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| {
                panic!("receiver did not start (pip install opentelemetry-proto grpcio): {line:?}")
            });
        OtlpReceiver {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
            out,
            _dir: dir,
        }
    }

    /// Every span received so far, one JSON object each.
    pub fn spans(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
            .collect()
    }

    /// Waits until at least `n` spans have arrived, and returns them all.
    pub async fn wait_spans(&self, n: usize) -> Vec<Value> {
        let deadline = std::time::Instant::now() + LIVENESS;
        loop {
            let spans = self.spans();
            if spans.len() >= n {
                return spans;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} spans arrived, not {n}: {spans:#?}",
                spans.len()
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
