//! Redis Cluster resharding: following `MOVED` and `ASK` in the store itself.
//!
//! fred 10.1 follows `ASK` wrongly: it writes `ASKING` to the importing node and reads the answer
//! straight off a connection that other commands are pipelined on, then writes the command to the
//! slot's old owner again, which answers `ASK` again; its clustered client was then left unable to
//! decide for 40 s and more (`tests/redis_cluster.rs`). So the store's clustered pool follows no
//! redirection (`max_redirections: 0`), and the store's calls go to each slot's master on that
//! master's own connections (`cluster.rs`), where a redirection comes back as an answer to read:
//!
//! - a reply: done (the key had not moved yet);
//! - `ASK slot host:port` (the key has moved to the importing node): `ASKING` and the call,
//!   pipelined on one connection to the importing node, which then serves that one call;
//! - `MOVED slot host:port`: the call once to the new owner, and the topology is read again;
//! - `TRYAGAIN` (a call whose keys the migration has split between the two nodes): a failure at
//!   once, so the route's `failure_mode` applies.
//!
//! Only the owner decides whether a key has moved: a call never goes to the importing node
//! without the owner's `ASK` for it, so a counter is never created afresh beside the one still on
//! the owner. The caller bounds all of it by what is left of the store timeout.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use fred::bytes_utils::Str;
use fred::prelude::{
    Builder, ClientLike, ClusterInterface, Config, ConnectionConfig, Error as FredError, FromValue,
    Key, LuaInterface, PerformanceConfig, ReconnectPolicy, ServerConfig, Value,
};
use fred::types::config::Server;
use fred::types::{ClientState, ClusterHash, CustomCommand};

use super::{parse_node, Shared};
use crate::limiter::StoreError;

/// Reconnection attempts of a node connection before it gives up (and is made again on next use).
const RECONNECTS: u32 = 3;

/// Longer than a node connection takes to give up: connect timeouts plus backoff.
const GIVE_UP: Duration = Duration::from_secs(10);

/// Node connections kept at most (a Cluster has a few masters; this only bounds a bad topology).
const MAX_NODES: usize = 32;

/// Whether a node's own answer is a redirection (`MOVED` or `ASK`) to follow.
pub(super) fn is_redirection(e: &FredError) -> bool {
    redirection(e.details()).is_some()
}

/// One connection per Cluster node that a redirection named, made on first use and kept.
pub(super) struct Nodes {
    /// The Cluster's client config (credentials), its server replaced per node.
    config: Config,
    connection: ConnectionConfig,
    performance: PerformanceConfig,
    /// Each with when it was made.
    clients: Mutex<Vec<(Server, fred::prelude::Client, Instant)>>,
}

impl Nodes {
    pub(super) fn new(
        config: Config,
        connection: ConnectionConfig,
        performance: PerformanceConfig,
    ) -> Nodes {
        Nodes {
            config,
            connection,
            performance,
            clients: Mutex::new(Vec::new()),
        }
    }

    /// The connection to `server`, connected (within the caller's timeout).
    async fn client(&self, server: Server) -> Result<fred::prelude::Client, StoreError> {
        let client = self.get_or_start(server)?;
        if !client.is_connected() {
            client
                .wait_for_connect()
                .await
                .map_err(|e| StoreError::Connection(e.details().to_string()))?;
        }
        Ok(client)
    }

    fn get_or_start(&self, server: Server) -> Result<fred::prelude::Client, StoreError> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = clients.iter().position(|(s, _, _)| *s == server) {
            let (_, client, made) = &clients[at];
            // A new client is `Disconnected` until its task starts; an old one that is has given
            // up reconnecting (so a node gone for good keeps no task retrying): start over.
            if client.state() != ClientState::Disconnected || made.elapsed() < GIVE_UP {
                return Ok(client.clone());
            }
            let (_, stale, _) = clients.remove(at);
            tokio::spawn(async move { stale.quit().await });
        }
        let config = Config {
            server: ServerConfig::Centralized {
                server: server.clone(),
            },
            ..self.config.clone()
        };
        let client = Builder::from_config(config)
            .set_connection_config(self.connection.clone())
            .set_performance_config(self.performance.clone())
            .set_policy(ReconnectPolicy::new_exponential(RECONNECTS, 50, 1_000, 2))
            .build()
            .map_err(|e| StoreError::Connection(e.details().to_string()))?;
        drop(client.connect());
        if clients.len() >= MAX_NODES {
            let (_, oldest, _) = clients.remove(0);
            tokio::spawn(async move { oldest.quit().await });
        }
        clients.push((server, client.clone(), Instant::now()));
        Ok(client)
    }

    /// Closes every node connection (the store is dropped).
    pub(super) fn quit(&self) {
        let clients = std::mem::take(&mut *self.clients.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, client, _) in clients {
            tokio::spawn(async move { client.quit().await });
        }
    }
}

