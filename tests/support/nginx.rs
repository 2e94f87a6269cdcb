//! A throwaway NGINX on a free loopback port, for tests that need what users really put behind
//! (or in front of) a gateway: its path normalisation, its `Host` handling, `auth_request`.
//!
//! [`Nginx::start`] takes the body of one `server { }` block (the `listen` line is added) and runs
//! `nginx -p TMPDIR -c nginx.conf` in the foreground (`daemon off; master_process off;`), with the
//! pid file, error log, access log and every temp path in the temporary directory. It is stopped
//! by PID on drop. The access log uses the `turnstile` format, one request a line:
//! `STATUS "REQUEST_URI" "URI" "HOST" "HTTP_HOST" "ARGS"` (see [`AccessLine`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::tools::which;
use super::LIVENESS;

fn nginx_binary() -> PathBuf {
    which("nginx")
        .or_else(|| Some(PathBuf::from("/usr/sbin/nginx")).filter(|p| p.is_file()))
        .unwrap_or_else(|| panic!("`nginx` is not installed (apt-get install nginx-light)"))
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local_addr").port()
}

/// One line of the access log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLine {
    pub status: u16,
    /// The request target as NGINX received it (`$request_uri`).
    pub request_uri: String,
    /// NGINX's own normalised path (`$uri`).
    pub uri: String,
    /// `$host`: lower-cased, without port.
    pub host: String,
    /// The `Host` header as received (`$http_host`).
    pub http_host: String,
    pub args: String,
}

/// A running NGINX.
pub struct Nginx {
    pub addr: SocketAddr,
    child: Child,
    dir: tempfile::TempDir,
}

impl Nginx {
    /// Starts NGINX with `server_body` inside `server { listen 127.0.0.1:PORT; ... }`, and waits
    /// until it accepts connections.
    pub fn start(server_body: &str) -> Nginx {
        Self::start_with(server_body, "")
    }

    /// [`Nginx::start`] with extra directives at `http { }` level (upstreams, maps, ...).
    pub fn start_with(server_body: &str, http_extra: &str) -> Nginx {
        Self::start_listen(server_body, http_extra, "")
    }

    /// NGINX serving HTTPS (`listen ... ssl`): `server_body` names `ssl_certificate` and
    /// `ssl_certificate_key`.
    pub fn start_ssl(server_body: &str) -> Nginx {
        Self::start_listen(server_body, "", " ssl")
    }

    fn start_listen(server_body: &str, http_extra: &str, listen_options: &str) -> Nginx {
        let binary = nginx_binary();
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            let port = free_port();
            let conf = config(dir.path(), port, server_body, http_extra).replace(
                &format!("listen 127.0.0.1:{port};"),
                &format!("listen 127.0.0.1:{port}{listen_options};"),
            );
            std::fs::write(dir.path().join("nginx.conf"), conf).expect("write nginx.conf");
            let child = Command::new(&binary)
                .arg("-p")
                .arg(dir.path())
                .args(["-c", "nginx.conf", "-e", "error.log"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn nginx");
            let mut nginx = Nginx {
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
                child,
                dir,
            };
            if nginx.wait_ready() {
                return nginx;
            }
            // Lost the port to another process between the probe and NGINX binding it, or a bad
            // config: retry on a bind failure only.
            let log = nginx.error_log();
            if !log.contains("Address already in use") {
                panic!("nginx did not start; error.log:\n{log}");
            }
        }
        panic!("nginx did not start on a free port after 5 attempts");
    }

    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + LIVENESS;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_ok()
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `http://127.0.0.1:PORT`, for an upstream `url:`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The prefix directory (config, logs, temp files).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }

    /// Every request NGINX has logged so far (it writes each line when the request ends).
    pub fn access_log(&self) -> Vec<AccessLine> {
        let text = std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default();
        text.lines().map(parse_line).collect()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(dir: &Path, port: u16, server_body: &str, http_extra: &str) -> String {
    let d = dir.display();
    format!(
        r#"daemon off;
master_process off;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 256; }}
http {{
    log_format turnstile '$status "$request_uri" "$uri" "$host" "$http_host" "$args"';
    access_log {d}/access.log turnstile;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    default_type text/plain;
    {http_extra}
    server {{
        listen 127.0.0.1:{port};
        {server_body}
    }}
}}
"#
    )
}

/// Parses `STATUS "A" "B" "C" "D" "E"` (NGINX escapes `"` inside values as `\x22`).
fn parse_line(line: &str) -> AccessLine {
    let (status, rest) = line.split_once(' ').unwrap_or((line, ""));
    let fields: Vec<String> = rest
        .split("\" \"")
        .map(|f| f.trim_matches('"').to_string())
        .collect();
    let field = |i: usize| fields.get(i).cloned().unwrap_or_default();
    AccessLine {
        status: status.parse().unwrap_or(0),
        request_uri: field(0),
        uri: field(1),
        host: field(2),
        http_host: field(3),
        args: field(4),
    }
}
