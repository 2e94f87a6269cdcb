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
    /// A Redis Cluster node (`--cluster-enabled yes`, its bus on a free port of its own: the
    /// default port + 10000 overflows for high ports), with a 1 s node timeout.
    pub cluster: bool,
    /// More `redis-server` arguments (e.g. `--replicaof`).
    pub args: Vec<String>,
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
        if self.options.cluster {
            let bus = free_port().to_string();
            command.args([
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                &bus,
                "--cluster-node-timeout",
                "1000",
            ]);
        }
        command
            .args(["--repl-diskless-sync-delay", "0"])
            .args(&self.options.args);
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

/// Polls `done` every 50 ms for at most `limit`; panics with `what` when it never holds.
fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `field:value` of `INFO`/`CLUSTER INFO` output.
pub fn info_field(lines: &[String], field: &str) -> Option<String> {
    let prefix = format!("{field}:");
    lines
        .iter()
        .find_map(|l| l.trim().strip_prefix(&prefix).map(str::to_string))
}

/// A Redis Cluster of 3 masters and 3 replicas on free loopback ports
/// (`redis-cli --cluster create ... --cluster-replicas 1`), ready when every node says
/// `cluster_state:ok` and every replica's link to its master is up.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let options = RedisOptions {
            cluster: true,
            ..RedisOptions::default()
        };
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| RedisServer::start_with(options.clone()))
            .collect();
        let mut create = vec!["--cluster".to_string(), "create".to_string()];
        create.extend(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)));
        create.extend(["--cluster-replicas", "1", "--cluster-yes"].map(String::from));
        let args: Vec<&str> = create.iter().map(String::as_str).collect();
        nodes[0].cli(&args);
        let cluster = RedisCluster { nodes };
        cluster.wait_healthy(Duration::from_secs(30));
        cluster
    }

    /// Waits until every live node sees `cluster_state:ok` and every live replica is in sync.
    pub fn wait_healthy(&self, limit: Duration) {
        for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
            wait_until(
                &format!("node {} sees cluster_state:ok", node.port),
                limit,
                || {
                    info_field(&node.cli(&["cluster", "info"]), "cluster_state").as_deref()
                        == Some("ok")
                },
            );
        }
        for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
            wait_until(
                &format!("node {} is a master or an in-sync replica", node.port),
                limit,
                || {
                    let info = node.cli(&["info", "replication"]);
                    info_field(&info, "role").as_deref() == Some("master")
                        || info_field(&info, "master_link_status").as_deref() == Some("up")
                },
            );
        }
    }

    /// The seed list for `store.cluster`.
    pub fn seeds(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("[{}]", nodes.join(", "))
    }

    /// Any live node, to ask about the cluster.
    pub fn any(&self) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.pid().is_some())
            .expect("a live node")
    }

    /// The slot of `key`.
    pub fn slot(&self, key: &str) -> u16 {
        self.any().cli(&["cluster", "keyslot", key])[0]
            .parse()
            .expect("keyslot")
    }

    /// The index in `nodes` of the master serving `key`'s slot now. Each master is asked about
    /// itself (its `myself` line is authoritative; another node's view of a slot that just moved
    /// lags by a gossip round), for up to [`LIVENESS`] while a slot is between owners.
    pub fn master_of(&self, key: &str) -> usize {
        let slot = self.slot(key);
        let deadline = std::time::Instant::now() + super::LIVENESS;
        loop {
            for (index, node) in self.nodes.iter().enumerate() {
                if node.pid().is_none() {
                    continue;
                }
                let serves = node.cli(&["cluster", "nodes"]).iter().any(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    fields.len() >= 9
                        && fields[2].contains("myself")
                        && fields[2].contains("master")
                        && fields[8..].iter().any(|range| match range.split_once('-') {
                            Some((a, b)) => (a.parse().unwrap_or(u16::MAX)
                                ..=b.parse().unwrap_or(0))
                                .contains(&slot),
                            None => range.parse() == Ok(slot),
                        })
                });
                if serves {
                    return index;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no master serves slot {slot}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Starts moving `key`'s slot to another master, as a resharding does: the target imports,
    /// the source migrates, and the slot's keys are moved (`MIGRATE`). Until
    /// [`RedisCluster::finish_move`], the source answers `ASK` for them.
    pub fn begin_move(&self, key: &str) -> SlotMove {
        let moving = self.begin_move_of(key, &[]);
        self.migrate_rest(&moving);
        moving
    }

    /// [`RedisCluster::begin_move`] caught midway: of the slot's keys, only `keys` are moved yet,
    /// so a call on keys of both sides gets `TRYAGAIN`. [`RedisCluster::migrate_rest`] moves the
    /// others.
    pub fn begin_move_of(&self, key: &str, keys: &[&str]) -> SlotMove {
        let slot = self.slot(key).to_string();
        let from = self.master_of(key);
        let to = (0..self.nodes.len())
            .find(|&i| {
                i != from
                    && self.nodes[i].pid().is_some()
                    && info_field(&self.nodes[i].cli(&["info", "replication"]), "role").as_deref()
                        == Some("master")
            })
            .expect("another master");
        let id = |i: usize| self.nodes[i].cli(&["cluster", "myid"])[0].clone();
        let (from_id, to_id) = (id(from), id(to));
        self.nodes[to].cli(&["cluster", "setslot", &slot, "importing", &from_id]);
        self.nodes[from].cli(&["cluster", "setslot", &slot, "migrating", &to_id]);
        let moving = SlotMove {
            slot,
            from,
            to,
            to_id,
        };
        self.migrate(&moving, keys);
        moving
    }

    /// Moves every key still in the source's part of a slot being moved.
    pub fn migrate_rest(&self, moving: &SlotMove) {
        let keys = self.nodes[moving.from].cli(&["cluster", "getkeysinslot", &moving.slot, "1000"]);
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.migrate(moving, &keys);
    }

    fn migrate(&self, moving: &SlotMove, keys: &[&str]) {
        if keys.is_empty() {
            return;
        }
        let port = self.nodes[moving.to].port.to_string();
        let mut migrate = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "keys"];
        migrate.extend_from_slice(keys);
        self.nodes[moving.from].cli(&migrate);
    }

    /// Ends a move: every master learns the slot's new owner (`MOVED` from now on).
    pub fn finish_move(&self, moving: &SlotMove) {
        for i in [moving.to, moving.from] {
            self.nodes[i].cli(&["cluster", "setslot", &moving.slot, "node", &moving.to_id]);
        }
        for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
            let _ = node
                .cli_command()
                .args(["cluster", "setslot", &moving.slot, "node", &moving.to_id])
                .output();
        }
    }

    /// Every key on every live master.
    pub fn keys(&self) -> Vec<String> {
        let mut keys = Vec::new();
        for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
            let role = info_field(&node.cli(&["info", "replication"]), "role");
            if role.as_deref() == Some("master") {
                keys.extend(node.keys());
            }
        }
        keys
    }

    /// A command about one key, sent to whichever master serves it (`redis-cli -c`).
    pub fn key_cli(&self, args: &[&str]) -> Vec<String> {
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        self.any().cli(&all)
    }
}

