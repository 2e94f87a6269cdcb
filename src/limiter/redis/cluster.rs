//! Redis Cluster: a request whose counters live in different slots.
//!
//! A script call may only touch keys of one slot, so all-or-nothing cannot be one call. Each
//! counter's key is hash-tagged, so each counter is atomic in its own slot; a request whose
//! counters share a slot stays one `EVALSHA`, exactly as on one server. Otherwise the checks are
//! grouped by slot and every group is called concurrently (one round trip in wall time). Each
//! group consumes only when all of its own checks allow, so no counter ever goes over its limit.
//! When any group rejects (or fails), the groups that consumed are refunded at once with the
//! script's refund entry, one more concurrent round trip, before the decision is returned. Until
//! the refund lands, a concurrent request may find those units taken and be rejected: a spurious
//! rejection, never an admission over a limit. `docs/redis.md` states this to users.
//!
//! Every call goes to its slot's master on that master's own connections ([`Shards`]), with a
//! [`Breaker`] per master: a master that dies fails (and then skips) only the calls of its own
//! slots. fred's clustered client re-syncs as a whole when one node's connection drops, and
//! stalls every node's commands meanwhile (measured: on a 3-master Cluster with one master
//! SIGKILLed, nearly all decisions on the two healthy masters failed until the replica was
//! promoted); it still discovers the first topology, and is asked for it as a last resort.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use fred::prelude::{
    Builder, ClientLike, ClusterInterface, Config, ConnectionConfig, FromValue, Key, LuaInterface,
    PerformanceConfig, Pool, ReconnectPolicy, ServerConfig, Value,
};
use fred::types::cluster::ClusterRouting;
use fred::types::config::Options;
use fred::types::config::Server;
use fred::util::redis_keyslot;
use futures_util::future::join_all;

use super::{ask, wire, RedisStore, Shared, DECIDE_LUA};
use crate::limiter::breaker::{Admission, Breaker, COOL_DOWN};
use crate::limiter::{Check, Decision, StoreError};

/// Slots of a Redis Cluster.
const SLOTS: usize = 16_384;
/// A slot that no known master serves.
const NO_MASTER: u16 = u16::MAX;

/// One master: its own connections and its own breaker.
pub(super) struct Shard {
    pub server: Server,
    pub pool: Pool,
    pub breaker: Breaker,
    /// When its connections were made: until [`FIRST_CONNECT`] after, a call waits for them.
    made: Instant,
}

/// How long a new master's connections may take before its calls fail at once while they are
/// down (the connect timeout).
const FIRST_CONNECT: Duration = Duration::from_secs(1);

impl Shard {
    /// Whether any of its connections is up (a dead master's are not: its calls fail at once).
    pub fn connected(&self) -> bool {
        self.pool.clients().iter().any(|c| c.is_connected())
    }

    /// Whether its connections are up, waiting up to `limit` for those of a master just added to
    /// the topology (they are being made); a master whose connections went down fails at once.
    pub async fn ready(&self, limit: Duration) -> bool {
        if self.connected() {
            return true;
        }
        if self.made.elapsed() >= FIRST_CONNECT {
            return false;
        }
        let limit = limit.min(FIRST_CONNECT.saturating_sub(self.made.elapsed()));
        matches!(
            tokio::time::timeout(limit, self.pool.wait_for_connect()).await,
            Ok(Ok(()))
        )
    }
}

/// Which master serves each slot, as last read with `CLUSTER SLOTS`.
struct Routing {
    /// Per slot, its master's index in `masters` ([`NO_MASTER`]: none known).
    slots: Vec<u16>,
    masters: Vec<Arc<Shard>>,
}

/// The masters of a Cluster and the slots each serves, read lock-free on every call; replaced as
/// a whole when the topology changes (by the store's probe, at most every 500 ms, and at once
/// after a `MOVED` or a master's failure).
pub(super) struct Shards {
    config: Config,
    connection: ConnectionConfig,
    performance: PerformanceConfig,
    pool_size: usize,
    routing: ArcSwap<Routing>,
    /// Serialises rebuilds (the probe's and a triggered one).
    rebuilding: Mutex<()>,
    /// A call met `MOVED` or a master failed: the probe reads the topology again at once.
    pub stale: AtomicBool,
    pub wake: Arc<tokio::sync::Notify>,
}

