//! The `turnstile` binary as a separate process, on free ports, optionally under `faketime`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub struct GatewayProcess {
    child: Child,
    pub public: SocketAddr,
    pub admin: SocketAddr,
    dir: tempfile::TempDir,
}

impl GatewayProcess {
    /// Starts `turnstile run` on `config` (YAML; `listen` and `admin_listen` are added, on port
    /// 0). `faketime` shifts this instance's clock, e.g. `Some("+2m")`.
    pub fn start(config: &str, faketime: Option<&str>) -> GatewayProcess {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policies.yaml");
        let full = format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{config}");
        std::fs::write(&path, full).expect("write config");
        let log = std::fs::File::create(dir.path().join("stderr.log")).expect("log file");
        let binary = PathBuf::from(env!("CARGO_BIN_EXE_turnstile"));
        let mut command = Command::new(&binary);
        if let Some(offset) = faketime {
            // What `faketime -f OFFSET` does, minus its forking wrapper: the PID we hold is the
            // gateway's own, so Drop stops the right process.
            command
                .env("LD_PRELOAD", libfaketime())
                .env("FAKETIME", offset)
                .env("DONT_FAKE_MONOTONIC", "1");
        }
        let mut child = command
            .arg("run")
            .arg("--config")
            .arg(&path)
            .env("TURNSTILE_LOG", "info")
            .env_remove("TURNSTILE_REDIS_URL")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn turnstile");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // Keep draining so the child never blocks on a full pipe.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut process = GatewayProcess {
            child,
            public: "0.0.0.0:0".parse().expect("addr"),
            admin: "0.0.0.0:0".parse().expect("addr"),
            dir,
        };
        loop {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("turnstile listening ") {
                        for part in rest.split_whitespace() {
                            match part.split_once('=') {
                                Some(("public", a)) => process.public = a.parse().expect("addr"),
                                Some(("admin", a)) => process.admin = a.parse().expect("addr"),
                                _ => {}
                            }
                        }
                        return process;
                    }
                }
                Err(_) => panic!("turnstile did not start; stderr:\n{}", process.log()),
            }
        }
    }

    /// What the process wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// The multi-threaded libfaketime (Debian package `faketime`).
fn libfaketime() -> PathBuf {
    [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
    .unwrap_or_else(|| panic!("libfaketimeMT.so.1 not found: install faketime"))
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
