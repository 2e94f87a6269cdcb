//! The OpenAI- and Anthropic-compatible test upstream (`tests/llm/upstream.py`, Python stdlib
//! only), as a child process on a free loopback port, killed by PID on drop; and the official
//! `openai` / `anthropic` Python SDKs run against the gateway (`tests/llm/sdk_clients.py`).

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use std::io::{BufRead, BufReader};

use super::tools::{repo_path, which};
use super::Client;

/// A running `tests/llm/upstream.py`.
#[derive(Debug)]
pub struct LlmUpstream {
    pub addr: SocketAddr,
    child: Child,
}

impl LlmUpstream {
    pub fn start() -> LlmUpstream {
        let python = which("python3").expect("python3 on PATH");
        let mut child = Command::new(python)
            .arg(repo_path("tests/llm/upstream.py"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start tests/llm/upstream.py");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the upstream's port");
        let port: u16 = line.trim().parse().expect("a port number");
        LlmUpstream {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
        }
    }

    /// `/_stats`: requests, tokens reported (in all and per API key), streams cut.
    pub async fn stats(&self) -> serde_json::Value {
        let reply = Client::new()
            .get(&format!("http://{}/_stats", self.addr))
            .await;
        assert_eq!(reply.status, 200);
        reply.json()
    }

    /// The input + output tokens the upstream reported in all.
    pub async fn reported(&self) -> u64 {
        self.stats().await["reported"].as_u64().expect("reported")
    }
}

impl Drop for LlmUpstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `tests/llm/sdk_clients.py SCENARIO BASE_URL` (the official SDKs) and returns its stdout,
/// one JSON object.
pub fn sdk(scenario: &str, base_url: &str) -> serde_json::Value {
    let python = which("python3").expect("python3 on PATH");
    let output = Command::new(python)
        .arg(repo_path("tests/llm/sdk_clients.py"))
        .arg(scenario)
        .arg(base_url)
        .output()
        .expect("run tests/llm/sdk_clients.py");
    assert!(
        output.status.success(),
        "sdk_clients.py {scenario} failed (pip install openai anthropic):\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "sdk_clients.py printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}