impl Shards {
    pub fn new(
        config: Config,
        connection: ConnectionConfig,
        performance: PerformanceConfig,
        pool_size: usize,
    ) -> Shards {
        Shards {
            config,
            connection,
            performance,
            pool_size: pool_size.max(1),
            routing: ArcSwap::from_pointee(Routing {
                slots: Vec::new(),
                masters: Vec::new(),
            }),
            rebuilding: Mutex::new(()),
            stale: AtomicBool::new(false),
            wake: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// The master of `slot`, if one is known.
    pub fn route(&self, slot: u16) -> Option<Arc<Shard>> {
        let routing = self.routing.load();
        let at = *routing.slots.get(usize::from(slot))?;
        routing.masters.get(usize::from(at)).cloned()
    }

    /// Asks for the topology to be read again soon (`MOVED`, a master failing).
    pub fn mark_stale(&self) {
        if !self.stale.swap(true, Ordering::Relaxed) {
            self.wake.notify_one();
        }
    }

    /// Every known master, for asking the topology of.
    pub fn masters(&self) -> Vec<Arc<Shard>> {
        self.routing.load().masters.clone()
    }

    /// Installs `topology` if it differs from the current one. A master that stays keeps its
    /// connections and its breaker; one that is gone has its connections closed.
    pub fn update(&self, topology: &ClusterRouting) -> Result<bool, StoreError> {
        let _one = self.rebuilding.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.routing.load_full();
        let mut servers: Vec<&Server> = Vec::new();
        let mut slots = vec![NO_MASTER; SLOTS];
        for range in topology.slots() {
            let at = match servers.iter().position(|s| **s == range.primary) {
                Some(at) => at,
                None => {
                    servers.push(&range.primary);
                    servers.len() - 1
                }
            };
            let at = u16::try_from(at).unwrap_or(NO_MASTER);
            let (start, end) = (
                usize::from(range.start),
                usize::from(range.end).min(SLOTS - 1),
            );
            if start <= end {
                slots[start..=end].fill(at);
            }
        }
        let same = slots == current.slots
            && servers.len() == current.masters.len()
            && servers
                .iter()
                .zip(&current.masters)
                .all(|(s, m)| **s == m.server);
        if same {
            return Ok(false);
        }
        let mut masters = Vec::with_capacity(servers.len());
        for server in servers {
            let shard = match current.masters.iter().find(|m| m.server == *server) {
                Some(shard) => shard.clone(),
                None => Arc::new(self.connect(server.clone())?),
            };
            masters.push(shard);
        }
        for gone in current.masters.iter() {
            if !masters.iter().any(|m| m.server == gone.server) {
                let pool = gone.pool.clone();
                tokio::spawn(async move { pool.quit().await });
            }
        }
        tracing::debug!(
            masters = ?masters.iter().map(|m| m.server.to_string()).collect::<Vec<_>>(),
            "redis cluster topology"
        );
        self.routing.store(Arc::new(Routing { slots, masters }));
        Ok(true)
    }

    /// Connections to one master, reconnecting (backing off up to 1 s) until it leaves the
    /// topology.
    fn connect(&self, server: Server) -> Result<Shard, StoreError> {
        let config = Config {
            server: ServerConfig::Centralized {
                server: server.clone(),
            },
            ..self.config.clone()
        };
        let pool = Builder::from_config(config)
            .set_connection_config(self.connection.clone())
            .set_performance_config(self.performance.clone())
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 1_000, 2))
            .build_pool(self.pool_size)
            .map_err(|e| StoreError::Connection(e.details().to_string()))?;
        drop(pool.connect());
        Ok(Shard {
            server,
            pool,
            breaker: Breaker::default(),
            made: Instant::now(),
        })
    }

    /// Closes every master's connections (the store is dropped).
    pub fn quit(&self) {
        for shard in self.routing.load().masters.iter() {
            let pool = shard.pool.clone();
            tokio::spawn(async move { pool.quit().await });
        }
    }
}

/// Installs `topology` and, when it changed, waits (up to `limit`) for its masters' connections.
async fn install(
    shards: &Shards,
    topology: &ClusterRouting,
    limit: Duration,
) -> Result<(), StoreError> {
    if shards.update(topology)? {
        let masters = shards.masters();
        let connecting = masters
            .iter()
            .map(|shard| tokio::time::timeout(limit, shard.pool.wait_for_connect()));
        join_all(connecting).await;
    }
    Ok(())
}

