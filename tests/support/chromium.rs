//! Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: a fresh profile
//! per browser, the debugging port chosen by Chromium itself (`--remote-debugging-port=0`, read
//! back from the profile's `DevToolsActivePort`), and a small WebSocket client (RFC 6455: text
//! frames, client-masked) for the protocol's JSON calls. Every call is bounded in time; the
//! browser's process group is stopped by its id on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::tools::which;

/// The longest one protocol call, or one wait for the page, may take.
const CALL_LIMIT: Duration = Duration::from_secs(20);

/// A running headless Chromium.
pub struct Chromium {
    child: Child,
    port: u16,
    browser_path: String,
    _profile: TempDir,
}

impl Chromium {
    /// Starts Chromium with a fresh profile and the window `width` x `height`.
    pub fn start(width: u32, height: u32) -> Chromium {
        let binary = which("chromium").unwrap_or_else(|| {
            panic!("`chromium` is not on PATH: install it (apt-get install chromium)")
        });
        let profile = tempfile::tempdir().expect("profile dir");
        let mut command = Command::new(binary);
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-crash-reporter",
                "--disable-breakpad",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--window-size={width},{height}"))
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // Its own process group, so its renderer and helper processes stop with it.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let child = command.spawn().expect("start chromium");
        let active = profile.path().join("DevToolsActivePort");
        let deadline = Instant::now() + CALL_LIMIT;
        let (port, browser_path) = loop {
            if let Some(found) = read_active_port(&active) {
                break found;
            }
            assert!(
                Instant::now() < deadline,
                "chromium never opened its debugging port"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        Chromium {
            child,
            port,
            browser_path,
            _profile: profile,
        }
    }

    /// A new tab, at `about:blank`.
    pub async fn page(&self) -> Page {
        let mut browser = Page::connect(self.port, &self.browser_path).await;
        let target = browser
            .call("Target.createTarget", json!({ "url": "about:blank" }))
            .await;
        let id = target["targetId"].as_str().expect("targetId").to_string();
        let mut page = Page::connect(self.port, &format!("/devtools/page/{id}")).await;
        page.call("Page.enable", json!({})).await;
        page.call("Runtime.enable", json!({})).await;
        page
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        // The whole group, by its id (the browser's pid): its renderers and helpers too.
        let group = format!("-{}", self.child.id());
        for signal in ["TERM", "KILL"] {
            let _ = Command::new("kill")
                .args(["-s", signal, "--", &group])
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if matches!(self.child.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn read_active_port(path: &Path) -> Option<(u16, String)> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut lines = text.lines();
    let port = lines.next()?.trim().parse().ok()?;
    let path = lines.next()?.trim().to_string();
    Some((port, path))
}

/// One DevTools protocol connection (a tab's, or the browser's).
pub struct Page {
    stream: TcpStream,
    next_id: u64,
}

impl Page {
    async fn connect(port: u16, path: &str) -> Page {
        let mut stream = tokio::time::timeout(CALL_LIMIT, TcpStream::connect(("127.0.0.1", port)))
            .await
            .expect("connect to chromium in time")
            .expect("connect to chromium");
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n\
             Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
             Sec-WebSocket-Version: 13\r\n\r\n"
        );
        stream
            .write_all(request.as_bytes())
            .await
            .expect("handshake");
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            let n = tokio::time::timeout(CALL_LIMIT, stream.read(&mut byte))
                .await
                .expect("handshake in time")
                .expect("read handshake");
            assert!(
                n == 1 && head.len() < 8192,
                "handshake: {}",
                String::from_utf8_lossy(&head)
            );
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head);
        assert!(head.starts_with("HTTP/1.1 101"), "not upgraded: {head}");
        Page { stream, next_id: 1 }
    }

    /// Calls `method` and returns its `result`; events that arrive meanwhile are skipped.
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let message = json!({ "id": id, "method": method, "params": params }).to_string();
        tokio::time::timeout(CALL_LIMIT, async {
            self.send(message.as_bytes()).await;
            loop {
                let reply: Value = serde_json::from_slice(&self.receive().await).expect("JSON");
                if reply["id"] == id {
                    if let Some(error) = reply.get("error") {
                        panic!("{method}: {error}");
                    }
                    return reply["result"].clone();
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{method} took longer than {CALL_LIMIT:?}"))
    }

    /// Opens `url` in this tab and waits for its `load` event.
    pub async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({ "url": url })).await;
        self.wait_for("document.readyState === 'complete'", "the page loads")
            .await;
    }

    /// Evaluates `expression` in the page (awaiting a promise) and returns its value.
    pub async fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "awaitPromise": true, "returnByValue": true }),
            )
            .await;
        if let Some(exception) = result.get("exceptionDetails") {
            panic!("`{expression}` threw: {exception}");
        }
        result["result"]["value"].clone()
    }

