//! A throwaway `redis-server` on a free loopback port, with no persistence.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::tools::which;

/// A free loopback port: bind port 0, read it, release it; redis-server binds it right after (a
/// lost race is retried by [`RedisServer::start`]).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local_addr").port()
}

fn require(program: &str) -> PathBuf {
    which(program).unwrap_or_else(|| {
        panic!("`{program}` is not on PATH: install it (apt-get install redis-server redis-tools)")
    })
}

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    binary: PathBuf,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let binary = require("redis-server");
        for _ in 0..5 {
            let mut server = RedisServer {
                child: None,
                port: free_port(),
                dir: tempfile::tempdir().expect("tempdir"),
                binary: binary.clone(),
            };
            // Fails when another process took the port between our probe and redis binding it.
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server did not start on a free port after 5 attempts");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's PID while it runs (to signal it, e.g. SIGSTOP to simulate a stall).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the server with SIGKILL, as a crash would. Its data (and script cache) is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a fresh server on the same port after [`RedisServer::kill`]: empty data, empty
    /// script cache, as after a real restart.
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server did not restart on port {}",
            self.port
        );
    }

    /// Runs `redis-cli` against this server and returns its stdout lines.
    pub fn cli(&self, args: &[&str]) -> Vec<String> {
        let out = Command::new(require("redis-cli"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        assert!(out.status.success(), "redis-cli {args:?} failed: {out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Every key in the database (SCAN, so it also works on a large keyspace).
    pub fn keys(&self) -> Vec<String> {
        self.cli(&["--scan"])
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new(&self.binary)
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(_status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                // Exited: most likely the port was taken.
                self.child = None;
                return false;
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() && self.ping() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        false
    }

    fn ping(&self) -> bool {
        Command::new(require("redis-cli"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "ping"])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