/// A Lua script: its text, and its SHA1 when Redis is known to have reported it.
#[derive(Clone, Copy)]
pub(super) struct Script<'a> {
    pub sha: Option<&'a Str>,
    pub text: &'static str,
}

/// Follows the redirection that `reply` (the slot's owner's answer) may be: `ASK` to the
/// importing node, `MOVED` to the new owner (the topology is then read again); any other reply
/// is returned as it is.
pub(super) async fn redirect<R: FromValue>(
    shared: &Shared,
    nodes: &Nodes,
    lua: Script<'_>,
    call: &impl Fn() -> (Vec<Key>, Vec<Value>),
    reply: Result<R, FredError>,
) -> Result<R, StoreError> {
    let reply = match reply.as_ref().err().and_then(|e| redirection(e.details())) {
        Some((Redirection::Ask, to)) => script(lua, &nodes.client(to).await?, true, call).await,
        Some((Redirection::Moved, to)) => {
            if let Some(shards) = &shared.shards {
                shards.mark_stale();
            }
            for client in shared.pool.clients() {
                let client = client.clone();
                tokio::spawn(async move { client.sync_cluster().await });
            }
            script(lua, &nodes.client(to).await?, false, call).await
        }
        None => reply,
    };
    reply.map_err(|e| shared.classify(e))
}

#[derive(Debug, PartialEq, Eq)]
enum Redirection {
    Ask,
    Moved,
}

/// `ASK 3999 127.0.0.1:6381` or `MOVED ...`: where to go.
fn redirection(details: &str) -> Option<(Redirection, Server)> {
    let mut parts = details.split(' ');
    let kind = match parts.next()? {
        "ASK" => Redirection::Ask,
        "MOVED" => Redirection::Moved,
        _ => return None,
    };
    let _slot = parts.next()?;
    let (host, port) = parse_node(parts.next()?).ok()?;
    Some((kind, Server::new(host, port)))
}

/// A script on one node's connection: `EVALSHA`, then `EVAL` of the full text if the node lacks
/// it (`NOSCRIPT`); after `ASKING` on the same connection when `asking`.
async fn script<R: FromValue>(
    lua: Script<'_>,
    client: &fred::prelude::Client,
    asking: bool,
    call: &impl Fn() -> (Vec<Key>, Vec<Value>),
) -> Result<R, FredError> {
    if let Some(sha) = lua.sha {
        let reply = if asking {
            pipelined(client, "EVALSHA", Value::from(sha.clone()), call()).await
        } else {
            let (keys, args) = call();
            client.evalsha(sha.clone(), keys, args).await
        };
        match reply {
            Err(e) if e.details().starts_with("NOSCRIPT") => {}
            other => return other,
        }
    }
    if asking {
        pipelined(client, "EVAL", Value::from_static_str(lua.text), call()).await
    } else {
        let (keys, args) = call();
        client.eval(lua.text, keys, args).await
    }
}

/// `ASKING` then `command` (`EVAL` or `EVALSHA`), written together on the node's one connection:
/// the flag `ASKING` sets holds for exactly the next command of that connection.
async fn pipelined<R: FromValue>(
    client: &fred::prelude::Client,
    command: &'static str,
    script: Value,
    (keys, args): (Vec<Key>, Vec<Value>),
) -> Result<R, FredError> {
    let pipeline = client.pipeline();
    let no_args: Vec<Value> = Vec::new();
    let asking = CustomCommand::new_static("ASKING", ClusterHash::Random, false);
    pipeline.custom::<(), _>(asking, no_args).await?;
    let mut all = Vec::with_capacity(2 + keys.len() + args.len());
    all.push(script);
    all.push(Value::Integer(keys.len() as i64));
    all.extend(keys.into_iter().map(|k| Value::Bytes(k.into_bytes())));
    all.extend(args);
    let command = CustomCommand::new_static(command, ClusterHash::FirstKey, false);
    pipeline.custom::<(), _>(command, all).await?;
    let mut replies = pipeline.try_all::<Value>().await;
    match replies.pop() {
        Some(reply) if replies.len() == 1 => reply?.convert(),
        // The pipeline failed as a whole (a timeout, a broken connection).
        Some(reply) => reply.and_then(|_| Err(FredError::new_canceled())),
        None => Err(FredError::new_canceled()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirections_name_the_node_to_ask() {
        let (kind, server) = redirection("ASK 3999 127.0.0.1:6381").unwrap();
        assert_eq!(kind, Redirection::Ask);
        assert_eq!((&*server.host, server.port), ("127.0.0.1", 6381));
        let (kind, server) = redirection("MOVED 12 ::1:7000").unwrap();
        assert_eq!(kind, Redirection::Moved);
        assert_eq!((&*server.host, server.port), ("::1", 7000));
        assert!(redirection("TRYAGAIN Multiple keys request during rehashing of slot").is_none());
        assert!(redirection("ASK 3999").is_none());
    }
}
