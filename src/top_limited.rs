//! Who is being limited, in bounded memory: the heavy hitters among limited keys, for
//! `/debug/top-limited` on the admin listener.
//!
//! Keys (a user id, a client IP) never become metric labels, since one series per client would
//! make Prometheus' cardinality unbounded. Instead every limited request is fed to a Space-Saving
//! sketch (Metwally, Agrawal and El Abbadi, 2005) of fixed capacity `k`:
//!
//! - a key already monitored gets `count += 1`;
//! - a new key takes a free slot, or else replaces the monitored key with the smallest count `m`
//!   and starts at `count = m + 1` with `error = m`.
//!
//! Then, for every monitored key, `count - error <= true count <= count`, and every key limited
//! more than `total / k` times is monitored. Memory is `k` slots whatever the number of distinct
//! keys, and the slots' buffers are reused, so recording allocates nothing once warm.
//!
//! Counts are kept per period (5 minutes by default) so the view shows who is limited now, not
//! since startup: the report holds the current period and the previous complete one.

use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, PoisonError};

use hashbrown::hash_table::HashTable;
use hashbrown::DefaultHashBuilder;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::clock::Clock;

/// Keys longer than this are shown (and told apart) by their SHA-256, so a slot's memory is
/// bounded whatever the request sent.
pub const MAX_KEY_BYTES: usize = 512;

/// How many keys are monitored when the config does not say.
pub const DEFAULT_CAPACITY: usize = 128;

/// Hex digits of a key's SHA-256 shown when key values are hidden: 48 bits, so two keys among a
/// report's few hundred collide with odds of about 10⁻¹⁰.
pub const SHORT_DIGEST_HEX: usize = 12;

/// How long one period lasts when the config does not say.
pub const DEFAULT_PERIOD_US: u64 = 300_000_000;

/// The shared, fixed-size record of limited keys. Cheap to call on every limited request: one
/// short lock, one hash lookup, and on a new key a scan of `capacity` counts.
#[derive(Debug)]
pub struct TopLimited {
    clock: Arc<dyn Clock>,
    period_us: u64,
    inner: Mutex<Periods>,
}

#[derive(Debug)]
struct Periods {
    start_us: u64,
    current: Sketch,
    previous: Sketch,
    /// Whether a period has ended yet: false in the first period after startup.
    previous_complete: bool,
}

impl TopLimited {
    /// `capacity` keys are monitored in each of the two periods kept; `period_us` is measured on
    /// `clock`.
    pub fn new(clock: Arc<dyn Clock>, capacity: usize, period_us: u64) -> Self {
        let capacity = capacity.max(1);
        let hasher = DefaultHashBuilder::default();
        let start_us = clock.now_us();
        TopLimited {
            clock,
            period_us: period_us.max(1),
            inner: Mutex::new(Periods {
                start_us,
                current: Sketch::new(capacity, hasher),
                previous: Sketch::new(capacity, hasher),
                previous_complete: false,
            }),
        }
    }

    /// Counts one limited request of `key` under (`route`, `policy`).
    pub fn record(&self, route: &str, policy: &str, key: &str) {
        let now = self.clock.now_us();
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.rotate(now, self.period_us);
        inner.current.record(route, policy, key);
    }

    /// The monitored keys of the current and previous periods, heaviest first, `n` at most each,
    /// with their values as recorded.
    pub fn report(&self, n: usize) -> Report {
        self.report_with(n, true)
    }

    /// [`TopLimited::report`], each key shown as `sha256:` and the first [`SHORT_DIGEST_HEX`] hex
    /// digits of its SHA-256 unless `show_values`: enough to tell keys apart and to check a
    /// suspected value (`printf %s KEY | sha256sum`), without handing out API keys.
    pub fn report_with(&self, n: usize, show_values: bool) -> Report {
        let now = self.clock.now_us();
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.rotate(now, self.period_us);
        Report {
            capacity: inner.current.capacity,
            period_seconds: self.period_us as f64 / 1e6,
            current: inner
                .current
                .report(n, (now - inner.start_us) as f64 / 1e6, show_values),
            previous: inner.previous_complete.then(|| {
                inner
                    .previous
                    .report(n, self.period_us as f64 / 1e6, show_values)
            }),
        }
    }

    /// An upper bound of the bytes held, for tests and for the curious: it must not grow with
    /// the number of distinct keys seen.
    pub fn memory_bytes(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        std::mem::size_of::<Self>() + inner.current.memory_bytes() + inner.previous.memory_bytes()
    }
}

impl Periods {
    fn rotate(&mut self, now: u64, period_us: u64) {
        let elapsed = now.saturating_sub(self.start_us);
        if elapsed < period_us {
            return;
        }
        let periods = elapsed / period_us;
        std::mem::swap(&mut self.current, &mut self.previous);
        self.current.clear();
        self.previous_complete = true;
        // Two periods or more: the one just ended saw nothing.
        if periods > 1 {
            self.previous.clear();
        }
        self.start_us += periods * period_us;
    }
}

/// What `/debug/top-limited` answers, as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Keys monitored per period: the memory bound.
    pub capacity: usize,
    pub period_seconds: f64,
    pub current: PeriodReport,
    /// The last complete period; absent in the first period after startup.
    pub previous: Option<PeriodReport>,
}

