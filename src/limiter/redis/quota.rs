//! Quota leases (`crate::limiter::quota`): several servers share one budget through one hash per
//! bucket, a field per server (`granted demand floor expires_ms`), taken by one atomic script a
//! second per bucket, never per request. A server's grant is its fair part of the budget by
//! demand (each server's floor first), within what the other servers' unexpired grants leave,
//! and never below what it already has out (it lowers its proxies first, then asks for less).
//!
//! All keys share one hash tag (`{turnstile-rlqs}`), so a Cluster keeps them on one master. The
//! epoch key marks the keyspace as known: when it is missing (a fresh Redis, or one that lost
//! its data in a failover) every grant waits one hold-down, after which no assignment any server
//! handed out against the lost leases can still be in force.
//!
//! Redis replicates asynchronously, so a failover can keep the epoch key yet lose the last
//! renewals. On one server or Sentinel's master, the leases go over a connection of their own,
//! and when the master has replicas each round of renewals is followed by `WAIT 1`: a renewal no
//! replica acknowledged is not used (the server keeps the last acknowledged lease, which the
//! replica has, until it ends).

use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::{ClientLike, LuaInterface, ServerInterface};
use fred::prelude::{Key, Value};
use fred::types::config::Options;
use fred::types::InfoKind;

use super::RedisStore;
use crate::limiter::StoreError;

/// KEYS: the bucket's hash, the epoch key. ARGV: server, held, demand, floor, rate (all per
/// second), lease ms, hold-down ms. Replies `{granted, lease ms, fair part}`: granted 0 and
/// the ms left while the hold-down lasts. The server hands out at most the smaller of its grant
/// and its fair part, so a server above its fair part lowers its proxies, and its next grant
/// (never below what it has out) follows them down.
const LEASE: &str = "\
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local server = ARGV[1]
local held, demand, floor = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local rate, lease, hold = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local epoch = redis.call('GET', KEYS[2])
if not epoch then
  redis.call('SET', KEYS[2], tostring(now + hold))
  epoch = now + hold
end
epoch = tonumber(epoch)
if now < epoch then
  return {'0', tostring(epoch - now), '0'}
end
local others, demands, floors, servers = 0, demand, floor, 1
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local g, d, f, e = string.match(all[i + 1], '^(%S+) (%S+) (%S+) (%S+)$')
  if not e or tonumber(e) <= now then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] ~= server then
    others = others + tonumber(g)
    demands = demands + tonumber(d)
    floors = floors + tonumber(f)
    servers = servers + 1
  end
end
local mine = floor
if floors > rate then
  mine = floor * rate / floors
end
local rest = rate - math.min(floors, rate)
if demands > 0 then
  mine = mine + rest * demand / demands
else
  mine = mine + rest / servers
end
local free = rate - others
if free < 0 then
  free = 0
end
local grant = math.min(mine, free)
if grant < held then
  grant = held
end
redis.call('HSET', KEYS[1], server,
  string.format('%.6f %.6f %.6f %d', grant, demand, floor, now + lease))
redis.call('PEXPIRE', KEYS[1], lease * 2)
return {string.format('%.6f', grant), tostring(lease), string.format('%.6f', mine)}";

/// One lease request: see [`RedisStore::quota_lease`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseRequest {
    pub held: f64,
    pub demand: f64,
    pub floor: f64,
    pub rate: f64,
    pub lease_ms: u64,
    pub hold_ms: u64,
}

/// A lease as Redis granted it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lease {
    /// Tokens per second Redis holds for this server (never below what it has out).
    pub grant: f64,
    /// What it may hand out: the smaller of the grant and its fair part.
    pub rate: f64,
    /// How long the grant lasts, from before the call.
    pub ms: u64,
}

impl RedisStore {
    /// The leases' connection, on one server or Sentinel's master; `None` on a Cluster (whose
    /// leases go through the slot's master like any script, without `WAIT`).
    fn quota_client(&self) -> Option<&Client> {
        if self.shared.shards.is_some() || self.shared.cluster {
            return None;
        }
        Some(self.shared.quota.get_or_init(|| {
            let client = self.shared.pool.next().clone_new();
            // Drives the connection (and reconnections) until the store is dropped.
            drop(client.connect());
            client
        }))
    }

    /// How many replicas the master has connected (`INFO replication`); 0 on a Cluster.
    pub async fn quota_replicas(&self) -> Result<u64, StoreError> {
        let Some(client) = self.quota_client() else {
            return Ok(0);
        };
        let info: String = client
            .info(Some(InfoKind::Replication))
            .await
            .map_err(|e| self.shared.classify(e))?;
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix("connected_slaves:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0))
    }

    /// Whether a replica has acknowledged every lease taken since the last call (`WAIT 1`), at
    /// most `limit`. False on a Cluster, and when the call fails.
    pub async fn quota_acknowledged(&self, limit: Duration) -> bool {
        let Some(client) = self.quota_client() else {
            return false;
        };
        let ms = i64::try_from(limit.as_millis()).unwrap_or(i64::MAX).max(1);
        let options = Options {
            timeout: Some(limit + Duration::from_secs(1)),
            ..Options::default()
        };
        let acked: Result<i64, _> = client.with_options(&options).wait(1, ms).await;
        matches!(acked, Ok(n) if n >= 1)
    }

    fn quota_keys(&self, bucket: &str) -> Vec<Key> {
        let tag = "{turnstile-rlqs}";
        let prefix = &self.shared.key_prefix;
        vec![
            Key::from(format!("{prefix}{tag}:lease:{bucket}")),
            Key::from(format!("{prefix}{tag}:epoch")),
        ]
    }

    /// Takes or renews `server`'s lease on `bucket` (a canonical bucket id): the grant, the
    /// tokens per second this server may hand out (the smaller of its grant and its fair part)
    /// and how long the grant lasts (from before the call: the caller's clock is read first, so
    /// its view of the expiry is never later than Redis's). On one server or Sentinel's master
    /// it goes over the leases' own connection, which [`RedisStore::quota_acknowledged`] waits on.
    pub async fn quota_lease(
        &self,
        bucket: &str,
        server: &str,
        ask: LeaseRequest,
    ) -> Result<Lease, StoreError> {
        let args: Vec<Value> = vec![
            server.into(),
            format!("{:.6}", ask.held).into(),
            format!("{:.6}", ask.demand).into(),
            format!("{:.6}", ask.floor).into(),
            format!("{:.6}", ask.rate).into(),
            (ask.lease_ms as i64).into(),
            (ask.hold_ms as i64).into(),
        ];
        let keys = self.quota_keys(bucket);
        let reply: Vec<String> = match self.quota_client() {
            Some(client) => client
                .eval(LEASE, keys, args)
                .await
                .map_err(|e| self.shared.classify(e))?,
            None => self.shared.eval(LEASE, keys, args).await?,
        };
        let parse = |i: usize| reply.get(i).and_then(|v| v.parse::<f64>().ok());
        match (parse(0), parse(1), parse(2)) {
            (Some(grant), Some(ms), Some(fair)) => Ok(Lease {
                grant,
                rate: grant.min(fair),
                ms: ms as u64,
            }),
            _ => Err(StoreError::Script(format!(
                "the quota lease replied {reply:?}"
            ))),
        }
    }
}
