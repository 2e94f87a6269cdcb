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

use fred::prelude::{Key, Value};

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

impl RedisStore {
    fn quota_keys(&self, bucket: &str) -> Vec<Key> {
        let tag = "{turnstile-rlqs}";
        let prefix = &self.shared.key_prefix;
        vec![
            Key::from(format!("{prefix}{tag}:lease:{bucket}")),
            Key::from(format!("{prefix}{tag}:epoch")),
        ]
    }

    /// Takes or renews `server`'s lease on `bucket` (a canonical bucket id): returns the tokens
    /// per second this server may hand out (the smaller of its grant and its fair part) and how
    /// long the grant lasts (from before the call: the caller's
    /// clock is read first, so its view of the expiry is never later than Redis's).
    pub async fn quota_lease(
        &self,
        bucket: &str,
        server: &str,
        ask: LeaseRequest,
    ) -> Result<(f64, u64), StoreError> {
        let args: Vec<Value> = vec![
            server.into(),
            format!("{:.6}", ask.held).into(),
            format!("{:.6}", ask.demand).into(),
            format!("{:.6}", ask.floor).into(),
            format!("{:.6}", ask.rate).into(),
            (ask.lease_ms as i64).into(),
            (ask.hold_ms as i64).into(),
        ];
        let reply: Vec<String> = self
            .shared
            .eval(LEASE, self.quota_keys(bucket), args)
            .await?;
        let parse = |i: usize| reply.get(i).and_then(|v| v.parse::<f64>().ok());
        match (parse(0), parse(1), parse(2)) {
            (Some(granted), Some(ms), Some(fair)) => Ok((granted.min(fair), ms as u64)),
            _ => Err(StoreError::Script(format!(
                "the quota lease replied {reply:?}"
            ))),
        }
    }
}