/// The heavy hitters of one period.
#[derive(Debug, Clone, Serialize)]
pub struct PeriodReport {
    /// How long the period has run (or ran).
    pub seconds: f64,
    /// Limited requests counted in the period, monitored or not.
    pub limited: u64,
    /// Every key limited more than this many times in the period is listed: `limited / capacity`.
    pub guaranteed_above: u64,
    pub keys: Vec<KeyCount>,
}

/// One monitored key. Its true count lies in `[count - error, count]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyCount {
    pub route: String,
    pub policy: String,
    pub key: String,
    pub count: u64,
    pub error: u64,
}

#[derive(Debug)]
struct Slot {
    hash: u64,
    route: String,
    policy: String,
    key: String,
    /// `key` holds `sha256:` and the digest of a value too long to keep.
    digested: bool,
    count: u64,
    error: u64,
}

/// One period's Space-Saving summary. `slots[..used]` are monitored; the rest are spare buffers.
#[derive(Debug)]
struct Sketch {
    capacity: usize,
    hasher: DefaultHashBuilder,
    /// Slot indices, found by the hash of (route, policy, key).
    index: HashTable<u32>,
    slots: Vec<Slot>,
    used: usize,
    total: u64,
}

impl Sketch {
    fn new(capacity: usize, hasher: DefaultHashBuilder) -> Self {
        Sketch {
            capacity,
            hasher,
            index: HashTable::with_capacity(capacity),
            slots: Vec::with_capacity(capacity),
            used: 0,
            total: 0,
        }
    }

    fn clear(&mut self) {
        self.index.clear();
        self.used = 0;
        self.total = 0;
    }

    fn record(&mut self, route: &str, policy: &str, key: &str) {
        // A long key is replaced by its digest, formatted on the stack.
        let mut digest_hex = [0u8; 7 + 64];
        let digested = key.len() > MAX_KEY_BYTES;
        let key = if digested {
            digest_key(key, &mut digest_hex)
        } else {
            key
        };
        self.total += 1;
        let hash = self.hasher.hash_one((route, policy, key));
        let slots = &self.slots;
        let found = self.index.find(hash, |&i| {
            let s = &slots[i as usize];
            s.key == key && s.policy == policy && s.route == route
        });
        if let Some(&i) = found {
            self.slots[i as usize].count += 1;
            return;
        }
        let (slot, count, error) = if self.used < self.capacity {
            self.used += 1;
            if self.slots.len() < self.used {
                self.slots.push(Slot {
                    hash: 0,
                    route: String::new(),
                    policy: String::new(),
                    key: String::new(),
                    digested: false,
                    count: 0,
                    error: 0,
                });
            }
            (self.used - 1, 1, 0)
        } else {
            let (min, min_count) = self.slots[..self.used]
                .iter()
                .enumerate()
                .map(|(i, s)| (i, s.count))
                .min_by_key(|&(_, c)| c)
                .unwrap_or((0, 0));
            let old_hash = self.slots[min].hash;
            if let Ok(entry) = self.index.find_entry(old_hash, |&i| i as usize == min) {
                entry.remove();
            }
            (min, min_count + 1, min_count)
        };
        let s = &mut self.slots[slot];
        s.hash = hash;
        s.digested = digested;
        s.count = count;
        s.error = error;
        for (buf, value) in [
            (&mut s.route, route),
            (&mut s.policy, policy),
            (&mut s.key, key),
        ] {
            buf.clear();
            buf.push_str(value);
        }
        let slots = &self.slots;
        self.index
            .insert_unique(hash, slot as u32, |&i| slots[i as usize].hash);
    }

    fn report(&self, n: usize, seconds: f64, show_values: bool) -> PeriodReport {
        let mut keys: Vec<KeyCount> = self.slots[..self.used]
            .iter()
            .map(|s| KeyCount {
                route: s.route.clone(),
                policy: s.policy.clone(),
                key: match (show_values, s.digested) {
                    (true, _) => s.key.clone(),
                    // Already `sha256:` and the full digest of the value.
                    (false, true) => s.key[..7 + SHORT_DIGEST_HEX].to_string(),
                    (false, false) => {
                        let mut buf = [0u8; 7 + 64];
                        digest_key(&s.key, &mut buf)[..7 + SHORT_DIGEST_HEX].to_string()
                    }
                },
                count: s.count,
                error: s.error,
            })
            .collect();
        keys.sort_by(|a, b| b.count.cmp(&a.count).then(a.error.cmp(&b.error)));
        keys.truncate(n);
        PeriodReport {
            seconds,
            limited: self.total,
            guaranteed_above: self.total / self.capacity as u64,
            keys,
        }
    }

    fn memory_bytes(&self) -> usize {
        let strings: usize = self
            .slots
            .iter()
            .map(|s| s.route.capacity() + s.policy.capacity() + s.key.capacity())
            .sum();
        self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.index.capacity() * (std::mem::size_of::<u32>() + 1)
            + strings
    }
}

/// Writes `sha256:` and the key's digest in hex into `buf`, and returns it as text.
fn digest_key<'b>(key: &str, buf: &'b mut [u8; 71]) -> &'b str {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    buf[..7].copy_from_slice(b"sha256:");
    for (i, byte) in Sha256::digest(key.as_bytes()).iter().enumerate() {
        buf[7 + 2 * i] = HEX[usize::from(byte >> 4)];
        buf[8 + 2 * i] = HEX[usize::from(byte & 0xf)];
    }
    // Only ASCII was written.
    std::str::from_utf8(&buf[..]).unwrap_or("sha256:")
}
