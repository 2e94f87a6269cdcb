//! A throwaway `nginx` on a free loopback port, in the foreground (`daemon off`, one process), so
//! it is stopped by its own PID on drop. The caller gives the `http {}` block's server-level
//! directives; everything nginx writes stays in a temporary directory.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::tools::which;
use super::LIVENESS;

pub struct Nginx {
    pub addr: SocketAddr,
    child: Child,
    dir: tempfile::TempDir,
}

impl Nginx {
    /// Starts nginx with `http_directives` (e.g. `limit_req_zone ...;`) in `http {}` and
    /// `location_directives` in `location /` of one server, whose root holds `index.html`.
    pub fn start(http_directives: &str, location_directives: &str) -> Nginx {
        let binary = which("nginx")
            .unwrap_or_else(|| panic!("`nginx` is not on PATH: apt-get install nginx-light"));
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        std::fs::write(root.join("index.html"), "ok\n").expect("write index.html");
        // A port bound and released just now; a lost race shows in nginx's log below.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port");
        let d = root.display();
        let conf = format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log;\nevents {{}}\nhttp {{\n  access_log off;\n\
             client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d};\n\
             uwsgi_temp_path {d}; scgi_temp_path {d};\n  {http_directives}\n\
             server {{\n    listen {addr};\n    root {d};\n\
             location / {{ {location_directives} }}\n  }}\n}}\n"
        );
        std::fs::write(root.join("nginx.conf"), conf).expect("write nginx.conf");
        let child = Command::new(binary)
            .arg("-p")
            .arg(root)
            .arg("-c")
            .arg(root.join("nginx.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nginx");
        let mut nginx = Nginx { addr, child, dir };
        let deadline = Instant::now() + LIVENESS;
        while std::net::TcpStream::connect(addr).is_err() {
            if let Ok(Some(status)) = nginx.child.try_wait() {
                panic!("nginx exited ({status}): {}", nginx.log());
            }
            assert!(
                Instant::now() < deadline,
                "nginx did not listen: {}",
                nginx.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        nginx
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