    /// Polls `expression` until it is truthy (at most [`CALL_LIMIT`]); returns its last value.
    pub async fn wait_for(&mut self, expression: &str, what: &str) -> Value {
        let deadline = Instant::now() + CALL_LIMIT;
        let guarded =
            format!("(() => {{ try {{ return {expression}; }} catch (e) {{ return false; }} }})()");
        loop {
            let value = self.eval(&guarded).await;
            let truthy = match &value {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                Value::Number(n) => n.as_f64() != Some(0.0),
                _ => true,
            };
            if truthy {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "waited {CALL_LIMIT:?} for {what}: `{expression}`"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the viewport, written to `path`; returns its size in bytes.
    pub async fn screenshot(&mut self, path: &PathBuf) -> usize {
        use base64::Engine as _;
        let shot = self
            .call("Page.captureScreenshot", json!({ "format": "png" }))
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("screenshot data"))
            .expect("base64");
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
        std::fs::write(path, &png).expect("write screenshot");
        png.len()
    }

    async fn send(&mut self, payload: &[u8]) {
        let mask = [0x5a, 0x17, 0xc3, 0x8e];
        let mut frame = vec![0x81u8];
        match payload.len() {
            n if n < 126 => frame.push(0x80 | n as u8),
            n if n < 65536 => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.stream.write_all(&frame).await.expect("send frame");
    }

    /// The next whole message (continuation frames joined); pings are answered.
    async fn receive(&mut self) -> Vec<u8> {
        let mut message = Vec::new();
        loop {
            let mut head = [0u8; 2];
            self.stream.read_exact(&mut head).await.expect("frame head");
            let (fin, opcode) = (head[0] & 0x80 != 0, head[0] & 0x0f);
            let len = match head[1] & 0x7f {
                126 => {
                    let mut n = [0u8; 2];
                    self.stream.read_exact(&mut n).await.expect("length");
                    u64::from(u16::from_be_bytes(n))
                }
                127 => {
                    let mut n = [0u8; 8];
                    self.stream.read_exact(&mut n).await.expect("length");
                    u64::from_be_bytes(n)
                }
                n => u64::from(n),
            };
            assert!(len < 64 << 20, "a frame of {len} bytes");
            let mut payload = vec![0u8; len as usize];
            self.stream.read_exact(&mut payload).await.expect("payload");
            match opcode {
                0x8 => panic!("chromium closed the connection"),
                0x9 => {
                    // Ping: answer with a pong of the same payload.
                    let mask = [0u8; 4];
                    let mut frame = vec![0x8a, 0x80 | payload.len().min(125) as u8];
                    frame.extend_from_slice(&mask);
                    frame.extend_from_slice(&payload[..payload.len().min(125)]);
                    self.stream.write_all(&frame).await.expect("pong");
                }
                0xa => {}
                _ => {
                    message.extend_from_slice(&payload);
                    if fin {
                        return message;
                    }
                }
            }
        }
    }
}