/// A slot being moved between two masters (indexes in [`RedisCluster::nodes`]).
pub struct SlotMove {
    pub slot: String,
    pub from: usize,
    pub to: usize,
    to_id: String,
}

/// A master, one replica and one Sentinel (`redis-server FILE --sentinel`, Sentinel's own mode of
/// the Debian binary) watching it as `mymaster`, with a 1 s down-after and quorum 1.
pub struct RedisSentinelSetup {
    pub master: RedisServer,
    pub replica: RedisServer,
    pub sentinel: RedisServer,
}

impl RedisSentinelSetup {
    pub const SERVICE: &'static str = "mymaster";

    pub fn start() -> RedisSentinelSetup {
        let master = RedisServer::start();
        let replica = RedisServer::start_with(RedisOptions {
            args: vec![
                "--replicaof".into(),
                "127.0.0.1".into(),
                master.port.to_string(),
            ],
            ..RedisOptions::default()
        });
        wait_until("the replica syncs", Duration::from_secs(20), || {
            info_field(&replica.cli(&["info", "replication"]), "master_link_status").as_deref()
                == Some("up")
        });
        let sentinel = RedisServer::start_sentinel(master.port);
        let setup = RedisSentinelSetup {
            master,
            replica,
            sentinel,
        };
        wait_until("sentinel sees the replica", Duration::from_secs(20), || {
            setup
                .sentinel
                .cli(&["sentinel", "replicas", Self::SERVICE])
                .iter()
                .any(|l| l == &setup.replica.port.to_string())
        });
        setup
    }

    /// The port of the master Sentinel names now.
    pub fn master_port(&self) -> u16 {
        let reply = self
            .sentinel
            .cli(&["sentinel", "get-master-addr-by-name", Self::SERVICE]);
        reply[1].parse().expect("port")
    }
}

impl RedisServer {
    /// A Sentinel on a free port, monitoring the master at 127.0.0.1:`master`.
    fn start_sentinel(master: u16) -> RedisServer {
        let binary = require("redis-server");
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            let port = free_port();
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\n\
                     sentinel monitor {} 127.0.0.1 {master} 1\n\
                     sentinel down-after-milliseconds {} 1000\n\
                     sentinel failover-timeout {} 10000\n",
                    dir.path().display(),
                    RedisSentinelSetup::SERVICE,
                    RedisSentinelSetup::SERVICE,
                    RedisSentinelSetup::SERVICE,
                ),
            )
            .expect("write sentinel.conf");
            let child = Command::new(&binary)
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server --sentinel");
            let mut server = RedisServer {
                child: Some(child),
                port,
                dir,
                binary: binary.clone(),
                options: RedisOptions::default(),
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if server
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten())
                    .is_some()
                {
                    server.child = None;
                    break;
                }
                if server.ping() {
                    return server;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            server.kill();
        }
        panic!("redis sentinel did not start on a free port after 5 attempts");
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
