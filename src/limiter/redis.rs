//! The Redis store: counters shared by every gateway instance, one atomic script call per request.
//!
//! Each decision is one `EVALSHA` of `scripts/decide.lua` carrying every check of the request, so
//! it costs one round trip whatever the number of policies, and is all-or-nothing inside Redis.
//! The script reads Redis `TIME`: gateway clocks never matter. fred pipelines concurrent commands
//! on each of the `pool_size` connections. `rediss://` URLs use rustls with the system's roots
//! (or the file named by `SSL_CERT_FILE`).
//!
//! Failure is bounded and cheap: a decision gives up after `timeout`, a disconnected pool fails at
//! once, and after repeated failures a [`Breaker`] skips Redis for a cool-down. The gateway starts
//! with Redis down; a background probe keeps [`RedisStore::is_ready`] current and reloads the
//! script after a restart (a `NOSCRIPT` answer also reloads it and retries once).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use fred::prelude::{
    Builder, ClientLike, Config, ConnectionConfig, Error as FredError, ErrorKind, EventInterface,
    Key, LuaInterface, PerformanceConfig, Pool, ReconnectPolicy, Value,
};
use fred::types::config::UnresponsiveConfig;

use super::breaker::{Admission, Breaker};
use super::{Check, Clock, Decision, Outcome, Rule, StoreError};

/// The decision script; `docs/algorithms.md` in Lua.
pub const DECIDE_LUA: &str = include_str!("../../scripts/decide.lua");

/// How long a connection attempt may take (fred's default is 10 s).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The least time between two logged connection errors.
const ERROR_LOG_EVERY: Duration = Duration::from_secs(10);
/// How often the background probe checks reachability and the script cache.
const PROBE_EVERY: Duration = Duration::from_millis(500);

/// Counters in Redis, for many gateway instances.
pub struct RedisStore {
    shared: Arc<Shared>,
}

struct Shared {
    pool: Pool,
    /// The script's SHA1, as Redis reported it when the script was first loaded.
    sha: OnceLock<fred::bytes_utils::Str>,
    key_prefix: String,
    timeout: Duration,
    breaker: Breaker,
    /// Set by the background probe: Redis answered and holds the script.
    ready: AtomicBool,
    /// When a connection error was last logged (ms since `started`, offset by one so 0 is never).
    last_error_log_ms: AtomicU64,
    /// The origin of the breaker's millisecond clock.
    started: Instant,
    /// Tests only: pass this clock's time as `now` instead of letting the script read `TIME`.
    test_clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("key_prefix", &self.shared.key_prefix)
            .field("timeout", &self.shared.timeout)
            .field("ready", &self.shared.ready.load(Ordering::Relaxed))
            .field("circuit_open", &self.shared.breaker.is_open())
            .finish()
    }
}

impl RedisStore {
    /// Starts connecting in the background and returns at once: the gateway serves (under its
    /// routes' failure modes) while Redis is unreachable. Fails only on an unusable `url`.
    pub fn connect(
        url: &str,
        pool_size: usize,
        timeout: Duration,
        key_prefix: &str,
    ) -> Result<Self, StoreError> {
        Self::start(url, pool_size, timeout, key_prefix, None)
    }

    /// For the conformance suite only: the script uses `clock` instead of Redis `TIME`, so a test
    /// can replay exact timestamps. Never in production, where instances' clocks would matter.
    pub fn connect_with_test_clock(
        url: &str,
        timeout: Duration,
        key_prefix: &str,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        Self::start(url, 1, timeout, key_prefix, Some(clock))
    }