/// Reads the topology (`CLUSTER SLOTS`) from the first known master that answers within `limit`,
/// else takes fred's clustered client's view (the first time, before any master is known), and
/// installs it.
pub(super) async fn refresh(
    shards: &Shards,
    pool: &Pool,
    limit: Duration,
) -> Result<(), StoreError> {
    shards.stale.store(false, Ordering::Relaxed);
    for shard in shards.masters() {
        if !shard.connected() || shard.breaker.is_open() {
            continue;
        }
        let asked = tokio::time::timeout(limit, shard.pool.next().cluster_slots::<Value>()).await;
        if let Ok(Ok(slots)) = asked {
            if let Ok(topology) =
                ClusterRouting::from_cluster_slots(slots, shard.server.host.clone())
            {
                if !topology.slots().is_empty() {
                    return install(shards, &topology, limit).await;
                }
            }
        }
    }
    match pool.next().cached_cluster_state() {
        Some(topology) if !topology.slots().is_empty() => install(shards, &topology, limit).await,
        _ => Err(StoreError::Connection(
            "no redis cluster topology yet".to_string(),
        )),
    }
}

/// A consumption to give back: the check's index and the script's stamp for it.
type Consumed = (usize, [i64; 2]);

/// One script call on the master of its keys' slot, at most `budget`, under that master's
/// breaker: a master that is down fails its own calls (at once when its connections are down,
/// then skipped for a cool-down), and no other master's. `NOSCRIPT` is answered by one `EVAL` on
/// the same master, `MOVED` and `ASK` are followed (`ask.rs`).
pub(super) async fn run<R: FromValue>(
    shared: &Shared,
    shards: &Shards,
    budget: Duration,
    call: impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, StoreError> {
    let lua = ask::Script {
        sha: shared.sha.get(),
        text: DECIDE_LUA,
    };
    run_script(shared, shards, budget, lua, call).await
}

/// [`run`] of any script: `EVAL` of its text when `lua` has no SHA (the overrides' scripts).
pub(super) async fn run_script<R: FromValue>(
    shared: &Shared,
    shards: &Shards,
    budget: Duration,
    lua: ask::Script<'_>,
    call: impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, StoreError> {
    let started = Instant::now();
    let (keys, args) = call();
    let slot = keys
        .first()
        .map(|k| redis_keyslot(k.as_bytes()))
        .ok_or_else(|| StoreError::Script("a call without keys".to_string()))?;
    let Some(shard) = shards.route(slot) else {
        shards.mark_stale();
        return Err(StoreError::Connection(format!(
            "no known master serves slot {slot}"
        )));
    };
    let admission = shard.breaker.admit(shared.now_ms());
    if admission == Admission::Skip {
        return Err(StoreError::CircuitOpen);
    }
    let result = if shard.ready(budget).await {
        // Boxed: the redirection and `NOSCRIPT` paths would make every call's future larger.
        Box::pin(tokio::time::timeout(
            budget,
            call_on(shared, &shard, lua, budget, started, (keys, args), &call),
        ))
        .await
        .unwrap_or(Err(StoreError::Timeout(shared.timeout)))
    } else {
        Err(StoreError::Connection(format!(
            "not connected to {}",
            shard.server
        )))
    };
    match &result {
        // The master answered, at once: a multi-key call mid-migration, or the Cluster refusing
        // every command while another shard has no master (full coverage required). Not this
        // master's outage: skipping it would outlast the refusal by a cool-down.
        Err(StoreError::Connection(m))
            if m.starts_with("TRYAGAIN") || m.starts_with("CLUSTERDOWN") => {}
        Err(StoreError::Timeout(_) | StoreError::Connection(_)) => {
            shared.lost_state();
            shards.mark_stale();
            if shard
                .breaker
                .failure(shared.now_ms(), admission == Admission::Probe)
            {
                tracing::warn!(
                    master = %shard.server,
                    cool_down = ?COOL_DOWN,
                    "redis cluster master keeps failing; skipping its slots between probes"
                );
            }
        }
        _ => shard.breaker.success(),
    }
    result
}

/// [`run`]'s call itself: `EVALSHA` on the master's connections, then what its answer asks for.
async fn call_on<R: FromValue>(
    shared: &Shared,
    shard: &Shard,
    lua: ask::Script<'_>,
    budget: Duration,
    started: Instant,
    (keys, args): (Vec<Key>, Vec<Value>),
    call: &impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, StoreError> {
    let options = Options {
        timeout: Some(budget),
        ..Options::default()
    };
    let reply = match lua.sha {
        Some(sha) => {
            let reply = shard
                .pool
                .with_options(&options)
                .evalsha::<R, _, _, _>(sha.clone(), keys, args)
                .await;
            match reply {
                Err(e) if e.details().starts_with("NOSCRIPT") => {
                    // A master without the script is a restarted (or promoted) one.
                    shared.lost_state();
                    None
                }
                other => Some(other),
            }
        }
        None => None,
    };
    let reply = match reply {
        Some(reply) => reply,
        None => {
            let options = Options {
                timeout: Some(budget.saturating_sub(started.elapsed())),
                ..Options::default()
            };
            let (keys, args) = call();
            shard
                .pool
                .with_options(&options)
                .eval::<R, _, _, _>(lua.text, keys, args)
                .await
        }
    };
    match (reply, &shared.nodes) {
        (Err(e), Some(nodes)) if ask::is_redirection(&e) => {
            ask::redirect(shared, nodes, lua, call, Err(e)).await
        }
        (reply, _) => reply.map_err(|e| shared.classify(e)),
    }
}

/// Checks `checks` on a Cluster: one call when they share a slot, else one per slot plus refunds.
pub(super) async fn check(
    store: &RedisStore,
    checks: &[Check<'_>],
    lease: u64,
) -> Result<Decision, StoreError> {
    let keys: Vec<String> = checks.iter().map(|c| store.redis_key(c)).collect();
    let slots: Vec<u16> = keys.iter().map(|k| redis_keyslot(k.as_bytes())).collect();
    if slots.iter().all(|s| *s == slots[0]) {
        let reply = store
            .shared
            .run(|| {
                let keys = keys.iter().map(|k| Key::from(k.as_str()));
                (keys.collect(), store.args(checks, lease))
            })
            .await?;
        return wire::decode(&reply, checks.len());
    }
    // Groups of check indexes, by slot, in order of first appearance.
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        match groups.iter_mut().find(|(s, _)| s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((*slot, vec![i])),
        }
    }
    let now = store.shared.test_clock.as_ref().map(|c| c.now_us());
    let calls = groups.iter().map(|(_, members)| {
        let (keys, subset) = (&keys, subset(checks, members));
        async move {
            let reply = store
                .shared
                .run(|| {
                    let keys = members.iter().map(|&i| Key::from(keys[i].as_str()));
                    (keys.collect(), wire::args(now, &subset, lease))
                })
                .await?;
            wire::decode(&reply, subset.len()).map(|d| (d, reply))
        }
    });
    let replies = join_all(calls).await;

    let mut outcomes = vec![None; checks.len()];
    let mut stamps = vec![0u64; checks.len()];
    // What was consumed, to give back if the request is not admitted.
    let mut consumed: Vec<Consumed> = Vec::new();
    let mut error = None;
    for ((_, members), reply) in groups.iter().zip(replies) {
        match reply {
            Ok((decision, reply)) => {
                for (j, &i) in members.iter().enumerate() {
                    if decision.commits(j) && checks[i].cost > 0 {
                        consumed.push((i, wire::stamp(&reply, members.len(), j)));
                    }
                    outcomes[i] = Some(decision.outcomes[j]);
                    stamps[i] = decision.stamp(j);
                }
            }
            Err(e) => error = error.or(Some(e)),
        }
    }
    let decision = match error {
        Some(e) => Err(e),
        None => match outcomes.into_iter().collect::<Option<Vec<_>>>() {
            Some(outcomes) => Ok(Decision {
                stamps: stamps.into(),
                ..Decision::from_checks(checks, outcomes)
            }),
            None => Err(StoreError::Script("a check without an outcome".to_string())),
        },
    };
    match decision {
        Ok(decision) if decision.allowed => Ok(decision),
        Ok(mut decision) => {
            refund(store, checks, &keys, &consumed).await;
            // The request was not admitted: report what is left without it.
            for (i, _) in &consumed {
                let o = &mut decision.outcomes[*i];
                o.remaining = (o.remaining + checks[*i].cost).min(o.limit);
            }
            Ok(decision)
        }
        Err(e) => {
            refund(store, checks, &keys, &consumed).await;
            Err(e)
        }
    }
}

/// The checks of one slot's call. Their groups decide apart, each at its own node's time, so
/// none can tell the others when a slot is free: a paced check there admits only what needs no
/// wait (`max_delay` 0, `docs/redis.md`), and a request whose counters span slots is never
/// delayed, only admitted now or refused.
fn subset<'a>(checks: &[Check<'a>], members: &[usize]) -> Vec<Check<'a>> {
    members
        .iter()
        .map(|&i| Check {
            max_delay_us: checks[i].max_delay_us.map(|_| 0),
            ..checks[i]
        })
        .collect()
}

