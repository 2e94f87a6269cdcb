//! A throwaway `redis-server` on a free loopback port, with no persistence; optionally behind TLS
//! (a test CA made with `openssl`) and a password.

use std::path::{Path, PathBuf};
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

/// How a [`RedisServer`] is reached.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// TLS only (no plain port), with a certificate for 127.0.0.1 from a fresh test CA.
    pub tls: bool,
    /// `requirepass`.
    pub password: Option<String>,
}

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    binary: PathBuf,
    options: RedisOptions,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_with(RedisOptions::default())
    }

    pub fn start_with(options: RedisOptions) -> RedisServer {
        let binary = require("redis-server");
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            if options.tls {
                make_certificates(dir.path());
            }
            let mut server = RedisServer {
                child: None,
                port: free_port(),
                dir,
                binary: binary.clone(),
                options: options.clone(),
            };
            // Fails when another process took the port between our probe and redis binding it.
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server did not start on a free port after 5 attempts");
    }

    /// `redis://` or `rediss://`, with the password when there is one.
    pub fn url(&self) -> String {
        let scheme = if self.options.tls { "rediss" } else { "redis" };
        let auth = match &self.options.password {
            Some(password) => format!(":{password}@"),
            None => String::new(),
        };
        format!("{scheme}://{auth}127.0.0.1:{}", self.port)
    }

    /// The test CA's certificate (TLS servers only): what a client must trust.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
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
        let out = self
            .cli_command()
            .args(args)
            .output()
            .expect("run redis-cli");
        assert!(out.status.success(), "redis-cli {args:?} failed: {out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn cli_command(&self) -> Command {
        let mut command = Command::new(require("redis-cli"));
        command.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if self.options.tls {
            command.arg("--tls").arg("--cacert").arg(self.ca_file());
        }
        if let Some(password) = &self.options.password {
            command.env("REDISCLI_AUTH", password);
        }
        command
    }

    /// Every key in the database (SCAN, so it also works on a large keyspace).
    pub fn keys(&self) -> Vec<String> {
        self.cli(&["--scan"])
    }

    fn spawn(&mut self) -> bool {
        let mut command = Command::new(&self.binary);
        let port = self.port.to_string();
        if self.options.tls {
            let dir = self.dir.path();
            command
                .args([
                    "--port",
                    "0",
                    "--tls-port",
                    &port,
                    "--tls-auth-clients",
                    "no",
                ])
                .arg("--tls-cert-file")
                .arg(dir.join("server.pem"))
                .arg("--tls-key-file")
                .arg(dir.join("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(dir.join("ca.pem"));
        } else {
            command.args(["--port", &port]);
        }
        if let Some(password) = &self.options.password {
            command.args(["--requirepass", password]);
        }
        let child = command
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
        self.cli_command()
            .arg("ping")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
    }
}

/// A CA and a server certificate for IP 127.0.0.1 signed by it, in `dir`, made with `openssl`.
fn make_certificates(dir: &Path) {
    let openssl =
        which("openssl").expect("`openssl` is not on PATH: install it (apt-get install openssl)");
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
    )
    .expect("write server.ext");
    let steps: [&[&str]; 3] = [
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=turnstile test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "server.ext",
            "-out",
            "server.pem",
        ],
    ];
    for args in steps {
        let out = Command::new(&openssl)
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl");
        assert!(out.status.success(), "openssl {args:?} failed: {out:?}");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
