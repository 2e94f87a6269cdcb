//! Keeping the Redis store's readiness current and its failures visible, without flooding logs.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::prelude::{
    ClientLike, ClusterInterface, Error as FredError, EventInterface, LuaInterface,
};

use super::Shared;

/// The least time between two logged connection errors.
const ERROR_LOG_EVERY: Duration = Duration::from_secs(10);
/// How often the background probe checks reachability and the script cache.
const PROBE_EVERY: Duration = Duration::from_millis(500);
/// The least time between two reads of a Cluster's topology asked for by calls.
const REREAD_EVERY: Duration = Duration::from_millis(100);
/// The least time a check may take (a short store timeout must not fail every check).
const MIN_CHECK: Duration = Duration::from_millis(250);

/// Keeps `ready` current and the script loaded, until the store is dropped. Logs transitions only,
/// and says nothing while the first connection is still within [`super::STARTUP_WAIT`]: a store
/// that is merely connecting is not unreachable.
pub(super) async fn probe(store: Weak<Shared>) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The state last logged: the first settled probe always logs, so startup with Redis down is
    // visible.
    let mut logged = None;
    // A Cluster's topology is read again soon after a call asks for it (`cluster.rs`).
    let wake = store
        .upgrade()
        .and_then(|shared| shared.shards.as_ref().map(|shards| shards.wake.clone()));
    loop {
        let woken = match &wake {
            Some(wake) => tokio::select! {
                _ = tick.tick() => false,
                () = wake.notified() => true,
            },
            None => {
                tick.tick().await;
                false
            }
        };
        if woken {
            if let Some(shared) = store.upgrade() {
                if let Some(shards) = &shared.shards {
                    let limit = shared.timeout.max(MIN_CHECK);
                    let _ = super::cluster::refresh(shards, &shared.pool, limit).await;
                }
            }
            // A failing master asks on every failure: at most one read per `REREAD_EVERY`.
            tokio::time::sleep(REREAD_EVERY).await;
            continue;
        }
        let Some(shared) = store.upgrade() else {
            return;
        };
        let reachable = check(&shared).await;
        let settled = reachable || shared.started.elapsed() >= super::STARTUP_WAIT;
        if settled && logged != Some(reachable) {
            logged = Some(reachable);
            if reachable {
                tracing::info!("redis store is reachable");
            } else {
                tracing::warn!("redis store is unreachable; routes apply their failure_mode");
            }
        }
    }
}

/// One readiness check: connected, the script cached, and on a Cluster every slot served
/// (`cluster_state:ok`: no shard without a master, when Redis requires full coverage). Updates
/// `ready` (and closes the breaker when Redis is back, rather than after the next request probe).
pub(super) async fn check(shared: &Shared) -> bool {
    let limit = shared.timeout.max(MIN_CHECK);
    let reachable = match &shared.shards {
        Some(shards) => {
            // Each master's connections follow the topology: read it first, bounded on its own.
            let _ = super::cluster::refresh(shards, &shared.pool, limit).await;
            matches!(
                tokio::time::timeout(limit, cluster_answers(shared, shards)).await,
                Ok(Ok(true))
            )
        }
        None => {
            let answers = async {
                script_cached(shared).await?;
                Ok::<_, FredError>(true)
            };
            shared.pool.clients().iter().any(|c| c.is_connected())
                && matches!(tokio::time::timeout(limit, answers).await, Ok(Ok(true)))
        }
    };
    if !reachable {
        shared.lost_state();
    }
    if reachable {
        shared.breaker.success();
    }
    shared.ready.store(reachable, Ordering::Relaxed);
    reachable
}

/// A Cluster is ready when every master it names is connected (a shard without a master is not
/// ready, though the others decide), the script's SHA is known (loaded on one master the first
/// time; another master lacking it answers `NOSCRIPT`, then `EVAL` caches it there) and a master
/// says `cluster_state:ok`. Asked on the masters' own connections: fred's clustered client stalls
/// while it re-syncs after one master's death.
async fn cluster_answers(
    shared: &Shared,
    shards: &super::cluster::Shards,
) -> Result<bool, FredError> {
    let masters = shards.masters();
    if masters.is_empty() || !masters.iter().all(|shard| shard.connected()) {
        return Ok(false);
    }
    let Some(shard) = masters.iter().find(|shard| !shard.breaker.is_open()) else {
        return Ok(false);
    };
    let client = shard.pool.next();
    if shared.sha.get().is_none() {
        let sha: fred::bytes_utils::Str = client.script_load(super::DECIDE_LUA).await?;
        shared.sha.get_or_init(|| sha);
    }
    let info: String = client.cluster_info().await?;
    Ok(info.contains("cluster_state:ok"))
}

/// Logs why connections fail (refused, wrong password, TLS), at most once per
/// [`ERROR_LOG_EVERY`]: fred reconnects forever, and an outage must not flood the log.
pub(super) fn log_connection_errors(shared: &Arc<Shared>) {
    for client in shared.pool.clients() {
        // A re-established connection may lead to a server that lost its counters.
        let mut reconnects = client.reconnect_rx();
        let store = Arc::downgrade(shared);
        tokio::spawn(async move {
            loop {
                match reconnects.recv().await {
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
                let Some(shared) = store.upgrade() else {
                    return;
                };
                shared.lost_state();
            }
        });
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
                shared.lost_state();
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
        // The script cache is empty: Redis restarted (or failed over), and its counters with it.
        shared.lost_state();
    }
    shared.load_script().await.map(|_| ())
}
