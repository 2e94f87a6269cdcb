//! The Redis store: counters shared by every gateway instance, one atomic script call per request.
//!
//! Each decision is one `EVALSHA` of `scripts/decide.lua` carrying every check of the request, so
//! it costs one round trip whatever the number of policies, and is all-or-nothing inside Redis.
//! The script reads Redis `TIME`: gateway clocks never matter. fred pipelines concurrent commands
//! on each of the `pool_size` connections. `rediss://` URLs use rustls with the system's roots
//! (or the file named by `SSL_CERT_FILE`).
//!
//! Failure is bounded and cheap: a decision gives up after `timeout`, a disconnected pool fails at
//! once, and after repeated failures a [`Breaker`] skips Redis for a cool-down (on a Cluster, one
//! breaker per master, skipping only that master's slots: `cluster.rs`). The gateway starts
//! with Redis down; a background probe keeps [`RedisStore::is_ready`] current and reloads the
//! script after a restart (a `NOSCRIPT` answer also reloads it and retries once). On a Cluster,
//! the store follows `MOVED` and `ASK` itself (`ask.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use fred::prelude::{
    Builder, ClientLike, ConnectionConfig, Error as FredError, ErrorKind, FromValue, Key,
    LuaInterface, PerformanceConfig, Pool, ReconnectPolicy, TcpConfig, Value,
};
use fred::types::config::{Options, UnresponsiveConfig};

mod ask;
mod batch;
mod cluster;
mod health;
mod overrides;
pub mod quota;
mod target;
mod wake;
mod wire;

pub use target::{parse_node, Auth, Target};

use super::breaker::{Admission, Breaker};
use super::lease_queue::{Enqueued, Ticket};
use super::{Check, Clock, Decision, Rule, StoreError};

/// The decision script; `docs/algorithms.md` in Lua.
pub const DECIDE_LUA: &str = include_str!("../../../scripts/decide.lua");

/// How long a connection attempt may take (fred's default is 10 s).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long the gateway waits at startup for the store's first connection before it serves
/// anyway (under the routes' failure modes): a store that is merely connecting must not turn
/// the first requests into fail-open or fail-closed decisions.
pub const STARTUP_WAIT: Duration = Duration::from_secs(5);

/// Counters in Redis, for many gateway instances.
pub struct RedisStore {
    shared: Arc<Shared>,
}