    fn start(
        url: &str,
        pool_size: usize,
        timeout: Duration,
        key_prefix: &str,
        test_clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, StoreError> {
        let mut config =
            Config::from_url(url).map_err(|e| StoreError::Connection(e.details().to_string()))?;
        // Retry the first connection like any other instead of failing startup.
        config.fail_fast = false;
        let connection = ConnectionConfig {
            connection_timeout: CONNECT_TIMEOUT,
            internal_command_timeout: CONNECT_TIMEOUT,
            // A command that fails mid-reconnect is the caller's failure mode, not a retry.
            max_command_attempts: 1,
            // A stalled server (SIGSTOP, a full network buffer) looks connected; drop it.
            unresponsive: UnresponsiveConfig {
                max_timeout: Some(CONNECT_TIMEOUT.max(timeout * 4)),
                interval: Duration::from_millis(250),
            },
            ..ConnectionConfig::default()
        };
        let performance = PerformanceConfig {
            // fred drops a command that timed out before it is written, so a request that has
            // already failed open never consumes later.
            default_command_timeout: timeout,
            ..PerformanceConfig::default()
        };
        let pool = Builder::from_config(config)
            .set_connection_config(connection)
            .set_performance_config(performance)
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 1_000, 2))
            .build_pool(pool_size)
            .map_err(|e| StoreError::Connection(e.details().to_string()))?;
        // Drives the connections (and reconnections) until `quit`.
        drop(pool.connect());
        let shared = Arc::new(Shared {
            pool,
            sha: OnceLock::new(),
            key_prefix: key_prefix.to_string(),
            timeout,
            breaker: Breaker::default(),
            ready: AtomicBool::new(false),
            last_error_log_ms: AtomicU64::new(0),
            started: Instant::now(),
            test_clock,
        });
        tokio::spawn(probe(Arc::downgrade(&shared)));
        log_connection_errors(&shared);
        Ok(RedisStore { shared })
    }

    /// Whether Redis answered the last probe and holds the script (for `/readyz`).
    pub fn is_ready(&self) -> bool {
        self.shared.ready.load(Ordering::Relaxed)
    }

    /// Waits until the store is ready, for tests and startup logs.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !self.is_ready() {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// The Redis key of a check: `key_prefix{identity}:kind`. The hash tag puts each counter in
    /// one Cluster slot; the kind suffix keeps one data type per key, and for the bucketed window
    /// the bucket width too (bucket indexes mean nothing under another width).
    pub fn redis_key(&self, check: &Check<'_>) -> String {
        let prefix = &self.shared.key_prefix;
        let mut key = String::with_capacity(prefix.len() + check.key.len() + 24);
        key.push_str(prefix);
        key.push('{');
        escape_tag(check.key, &mut key);
        key.push_str("}:");
        key.push_str(check.rule.kind());
        if let Rule::SlidingWindow(sw) = check.rule {
            if sw.buckets > 0 {
                // Infallible for a String.
                let _ = write!(key, ":{}:{}", sw.window_us, sw.buckets);
            }
        }
        key
    }

    /// Checks every counter in one script call, consuming from all only if all allow.
    pub async fn check(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        if checks.is_empty() {
            return Ok(Decision::from_outcomes(Vec::new()));
        }
        let shared = &self.shared;
        let admission = shared.breaker.admit(shared.now_ms());
        if admission == Admission::Skip {
            return Err(StoreError::CircuitOpen);
        }
        let result = if shared.pool.clients().iter().any(|c| c.is_connected()) {
            self.evaluate(checks).await
        } else {
            Err(StoreError::Connection("not connected".to_string()))
        };
        match &result {
            Err(StoreError::Timeout(_) | StoreError::Connection(_)) => {
                if shared
                    .breaker
                    .failure(shared.now_ms(), admission == Admission::Probe)
                {
                    tracing::warn!(
                        cool_down = ?super::breaker::COOL_DOWN,
                        "redis keeps failing; skipping it between probes"
                    );
                }
            }
            _ => shared.breaker.success(),
        }
        result
    }

    /// At most `timeout`: the usual single `EVALSHA` is bounded by fred's command timeout (which
    /// also keeps a timed-out command from being written later), a reload and retry by what is
    /// left of it.
    async fn evaluate(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        let shared = &self.shared;
        let started = Instant::now();
        let first = match shared.sha.get() {
            Some(sha) => {
                let reply: Result<Vec<i64>, FredError> = shared
                    .pool
                    .evalsha(sha.clone(), self.keys(checks), self.args(checks))
                    .await;
                match reply {
                    // Redis restarted or failed over and lost its script cache.
                    Err(e) if e.details().starts_with("NOSCRIPT") => None,
                    other => Some(other),
                }
            }
            None => None,
        };
        let reply = match first {
            Some(reply) => reply,
            None => {
                let left = shared.timeout.saturating_sub(started.elapsed());
                let retry = async {
                    let sha = shared.load_script().await?;
                    shared
                        .pool
                        .evalsha(sha, self.keys(checks), self.args(checks))
                        .await
                };
                match tokio::time::timeout(left, retry).await {
                    Ok(reply) => reply,
                    Err(_) => return Err(StoreError::Timeout(shared.timeout)),
                }
            }
        };
        decode(&reply.map_err(|e| shared.classify(e))?, checks.len())
    }

    fn keys(&self, checks: &[Check<'_>]) -> Vec<Key> {
        checks
            .iter()
            .map(|c| Key::from(self.redis_key(c)))
            .collect()
    }

    /// `now`, then `kind, p1, p2, p3, cost, shadow` per check, as `scripts/decide.lua` reads
    /// them.
    fn args(&self, checks: &[Check<'_>]) -> Vec<Value> {
        let int = |v: u64| Value::Integer(i64::try_from(v).unwrap_or(i64::MAX));
        let mut args = Vec::with_capacity(1 + 6 * checks.len());
        args.push(match &self.shared.test_clock {
            Some(clock) => int(clock.now_us()),
            None => Value::from_static_str(""),
        });
        for check in checks {
            match check.rule {
                Rule::TokenBucket(tb) => {
                    args.push(Value::from_static_str("tb"));
                    // Rust prints the shortest decimal that parses back to the same double.
                    args.push(Value::Double(tb.rate));
                    args.push(int(tb.burst));
                    args.push(Value::Integer(0));
                }
                Rule::SlidingWindow(sw) => {
                    args.push(Value::from_static_str("sw"));
                    args.push(int(sw.limit));
                    args.push(int(sw.window_us));
                    args.push(int(u64::from(sw.buckets)));
                }
            }
            args.push(int(check.cost));
            args.push(Value::Integer(i64::from(check.shadow)));
        }
        args
    }
}

impl Shared {
    /// Which kind of failure a fred error is: only unavailability trips the breaker.
    fn classify(&self, e: FredError) -> StoreError {
        let details = e.details();
        match e.kind() {
            ErrorKind::Timeout => StoreError::Timeout(self.timeout),
            ErrorKind::IO | ErrorKind::Canceled | ErrorKind::Backpressure | ErrorKind::Routing => {
                StoreError::Connection(details.to_string())
            }
            // A replica being promoted, a server loading its dataset: it will be back.
            _ if details.starts_with("LOADING") || details.starts_with("MASTERDOWN") => {
                StoreError::Connection(details.to_string())
            }
            _ => StoreError::Script(details.to_string()),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// `SCRIPT LOAD`, remembering the SHA Redis computed (it never changes for the same text).
    async fn load_script(&self) -> Result<fred::bytes_utils::Str, FredError> {
        let sha: fred::bytes_utils::Str = self.pool.script_load(DECIDE_LUA).await?;
        Ok(self.sha.get_or_init(|| sha).clone())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Stop the connection tasks, which would otherwise reconnect forever.
        let pool = self.pool.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = pool.quit().await;
            });
        }
    }
}