/// Gives back every consumption in `consumed` (check index, stamp), one concurrent call per slot,
/// each bounded by the store timeout. A refund that fails leaves those units taken until the
/// counter refills or its window passes: fewer admissions, never more.
async fn refund(store: &RedisStore, checks: &[Check<'_>], keys: &[String], consumed: &[Consumed]) {
    if consumed.is_empty() {
        return;
    }
    let mut groups: Vec<(u16, Vec<Consumed>)> = Vec::new();
    for &(i, stamp) in consumed {
        let slot = redis_keyslot(keys[i].as_bytes());
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push((i, stamp)),
            None => groups.push((slot, vec![(i, stamp)])),
        }
    }
    let calls = groups.iter().map(|(_, members)| {
        let entries: Vec<(Check<'_>, [i64; 2])> =
            members.iter().map(|&(i, s)| (checks[i], s)).collect();
        async move {
            store
                .shared
                .run(|| {
                    let keys = members.iter().map(|&(i, _)| Key::from(keys[i].as_str()));
                    (keys.collect(), wire::refund_args(&entries))
                })
                .await
        }
    });
    for result in join_all(calls).await {
        if let Err(e) = result {
            tracing::debug!(error = %e, "refund of a multi-slot request failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `CLUSTER SLOTS` as Redis answers it: per range, its bounds and its master.
    fn topology(ranges: &[(i64, i64, i64)]) -> ClusterRouting {
        let ranges = ranges
            .iter()
            .map(|&(start, end, port)| {
                let master = vec![
                    Value::from("127.0.0.1"),
                    Value::Integer(port),
                    Value::from(format!("node-{port}")),
                ];
                Value::Array(vec![
                    Value::Integer(start),
                    Value::Integer(end),
                    Value::Array(master),
                ])
            })
            .collect();
        ClusterRouting::from_cluster_slots(Value::Array(ranges), "127.0.0.1").expect("slots")
    }

    fn shards() -> Shards {
        let config = Config::default();
        Shards::new(
            config,
            ConnectionConfig::default(),
            PerformanceConfig::default(),
            1,
        )
    }

    /// Each slot routes to its own master; a failover replaces only the failed master, whose
    /// successor starts with a closed breaker, and the masters that stay keep theirs.
    #[tokio::test]
    async fn a_failover_replaces_only_the_failed_masters_shard() {
        let shards = shards();
        assert!(shards.route(0).is_none() && shards.masters().is_empty());
        let before = topology(&[(0, 5460, 1), (5461, 10922, 2), (10923, 16383, 3)]);
        assert!(shards.update(&before).expect("update"));
        assert!(!shards.update(&before).expect("update"), "unchanged");
        let port = |slot| shards.route(slot).map(|s| s.server.port);
        assert_eq!(
            (port(0), port(5461), port(16383)),
            (Some(1), Some(2), Some(3))
        );

        let healthy = shards.route(0).expect("a master");
        let dead = shards.route(5461).expect("a master");
        for _ in 0..crate::limiter::breaker::FAILURES_TO_OPEN {
            dead.breaker.failure(0, false);
        }
        assert!(dead.breaker.is_open() && !healthy.breaker.is_open());
        assert_eq!(healthy.breaker.admit(0), Admission::Pass, "per master");

        let after = topology(&[(0, 5460, 1), (5461, 10922, 4), (10923, 16383, 3)]);
        assert!(shards.update(&after).expect("update"));
        let promoted = shards.route(5461).expect("a master");
        assert_eq!(promoted.server.port, 4);
        assert!(!promoted.breaker.is_open(), "a fresh breaker");
        assert!(Arc::ptr_eq(&healthy, &shards.route(0).expect("a master")));
        assert_eq!(shards.masters().len(), 3);
        shards.quit();
    }

    /// Slots that no master serves route nowhere.
    #[tokio::test]
    async fn an_uncovered_slot_has_no_master() {
        let shards = shards();
        shards
            .update(&topology(&[(0, 99, 1), (200, 16383, 2)]))
            .expect("update");
        assert!(shards.route(150).is_none());
        assert_eq!(shards.route(99).map(|s| s.server.port), Some(1));
        shards.quit();
    }
}
