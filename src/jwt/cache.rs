//! The cache of verified tokens (`jwt.token_cache`): a repeated token skips its signature check.
//!
//! - **Keyed by SHA-256 of the whole token**, header, payload and signature: only the very bytes
//!   that verified can hit, so a forged signature (or any other change) is a miss and goes to the
//!   full check. Only tokens that verified are ever inserted.
//! - **Valid while a fresh check would pass**: until `exp` plus the leeway, and only while the key
//!   that verified the token is still in the set in force (checked on every hit by the key's
//!   fingerprint, [`super::keys::KeySet::holds`]). A key removed from the JWKS stops its cached
//!   tokens at the first request after the set without it is installed.
//! - **Bounded**: at most `entries` tokens, in 16 shards of `entries / 16` (rounded up), each
//!   behind its own lock; a full shard drops an arbitrary entry for the new one. An entry holds
//!   the digest, the expiry, the key's fingerprint and the claims the policies read (strings and
//!   numbers only, at most [`MAX_CACHED_CLAIM_BYTES`] of values: a token with more is verified
//!   every time). See [`ENTRY_BYTES`] for the bound per entry.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex};

use super::Claims;

const SHARDS: usize = 16;

/// A token whose kept claims' values exceed this is not cached.
pub const MAX_CACHED_CLAIM_BYTES: usize = 512;

/// An entry's fixed cost, in bytes: the map slot (32-byte digest, 8-byte expiry, 8-byte key
/// fingerprint, 8-byte pointer, its control byte and the table's spare capacity, about 72), and
/// the claims' allocation (16 of reference counts, 16 for the list, 32 per claim for its name and
/// value). Per claim kept, add 32 and its name's length; over all claims, at most
/// [`MAX_CACHED_CLAIM_BYTES`] of values.
pub const ENTRY_BYTES: usize = 72 + 32;

/// What one hit returns, and what is kept per token.
struct Entry {
    /// Unix seconds after which a fresh check would refuse the token (`exp` plus the leeway).
    until: u64,
    /// The fingerprint of the key that verified it.
    key: u64,
    claims: Arc<Claims>,
}

/// A hasher for keys that are already SHA-256 digests: their first 8 bytes.
#[derive(Default)]
struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // The array's length prefix is one constant write; the digest's first 8 bytes follow.
        let mut word = [0; 8];
        let n = bytes.len().min(8);
        word[..n].copy_from_slice(&bytes[..n]);
        self.0 = self.0.rotate_left(17) ^ u64::from_le_bytes(word);
    }
}

type Shard = HashMap<[u8; 32], Entry, BuildHasherDefault<DigestHasher>>;

/// The verified tokens, bounded.
pub struct TokenCache {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
}

impl std::fmt::Debug for TokenCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCache")
            .field("entries", &(self.per_shard * SHARDS))
            .finish()
    }
}

impl TokenCache {
    /// A cache of at most `entries` tokens (rounded up to a multiple of 16); `None` for 0.
    pub fn new(entries: usize) -> Option<TokenCache> {
        if entries == 0 {
            return None;
        }
        let per_shard = entries.div_ceil(SHARDS);
        Some(TokenCache {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard,
        })
    }

    fn shard(&self, digest: &[u8; 32]) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[usize::from(digest[31]) % SHARDS]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The claims of the token with this digest, if it verified before, has not expired at `now`
    /// (Unix seconds) and its key is one `holds` accepts. An entry that fails either is dropped.
    pub fn get(
        &self,
        digest: &[u8; 32],
        now: u64,
        holds: impl FnOnce(u64) -> bool,
    ) -> Option<Arc<Claims>> {
        let mut shard = self.shard(digest);
        let entry = shard.get(digest)?;
        if entry.until >= now && holds(entry.key) {
            return Some(entry.claims.clone());
        }
        shard.remove(digest);
        None
    }

    /// Keeps a token that has just verified with the key `key`, until `until`.
    pub fn insert(&self, digest: [u8; 32], until: u64, key: u64, claims: Arc<Claims>) {
        let mut shard = self.shard(&digest);
        if shard.len() >= self.per_shard && !shard.contains_key(&digest) {
            if let Some(victim) = shard.keys().next().copied() {
                shard.remove(&victim);
            }
        }
        shard.insert(digest, Entry { until, key, claims });
    }

    /// How many tokens it holds now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().map(|s| s.len()).unwrap_or(0))
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Arc<Claims> {
        Arc::new(Claims::default())
    }

    #[test]
    fn an_entry_ends_at_its_expiry_or_with_its_key() {
        let cache = TokenCache::new(16).expect("on");
        cache.insert([1; 32], 100, 7, claims());
        assert!(cache.get(&[1; 32], 100, |k| k == 7).is_some());
        assert!(
            cache.get(&[2; 32], 100, |_| true).is_none(),
            "another digest"
        );
        assert!(cache.get(&[1; 32], 100, |k| k == 8).is_none(), "key gone");
        assert!(
            cache.get(&[1; 32], 50, |_| true).is_none(),
            "dropped with its key"
        );
        cache.insert([1; 32], 100, 7, claims());
        assert!(cache.get(&[1; 32], 101, |_| true).is_none(), "expired");
    }

    #[test]
    fn it_never_holds_more_than_its_bound() {
        let cache = TokenCache::new(32).expect("on");
        for i in 0..1000u32 {
            let mut digest = [0; 32];
            digest[..4].copy_from_slice(&i.to_be_bytes());
            digest[31] = (i % 251) as u8;
            cache.insert(digest, u64::MAX, 1, claims());
        }
        assert_eq!(cache.len(), 32);
    }
}