/// Keeps `ready` current and the script loaded, until the store is dropped. Logs transitions only.
async fn probe(store: Weak<Shared>) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The state last logged: the first probe always logs, so startup with Redis down is visible.
    let mut logged = None;
    loop {
        tick.tick().await;
        let Some(shared) = store.upgrade() else {
            return;
        };
        let limit = shared.timeout.max(Duration::from_millis(250));
        let reachable = shared.pool.clients().iter().any(|c| c.is_connected())
            && matches!(
                tokio::time::timeout(limit, script_cached(&shared)).await,
                Ok(Ok(()))
            );
        if reachable {
            // Redis is back: stop skipping it now rather than after the next request probe.
            shared.breaker.success();
        }
        shared.ready.store(reachable, Ordering::Relaxed);
        if logged != Some(reachable) {
            logged = Some(reachable);
            if reachable {
                tracing::info!("redis store is reachable");
            } else {
                tracing::warn!("redis store is unreachable; routes apply their failure_mode");
            }
        }
    }
}

/// Logs why connections fail (refused, wrong password, TLS), at most once per
/// [`ERROR_LOG_EVERY`]: fred reconnects forever, and an outage must not flood the log.
fn log_connection_errors(shared: &Arc<Shared>) {
    for client in shared.pool.clients() {
        let mut errors = client.error_rx();
        let store = Arc::downgrade(shared);
        tokio::spawn(async move {
            loop {
                let (error, server) = match errors.recv().await {
                    Ok(event) => event,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    // The pool quit.
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                };
                let Some(shared) = store.upgrade() else {
                    return;
                };
                let now = shared.now_ms() + 1;
                let last = shared.last_error_log_ms.load(Ordering::Relaxed);
                let due = last == 0 || now >= last + ERROR_LOG_EVERY.as_millis() as u64;
                if due
                    && shared
                        .last_error_log_ms
                        .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                {
                    let server = server.map(|s| s.to_string()).unwrap_or_default();
                    tracing::warn!(%server, error = %error.details(), "redis connection failed");
                }
            }
        });
    }
}

