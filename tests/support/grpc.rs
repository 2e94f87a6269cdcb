//! A real gRPC server and client, both `grpcio` (PyPI): `tests/fixtures/grpc/server.py` (service
//! `turnstile.test.Echo` on raw bytes, every method setting trailing metadata) and
//! `tests/fixtures/grpc/client.py`, driven one JSON command per line.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde_json::{json, Value};

use super::tools::repo_path;

const INSTALL: &str = "python3 with grpcio (test.sh installs it from PyPI)";

/// The service's methods, by their full paths.
pub const UNARY: &str = "/turnstile.test.Echo/Unary";
pub const SERVER_STREAM: &str = "/turnstile.test.Echo/ServerStream";
pub const CLIENT_STREAM: &str = "/turnstile.test.Echo/ClientStream";
pub const BIDI: &str = "/turnstile.test.Echo/Bidi";
pub const COUNT: &str = "/turnstile.test.Echo/Count";

/// The server process; killed by its PID on drop.
pub struct GrpcServer {
    pub addr: SocketAddr,
    child: Child,
}

impl GrpcServer {
    /// A plaintext (h2c) server on a free loopback port.
    pub fn start() -> GrpcServer {
        Self::spawn(&[])
    }

    /// A TLS server presenting `cert` and `key`.
    pub fn start_tls(cert: &Path, key: &Path) -> GrpcServer {
        Self::spawn(&[cert, key])
    }

    fn spawn(args: &[&Path]) -> GrpcServer {
        let mut child = Command::new("python3")
            .arg(repo_path("tests/fixtures/grpc/server.py"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect(INSTALL);
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the server's first line");
        let port: u16 = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the gRPC server did not start ({INSTALL}): {line:?}"));
        GrpcServer {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
        }
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client process talking h2c to `target`; every command blocks until it answers (each call
/// it makes has a 20 s deadline).
pub struct GrpcClient {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl GrpcClient {
    pub fn connect(target: SocketAddr) -> GrpcClient {
        let mut child = Command::new("python3")
            .arg(repo_path("tests/fixtures/grpc/client.py"))
            .arg(target.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect(INSTALL);
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .expect("the client's first line");
        assert_eq!(
            line.trim(),
            "ready",
            "the gRPC client did not start ({INSTALL})"
        );
        GrpcClient {
            child,
            stdin,
            stdout,
        }
    }

    /// Sends one command and returns its answer.
    pub fn run(&mut self, command: Value) -> Value {
        writeln!(self.stdin, "{command}").expect("write to the client");
        self.stdin.flush().expect("flush");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read the client");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    pub fn unary(&mut self, method: &str, data: &str) -> Value {
        self.run(json!({"op": "unary", "method": method, "data": data}))
    }

    /// The status code of each of `n` unary calls, one after another.
    pub fn unary_many(&mut self, method: &str, n: usize) -> Vec<String> {
        let answer = self.run(json!({"op": "unary_many", "method": method, "data": "x", "n": n}));
        serde_json::from_value(answer["codes"].clone()).expect("codes")
    }

    /// How many calls of each method the server has started (`{"Unary": 3, ...}`).
    pub fn counts(&mut self) -> Value {
        let answer = self.unary(COUNT, "");
        assert_eq!(answer["code"], "OK", "{answer}");
        let text = answer["messages"][0].as_str().expect("text").to_string();
        serde_json::from_str(&text).expect("json")
    }
}

impl Drop for GrpcClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