struct Shared {
    pool: Pool,
    /// The script's SHA1, as Redis reported it when the script was first loaded.
    sha: OnceLock<fred::bytes_utils::Str>,
    key_prefix: String,
    /// Redis Cluster: a request whose counters span slots takes one call per slot (`cluster.rs`).
    cluster: bool,
    /// Redis Cluster: connections to importing and new owner nodes, to follow `ASK` and `MOVED`
    /// (`ask.rs`).
    nodes: Option<ask::Nodes>,
    /// Redis Cluster: each master's connections and breaker; every script call goes to its
    /// slot's master there (`cluster.rs`).
    shards: Option<cluster::Shards>,
    timeout: Duration,
    /// One server or Sentinel's master; a Cluster has one per master instead (`cluster.rs`).
    breaker: Breaker,
    /// Set by the background probe: Redis answered and holds the script.
    ready: AtomicBool,
    /// When a connection error was last logged (ms since `started`, offset by one so 0 is never).
    last_error_log_ms: AtomicU64,
    /// The origin of the breaker's millisecond clock.
    started: Instant,
    /// Tests only: pass this clock's time as `now` instead of letting the script read `TIME`.
    test_clock: Option<Arc<dyn Clock>>,
    /// Concurrent decisions, queued for shared script calls (one server; `batch.rs`).
    batcher: batch::Batcher,
    /// Bumped whenever Redis may have lost counters (a failed or re-established connection, an
    /// empty script cache): the engine's deny cache trusts no refusal from an earlier epoch.
    epoch: AtomicU64,
    /// The requests of this instance waiting for a lease, and the subscriber that wakes them.
    wake: wake::Wake,
    /// The quota leases' own connection (`quota.rs`), made on first use: a `WAIT` on it never
    /// holds back a decision.
    quota: OnceLock<fred::clients::Client>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("key_prefix", &self.shared.key_prefix)
            .field("timeout", &self.shared.timeout)
            .field("ready", &self.shared.ready.load(Ordering::Relaxed))
            .field("circuit_open", &self.circuit_open())
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
        Self::start(
            &Target::Url(url.to_string()),
            pool_size,
            timeout,
            key_prefix,
            None,
        )
    }

    /// [`RedisStore::connect`] to any [`Target`]: one server, a Cluster, or Sentinel's master.
    pub fn connect_to(
        target: &Target,
        pool_size: usize,
        timeout: Duration,
        key_prefix: &str,
    ) -> Result<Self, StoreError> {
        Self::start(target, pool_size, timeout, key_prefix, None)
    }

    /// For the conformance suite only: the script uses `clock` instead of Redis `TIME`, so a test
    /// can replay exact timestamps. Never in production, where instances' clocks would matter.
    pub fn connect_with_test_clock(
        url: &str,
        timeout: Duration,
        key_prefix: &str,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        Self::start(
            &Target::Url(url.to_string()),
            1,
            timeout,
            key_prefix,
            Some(clock),
        )
    }

    /// [`RedisStore::connect_with_test_clock`] on any [`Target`] (the cluster tests).
    pub fn connect_to_with_test_clock(
        target: &Target,
        timeout: Duration,
        key_prefix: &str,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        Self::start(target, 1, timeout, key_prefix, Some(clock))
    }

    fn start(
        target: &Target,
        pool_size: usize,
        timeout: Duration,
        key_prefix: &str,
        test_clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, StoreError> {
        let mut config = target.config().map_err(StoreError::Connection)?;
        // Retry the first connection like any other instead of failing startup.
        config.fail_fast = false;
        let connection = ConnectionConfig {
            connection_timeout: CONNECT_TIMEOUT,
            internal_command_timeout: CONNECT_TIMEOUT,
            // A command that fails mid-reconnect is the caller's failure mode, not a retry. On a
            // Cluster, fred counts every write of a command as an attempt, the rewrite after
            // `MOVED` too: allow a chain of redirections, still within `timeout`. A retry after a
            // broken connection can then consume twice: fewer admissions, never more.
            max_command_attempts: if target.is_cluster() { 3 } else { 1 },
            // fred 10.1 follows `ASK` wrongly (`ask.rs`): follow no redirection in fred; the
            // store's calls go to each master on its own connections and follow both.
            max_redirections: 0,
            // A stalled server (SIGSTOP, a full network buffer) looks connected; drop it.
            unresponsive: UnresponsiveConfig {
                max_timeout: Some(CONNECT_TIMEOUT.max(timeout * 4)),
                interval: Duration::from_millis(250),
            },
            // Small pipelined writes must not wait for ACKs (Nagle is on by default in fred).
            tcp: TcpConfig {
                nodelay: Some(true),
                ..TcpConfig::default()
            },
            ..ConnectionConfig::default()
        };
        let performance = PerformanceConfig {
            // fred drops a command that timed out before it is written, so a request that has
            // already failed open never consumes later.
            default_command_timeout: timeout,
            ..PerformanceConfig::default()
        };
        let nodes = target.is_cluster().then(|| {
            let single = ConnectionConfig {
                max_command_attempts: 1,
                ..connection.clone()
            };
            (
                ask::Nodes::new(config.clone(), single.clone(), performance.clone()),
                cluster::Shards::new(config.clone(), single, performance.clone(), pool_size),
            )
        });
        let (nodes, shards) = match nodes {
            Some((nodes, shards)) => (Some(nodes), Some(shards)),
            None => (None, None),
        };
        let wake = wake::Wake::new(config.clone(), connection.clone(), key_prefix);
        let pool = Builder::from_config(config)
            .set_connection_config(connection)
            .set_performance_config(performance)
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 1_000, 2))
            .build_pool(pool_size)
            .map_err(|e| StoreError::Connection(e.details().to_string()))?;
        // Drives the connections (and reconnections) until `quit`.
        drop(pool.connect());
        let shared = Arc::new_cyclic(|weak| Shared {
            batcher: {
                let (batcher, drain) = batch::Batcher::start(weak.clone(), timeout);
                tokio::spawn(drain);
                batcher
            },
            pool,
            sha: OnceLock::new(),
            key_prefix: key_prefix.to_string(),
            cluster: target.is_cluster(),
            nodes,
            shards,
            timeout,
            breaker: Breaker::default(),
            ready: AtomicBool::new(false),
            last_error_log_ms: AtomicU64::new(0),
            started: Instant::now(),
            test_clock,
            epoch: AtomicU64::new(0),
            wake,
            quota: OnceLock::new(),
        });
        tokio::spawn(health::probe(Arc::downgrade(&shared)));
        health::log_connection_errors(&shared);
        Ok(RedisStore { shared })
    }

    /// See [`crate::limiter::Store::epoch`].
    pub fn epoch(&self) -> u64 {
        self.shared.epoch.load(Ordering::Relaxed)
    }

    /// Whether the breaker skips Redis: on a Cluster, any master's.
    fn circuit_open(&self) -> bool {
        match &self.shared.shards {
            Some(shards) => shards.masters().iter().any(|m| m.breaker.is_open()),
            None => self.shared.breaker.is_open(),
        }
    }

    /// Whether Redis answered the last probe and holds the script (for `/readyz`).
    pub fn is_ready(&self) -> bool {
        self.shared.ready.load(Ordering::Relaxed)
    }

    /// Waits (checking actively, not at the probe's pace) until the store can decide, at most
    /// `limit`: the gateway calls it before it accepts requests, tests before they count.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, health::check(&self.shared))
                .await
                .unwrap_or(false)
            {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The Redis key of a check: see [`wire::key`].
    pub fn redis_key(&self, check: &Check<'_>) -> String {
        wire::key(&self.shared.key_prefix, check)
    }

    fn keys(&self, checks: &[Check<'_>]) -> Vec<Key> {
        checks
            .iter()
            .map(|c| Key::from(self.redis_key(c)))
            .collect()
    }

    fn args(&self, checks: &[Check<'_>], lease: u64) -> Vec<Value> {
        wire::args(self.test_now(), checks, lease)
    }

    fn test_now(&self) -> Option<u64> {
        self.shared.test_clock.as_ref().map(|c| c.now_us())
    }

    /// Checks every counter in one script call, consuming from all only if all allow.
    pub async fn check(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        self.check_leased(checks, 0).await
    }

    /// Consumes every check's cost whatever the counters hold (cost from the response): one call,
    /// or on a Cluster one per check (a charge needs no atomicity across keys).
    pub async fn charge(&self, checks: &[Check<'_>]) -> Result<(), StoreError> {
        let now = self.test_now();
        self.per_slot(checks, |subset| wire::charge_args(now, subset))
            .await
    }

    /// Every check's state, read by decide.lua's `peek` entry, which writes nothing (no key,
    /// member or TTL): one call, or on a Cluster one per check, concurrently (a read needs no
    /// atomicity across slots). See [`crate::limiter::Store::peek`].
    pub async fn peek(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        if checks.is_empty() {
            return Ok(Decision::from_outcomes(super::Outcomes::new()));
        }
        if !self.shared.cluster && !self.shared.pool.clients().iter().any(|c| c.is_connected()) {
            return Err(StoreError::Connection("not connected".to_string()));
        }
        let now = self.test_now();
        let groups: Vec<&[Check<'_>]> = if self.shared.cluster {
            checks.chunks(1).collect()
        } else {
            vec![checks]
        };
        let calls = groups.into_iter().map(|group| async move {
            let reply = self
                .shared
                .run(|| (self.keys(group), wire::peek_args(now, group)))
                .await?;
            wire::decode(&reply, group.len())
        });
        let mut outcomes = super::Outcomes::with_capacity(checks.len());
        for decision in futures_util::future::join_all(calls).await {
            outcomes.extend(decision?.outcomes);
        }
        Ok(Decision::from_checks(checks, outcomes))
    }

    /// Gives back every check's `cost` from the consumption its stamp names (decide.lua's
    /// `refund`: a bucket's tokens capped at the burst, an exact window's member of that time, a
    /// bucketed window's bucket, a quota's count while it is still in that period); concurrency
    /// checks are skipped. One call, or on a Cluster one per check.
    pub async fn refund(&self, checks: &[(Check<'_>, u64)]) -> Result<(), StoreError> {
        let due: Vec<(Check<'_>, [i64; 2])> = checks
            .iter()
            .filter(|(c, _)| c.cost > 0 && !matches!(c.rule, crate::limiter::Rule::Concurrency(_)))
            .map(|(c, stamp)| (*c, [i64::try_from(*stamp).unwrap_or(i64::MAX), 0]))
            .collect();
        self.per_slot_of(&due, |(c, _)| *c, wire::refund_args).await
    }

    /// Gives back a delayed decision's reservation at slot `at` (decide.lua's refund): every
    /// token bucket's cost, and what every window recorded at the slot (an exact window's
    /// member at `at`, a bucketed window's bucket of `at`, a paced quota's units in the period
    /// its stamp names). One call, or on a Cluster one per check. See
    /// [`crate::limiter::Store::unreserve`].
    pub async fn unreserve(&self, checks: &[(Check<'_>, u64)], at: u64) -> Result<(), StoreError> {
        let due: Vec<(Check<'_>, [i64; 2])> = checks
            .iter()
            .filter(|(c, _)| c.cost > 0)
            .filter_map(|(c, stamp)| Some((*c, wire::unreserve_stamp(c, *stamp, at)?)))
            .collect();
        self.per_slot_of(&due, |(c, _)| *c, wire::refund_args).await
    }

    /// Releases lease `lease` on every concurrency check of `checks`, or takes a waiter's
    /// `ticket` out of the queue ("" for a request that held its lease), handing each lease
    /// that comes free to the oldest live ticket (decide.lua's `release`). One call, or on a
    /// Cluster one per check (a key and its queue share a slot). Returns the leases handed on.
    pub async fn release(
        &self,
        checks: &[Check<'_>],
        lease: u64,
        ticket: &str,
    ) -> Result<Vec<u64>, StoreError> {
        let leased: Vec<Check<'_>> = checks
            .iter()
            .filter(|c| matches!(c.rule, Rule::Concurrency(_)))
            .copied()
            .collect();
        if leased.is_empty() {
            return Ok(Vec::new());
        }
        if !ticket.is_empty() {
            self.shared.wake.forget(lease);
        }
        let groups: Vec<&[Check<'_>]> = if self.shared.cluster {
            leased.chunks(1).collect()
        } else {
            vec![&leased[..]]
        };
        let now = self.test_now();
        let calls = groups.into_iter().map(|group| async move {
            let reply = self
                .shared
                .run(|| {
                    let mut keys = Vec::with_capacity(2 * group.len());
                    for check in group {
                        let key = self.redis_key(check);
                        let queue = format!("{key}{}", wire::QUEUE_SUFFIX);
                        keys.push(Key::from(key));
                        keys.push(Key::from(queue));
                    }
                    let args =
                        wire::release_args(now, &self.shared.wake.prefix, group, lease, ticket);
                    (keys, args)
                })
                .await?;
            Ok::<_, StoreError>(
                reply
                    .into_iter()
                    .skip(1)
                    .map(|id| id as u64)
                    .collect::<Vec<_>>(),
            )
        });
        let mut handed = Vec::new();
        for reply in futures_util::future::join_all(calls).await {
            handed.extend(reply?);
        }
        Ok(handed)
    }

    /// Waits for a lease on the concurrency check `check` (decide.lua's `enqueue`): taken under
    /// `lease` when one is free and nobody queues before it, else a ticket queued for
    /// `max_delay_us`, whose hand-off this instance's subscriber hears (`wake.rs`).
    pub async fn enqueue(
        &self,
        check: &Check<'_>,
        lease: u64,
        max_delay_us: u64,
    ) -> Result<Enqueued, StoreError> {
        if !matches!(check.rule, Rule::Concurrency(_)) {
            return Ok(Enqueued::Refused);
        }
        let wake = &self.shared.wake;
        match tokio::time::timeout(CONNECT_TIMEOUT * 2, wake.ready()).await {
            Ok(ready) => ready?,
            Err(_) => return Err(StoreError::Timeout(CONNECT_TIMEOUT * 2)),
        }
        let woken = wake.register(lease);
        let key = self.redis_key(check);
        let queue = format!("{key}{}", wire::QUEUE_SUFFIX);
        let args = wire::enqueue_args(
            self.test_now(),
            &wake.prefix,
            check,
            lease,
            max_delay_us,
            &wake.instance,
        );
        let reply = self
            .shared
            .run(|| {
                let keys = vec![Key::from(key.as_str()), Key::from(queue.as_str())];
                (keys, args.clone())
            })
            .await;
        match reply.as_deref() {
            Ok([0, deadline]) => {
                let name = format!("{lease}:{deadline}:{}", wake.instance);
                Ok(Enqueued::Queued(Ticket::new(woken, name)))
            }
            Ok([1, _]) => {
                wake.forget(lease);
                Ok(Enqueued::Granted)
            }
            Ok(_) => {
                wake.forget(lease);
                Err(StoreError::Script("enqueue: unexpected reply".to_string()))
            }
            Err(_) => {
                // The script may have run (a timeout): the ticket then expires by its
                // deadline, and a lease handed to it by the lease TTL.
                wake.forget(lease);
                reply.map(|_| Enqueued::Refused)
            }
        }
    }

    /// Requests of this instance waiting for a lease now (tests).
    pub fn lease_waiters(&self) -> usize {
        self.shared.wake.waiting()
    }

    /// Extends lease `lease` on every concurrency check of `checks` (a request still running).
    pub async fn renew(&self, checks: &[Check<'_>], lease: u64) -> Result<(), StoreError> {
        let now = self.test_now();
        self.per_slot(checks, |subset| wire::renew_args(now, subset, lease))
            .await
    }

    /// One script call with `args` over all `checks`, or on a Cluster one per check, concurrently.
    async fn per_slot(
        &self,
        checks: &[Check<'_>],
        args: impl Fn(&[Check<'_>]) -> Vec<Value>,
    ) -> Result<(), StoreError> {
        self.per_slot_of(checks, |c| *c, args).await
    }

    /// [`RedisStore::per_slot`] over items that each carry a check (`check` finds it) and
    /// whatever else their call needs (a refund's stamp).
    async fn per_slot_of<'c, T>(
        &self,
        items: &[T],
        check: impl Fn(&T) -> Check<'c>,
        args: impl Fn(&[T]) -> Vec<Value>,
    ) -> Result<(), StoreError> {
        if items.is_empty() {
            return Ok(());
        }
        let groups: Vec<&[T]> = if self.shared.cluster {
            items.chunks(1).collect()
        } else {
            vec![items]
        };
        let calls = groups.into_iter().map(|group| {
            let (args, check) = (&args, &check);
            async move {
                self.shared
                    .run(|| {
                        let checks: Vec<Check<'_>> = group.iter().map(check).collect();
                        (self.keys(&checks), args(group))
                    })
                    .await
                    .map(|_| ())
            }
        });
        futures_util::future::join_all(calls)
            .await
            .into_iter()
            .collect()
    }

    /// [`RedisStore::check`], a concurrency check that commits taking lease `lease`.
    pub async fn check_leased(
        &self,
        checks: &[Check<'_>],
        lease: u64,
    ) -> Result<Decision, StoreError> {
        if checks.is_empty() {
            return Ok(Decision::from_outcomes(super::Outcomes::new()));
        }
        let shared = &self.shared;
        if shared.cluster {
            // A breaker per master, in each call (`cluster.rs`). Boxed: inline, its per-slot
            // calls would make every single-server decision's future kilobytes larger.
            return Box::pin(cluster::check(self, checks, lease)).await;
        }
        let admission = shared.breaker.admit(shared.now_ms());
        if admission == Admission::Skip {
            return Err(StoreError::CircuitOpen);
        }
        let result = if !shared.pool.clients().iter().any(|c| c.is_connected()) {
            Err(StoreError::Connection("not connected".to_string()))
        } else {
            self.evaluate(checks, lease).await
        };
        match &result {
            // The store answered: a multi-key call mid-migration, not an outage.
            Err(StoreError::Connection(m)) if m.starts_with("TRYAGAIN") => {}
            Err(StoreError::Timeout(_) | StoreError::Connection(_)) => {
                shared.lost_state();
                if shared
                    .breaker
                    .failure(shared.now_ms(), admission == Admission::Probe)
                {
                    tracing::warn!(
                        cool_down = ?crate::limiter::breaker::COOL_DOWN,
                        "redis keeps failing; skipping it between probes"
                    );
                }
            }
            _ => shared.breaker.success(),
        }
        result
    }

    /// One decision for all `checks` on one server, in a script call it may share with other
    /// requests' decisions (`batch.rs`).
    async fn evaluate(&self, checks: &[Check<'_>], lease: u64) -> Result<Decision, StoreError> {
        let timeout = self.shared.timeout;
        let (reply, answer) = tokio::sync::oneshot::channel();
        let prefix = &self.shared.key_prefix;
        let names: usize = checks.iter().map(|c| wire::key_len(prefix, c)).sum();
        let mut wire = Vec::with_capacity(16 + 48 * checks.len() + names);
        wire::pack(self.test_now(), checks, lease, &mut wire);
        let packed_len = wire.len();
        let mut key_ends = smallvec::SmallVec::with_capacity(checks.len());
        for check in checks {
            wire::push_key(prefix, check, &mut wire);
            key_ends.push(wire.len());
        }
        let job = batch::Job {
            wire,
            packed_len,
            key_ends,
            deadline: Instant::now() + timeout,
            reply,
        };
        if !self.shared.batcher.submit(job) {
            return Err(StoreError::Connection("store shut down".to_string()));
        }
        // No timer here: the batch answers every decision by its deadline, sent or not (`batch.rs`).
        match answer.await {
            Ok(decision) => decision,
            // Dropped unsent: its deadline passed while it waited for a call.
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }
}

/// Answers that mean "not now" rather than "wrong": a server loading its dataset, a replica
/// waiting for its master, a Cluster slot without a master or moving.
const UNAVAILABLE: [&str; 7] = [
    "LOADING",
    "MASTERDOWN",
    "READONLY",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "MOVED",
    "ASK",
];

impl Shared {
    /// One call of the script, at most `timeout` in all (a Cluster redirection included): the usual single `EVALSHA` is bounded by
    /// fred's command timeout (which also keeps a timed-out command from being written later).
    /// When the server does not hold the script (a restart, a promoted replica, a Cluster node
    /// that never saw it) the `NOSCRIPT` answer is followed by one `EVAL` of the full text, which
    /// also caches it there, within what is left of the timeout. `call` builds the keys and
    /// arguments, twice in that case.
    async fn run(&self, call: impl Fn() -> (Vec<Key>, Vec<Value>)) -> Result<Vec<i64>, StoreError> {
        self.run_within(self.timeout, call).await
    }

    /// [`Shared::run`] within `budget` (at most `timeout`): a batch may not outlive the earliest
    /// deadline among its decisions.
    async fn run_within<R: FromValue>(
        &self,
        budget: Duration,
        call: impl Fn() -> (Vec<Key>, Vec<Value>),
    ) -> Result<R, StoreError> {
        let started = Instant::now();
        let budget = budget.min(self.timeout);
        if let Some(shards) = &self.shards {
            return cluster::run(self, shards, budget, call).await;
        }
        let first = match self.sha.get() {
            Some(sha) => {
                let (keys, args) = call();
                // One call site: each `.await` of a fred command is kilobytes of future state.
                let options = Options {
                    timeout: Some(budget),
                    ..Options::default()
                };
                let reply = self
                    .pool
                    .with_options(&options)
                    .evalsha::<R, _, _, _>(sha.clone(), keys, args)
                    .await;
                match reply {
                    Err(e) if e.details().starts_with("NOSCRIPT") => {
                        // A server without the script is a restarted (or new) one.
                        self.lost_state();
                        None
                    }
                    other => Some(other),
                }
            }
            None => None,
        };
        let reply = match first {
            Some(reply) => reply,
            None => {
                let left = budget.saturating_sub(started.elapsed());
                let (keys, args) = call();
                // Rare (a server without the script): boxed, so the usual call's future stays small.
                let eval = Box::pin(tokio::time::timeout(
                    left,
                    self.pool.eval(DECIDE_LUA, keys, args),
                ));
                match eval.await {
                    Ok(reply) => reply,
                    Err(_) => return Err(StoreError::Timeout(self.timeout)),
                }
            }
        };
        reply.map_err(|e| self.classify(e))
    }

    /// `EVAL` of a script other than the decision's (the overrides), following a Cluster's
    /// redirections like [`Shared::run`] (on the slot's master, under its breaker), at most
    /// `timeout` in all.
    async fn eval<R: FromValue>(
        &self,
        text: &'static str,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<R, StoreError> {
        if let Some(shards) = &self.shards {
            let lua = ask::Script { sha: None, text };
            let call = || (keys.clone(), args.clone());
            return Box::pin(cluster::run_script(self, shards, self.timeout, lua, call)).await;
        }
        let reply = self.pool.eval(text, keys, args).await;
        reply.map_err(|e| self.classify(e))
    }

    /// Which kind of failure a fred error is: only unavailability trips the breaker.
    fn classify(&self, e: FredError) -> StoreError {
        let details = e.details();
        match e.kind() {
            ErrorKind::Timeout => StoreError::Timeout(self.timeout),
            ErrorKind::IO
            | ErrorKind::Canceled
            | ErrorKind::Backpressure
            | ErrorKind::Routing
            | ErrorKind::Cluster
            | ErrorKind::Sentinel => StoreError::Connection(details.to_string()),
            _ if UNAVAILABLE.iter().any(|p| details.starts_with(p)) => {
                if details.starts_with("READONLY") {
                    // Sentinel demoted the server we write to without closing our connections:
                    // reconnect, which asks Sentinel for the master again.
                    let pool = self.pool.clone();
                    tokio::spawn(async move {
                        let _ = pool.force_reconnection().await;
                    });
                }
                StoreError::Connection(details.to_string())
            }
            _ => StoreError::Script(details.to_string()),
        }
    }

    /// Redis may have lost counters: see `epoch`.
    fn lost_state(&self) {
        self.epoch.fetch_add(1, Ordering::Relaxed);
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
            let _guard = runtime.enter();
            if let Some(nodes) = &self.nodes {
                nodes.quit();
            }
            if let Some(shards) = &self.shards {
                shards.quit();
            }
            self.wake.quit();
            let quota = self.quota.get().cloned();
            runtime.spawn(async move {
                let _ = pool.quit().await;
                if let Some(quota) = quota {
                    let _ = quota.quit().await;
                }
            });
        }
    }
}

/// Whether `target` can be used, so a bad one is a config error (with its line) rather than a
/// store that never connects. The message never repeats the URL, which may hold a password.
pub fn check_target(target: &Target) -> Result<(), String> {
    target.config().map(|_| ())
}