/// Makes sure Redis holds the script, loading it when a restart emptied the cache.
async fn script_cached(shared: &Shared) -> Result<(), FredError> {
    if let Some(sha) = shared.sha.get() {
        let exists: Vec<bool> = shared.pool.script_exists(sha.clone()).await?;
        if exists.first() == Some(&true) {
            return Ok(());
        }
    }
    shared.load_script().await.map(|_| ())
}

/// Whether `url` can be used, so a bad one is a config error (with its line) rather than a store
/// that never connects. The message never repeats the URL, which may hold a password.
pub fn check_url(url: &str) -> Result<(), String> {
    Config::from_url(url)
        .map(|_| ())
        .map_err(|e| format!("is not a valid Redis URL: {}", e.details()))
}

/// Cluster hash tags end at the first `}`: keep braces (and the escape character itself) out of
/// the tag, injectively, so distinct identities stay distinct keys.
fn escape_tag(identity: &str, out: &mut String) {
    if !identity.bytes().any(|b| matches!(b, b'{' | b'}' | b'%')) {
        out.push_str(identity);
        return;
    }
    for c in identity.chars() {
        match c {
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
}

fn decode(reply: &[i64], checks: usize) -> Result<Decision, StoreError> {
    if reply.len() != 1 + 5 * checks {
        return Err(StoreError::Script(format!(
            "decide.lua answered {} values for {checks} checks",
            reply.len()
        )));
    }
    let unsigned =
        |v: i64| u64::try_from(v).map_err(|_| StoreError::Script(format!("negative value {v}")));
    let mut outcomes = Vec::with_capacity(checks);
    for o in reply[1..].chunks_exact(5) {
        outcomes.push(Outcome {
            allowed: o[0] != 0,
            limit: unsigned(o[1])?,
            remaining: unsigned(o[2])?,
            reset_us: unsigned(o[3])?,
            retry_after_us: unsigned(o[4])?,
        });
    }
    Ok(Decision {
        allowed: reply[0] != 0,
        outcomes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_escaping_is_injective_and_brace_free() {
        let mut a = String::new();
        escape_tag("r:p:{x}", &mut a);
        let mut b = String::new();
        escape_tag("r:p:%7Bx%7D", &mut b);
        assert_eq!(a, "r:p:%7Bx%7D");
        assert_eq!(b, "r:p:%257Bx%257D");
        assert!(!a.contains(['{', '}']));
    }

    #[test]
    fn decode_rejects_a_short_reply() {
        assert!(matches!(
            decode(&[1, 1, 5, 4], 1),
            Err(StoreError::Script(_))
        ));
        let d = decode(&[0, 1, 5, 4, 1_000_000, 0], 1).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.outcomes[0].remaining, 4);
    }
}
