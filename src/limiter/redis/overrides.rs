//! The shared per-key overrides (`crate::overrides`) in Redis: one hash of overrides (field: the
//! counter key, value: the override as JSON) and a version counter bumped by every change, under
//! one hash tag so a Cluster keeps them in one slot. Instances poll the version and read the hash
//! only when it moved; the decision script never reads them, so requests pay nothing.

use fred::prelude::{Key, LuaInterface, Value};

use super::RedisStore;
use crate::limiter::StoreError;

/// Sets one override unless that would make more than `max`: replies the new version, or -1.
const PUT: &str = "\
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return -1
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('INCR', KEYS[2])";

/// Removes one override: replies 1 if it existed (and bumps the version), else 0.
const DELETE: &str = "\
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('INCR', KEYS[2])
return 1";

/// The version, then (only when it differs from ARGV[1]) the hash's fields and values.
const FETCH: &str = "\
local v = redis.call('GET', KEYS[2]) or '0'
if v == ARGV[1] then
  return {v}
end
local all = redis.call('HGETALL', KEYS[1])
table.insert(all, 1, v)
return all";

impl RedisStore {
    fn override_keys(&self) -> Vec<Key> {
        let hash = format!("{}{{turnstile-overrides}}", self.shared.key_prefix);
        let version = format!("{hash}:version");
        vec![Key::from(hash), Key::from(version)]
    }

    /// Sets the override of `field` (a counter key) to `json`; `false` when `max` are already set.
    pub async fn overrides_put(
        &self,
        field: &str,
        json: &str,
        max: usize,
    ) -> Result<bool, StoreError> {
        let args: Vec<Value> = vec![field.into(), json.into(), (max as i64).into()];
        let reply: i64 = self
            .shared
            .pool
            .eval(PUT, self.override_keys(), args)
            .await
            .map_err(|e| self.shared.classify(e))?;
        Ok(reply >= 0)
    }

    /// Removes the override of `field`; `false` when there was none.
    pub async fn overrides_delete(&self, field: &str) -> Result<bool, StoreError> {
        let reply: i64 = self
            .shared
            .pool
            .eval(DELETE, self.override_keys(), vec![Value::from(field)])
            .await
            .map_err(|e| self.shared.classify(e))?;
        Ok(reply == 1)
    }

    /// The shared overrides as (field, JSON) pairs with their version, or `None` when the version
    /// is still `known`.
    #[allow(clippy::type_complexity)]
    pub async fn overrides_fetch(
        &self,
        known: Option<&str>,
    ) -> Result<Option<(String, Vec<(String, String)>)>, StoreError> {
        let reply: Vec<String> = self
            .shared
            .pool
            .eval(
                FETCH,
                self.override_keys(),
                vec![Value::from(known.unwrap_or(""))],
            )
            .await
            .map_err(|e| self.shared.classify(e))?;
        let mut items = reply.into_iter();
        let version = items.next().unwrap_or_default();
        if known == Some(version.as_str()) {
            return Ok(None);
        }
        let rest: Vec<String> = items.collect();
        let pairs = rest
            .chunks_exact(2)
            .map(|p| (p[0].clone(), p[1].clone()))
            .collect();
        Ok(Some((version, pairs)))
    }
}
