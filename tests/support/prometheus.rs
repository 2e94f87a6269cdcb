//! A real `prometheus` server for tests: started on a free loopback port with a generated config,
//! queried through its HTTP API, and killed by PID when dropped, also when the test fails.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::tools::which;

/// How often the test Prometheus scrapes and evaluates rules.
pub const SCRAPE_INTERVAL: &str = "1s";

/// A running Prometheus. Dropping it kills the process.
pub struct Prometheus {
    child: Child,
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `/metrics` on `target` every second and loading `rule_files`.
    /// Panics with an install hint when the binary is missing: CI must have it.
    pub fn start(target: SocketAddr, rule_files: &[PathBuf]) -> Prometheus {
        let binary = which("prometheus").unwrap_or_else(|| {
            panic!("`prometheus` is not on PATH: install it (Debian: apt-get install prometheus)")
        });
        let rules: Vec<String> = rule_files
            .iter()
            .map(|p| format!("  - {:?}", p.display().to_string()))
            .collect();
        let config = format!(
            "global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  scrape_timeout: {SCRAPE_INTERVAL}\n  \
             evaluation_interval: {SCRAPE_INTERVAL}\nrule_files:\n{}\nscrape_configs:\n  - job_name: \
             turnstile\n    metrics_path: /metrics\n    static_configs:\n      - targets: [\"{target}\"]\n",
            rules.join("\n")
        );

        // Prometheus cannot report a port it picked itself, so pick one, and try again with
        // another in the unlikely case that something took it in between.
        let mut last_log = String::new();
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("tempdir");
            let config_path = dir.path().join("prometheus.yml");
            std::fs::write(&config_path, &config).expect("write prometheus.yml");
            let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
            let addr = free_port();
            let child = Command::new(&binary)
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log file"))
                .stderr(log)
                .spawn()
                .expect("spawn prometheus");
            // From here on, dropping `prometheus` kills the process.
            let mut prometheus = Prometheus { child, addr, dir };
            if prometheus.wait_ready(Duration::from_secs(30)) {
                return prometheus;
            }
            last_log = prometheus.log();
        }
        panic!("prometheus did not become ready; its log:\n{last_log}");
    }

    fn wait_ready(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok((200, _)) = http_get(self.addr, "/-/ready") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Runs an instant PromQL query and returns its `data.result`, or Prometheus' error.
    pub fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let path = format!("/api/v1/query?query={}", percent_encode(expr));
        let (status, body) = http_get(self.addr, &path).map_err(|e| e.to_string())?;
        let json: Value = serde_json::from_str(&body)
            .map_err(|e| format!("HTTP {status}, not JSON ({e}): {body}"))?;
        if json["status"] != "success" {
            return Err(format!(
                "HTTP {status}: {} {}",
                json["errorType"], json["error"]
            ));
        }
        match &json["data"]["result"] {
            Value::Array(result) => Ok(result.clone()),
            // A scalar or string result is one value.
            other => Ok(vec![other.clone()]),
        }
    }

    /// The values of a label on the series matching `selector` (what Grafana's `label_values`
    /// asks).
    pub fn label_values(&self, label: &str, selector: &str) -> Result<Vec<String>, String> {
        let path = format!(
            "/api/v1/label/{label}/values?match[]={}",
            percent_encode(selector)
        );
        let (status, body) = http_get(self.addr, &path).map_err(|e| e.to_string())?;
        let json: Value = serde_json::from_str(&body)
            .map_err(|e| format!("HTTP {status}, not JSON ({e}): {body}"))?;
        let values = json["data"]
            .as_array()
            .ok_or(format!("HTTP {status}: {body}"))?;
        Ok(values
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect())
    }

    /// The single value of a query that must return one sample, if it does.
    pub fn scalar(&self, expr: &str) -> Option<f64> {
        let result = self.query(expr).ok()?;
        let sample = result.first()?;
        sample["value"][1].as_str()?.parse().ok()
    }

    /// Polls `scalar(expr)` until it equals `want`, for at most `timeout`.
    pub fn wait_for_value(&self, expr: &str, want: f64, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        while Instant::now() < deadline {
            last = self.scalar(expr);
            if last == Some(want) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!(
            "`{expr}` was {last:?}, not {want}, after {timeout:?}"
        ))
    }

    /// The server's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nothing listens on right now.
fn free_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr")
}

/// A minimal blocking HTTP/1.0 GET: Prometheus answers it with the whole body and closes.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Percent-encodes everything but RFC 3986 unreserved characters, for a query string value.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
