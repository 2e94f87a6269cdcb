//! The Envoy rate limit quota service (RLQS):
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`, for Envoy's
//! `envoy.filters.http.rate_limit_quota` filter. Each proxy enforces locally the token bucket it
//! is assigned and streams usage reports; the shares are decided by [`crate::limiter::quota`].
//!
//! This door only translates: a report's bucket ids become [`BucketKey`]s matched to the
//! `rlqs:` budgets ([`crate::config::rlqs`]), and the shares' [`Push`]es become `BucketAction`s
//! on the right stream (`grpc.rs`; the protocol's messages are built in `wire.rs`). A tick a
//! second sends what the shares decide on their own (refreshes, held-back changes, a vanished
//! proxy's share returned), renews the Redis leases and updates the metrics.

mod grpc;
mod wire;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{watch, Notify};

use crate::clock::{Clock, MonotonicClock};
use crate::config::rlqs::RlqsSettings;
use crate::limiter::quota::{BucketKey, ProxyId, Push, Shares};
use crate::log_throttle::Throttle;
use crate::state::AppState;

pub use grpc::serve;

/// One connected proxy stream.
#[derive(Debug)]
struct Stream {
    tx: UnboundedSender<Result<RateLimitQuotaResponse, tonic::Status>>,
    /// Its `proxy` metric label: the `x-turnstile-proxy` metadata Envoy sends
    /// (`grpc_service.initial_metadata`), or the peer's IP.
    label: Arc<str>,
}

/// The service: the shares, the streams that hear about them, and this server's id in the
/// Redis leases.
#[derive(Debug, Clone)]
pub struct RlqsService {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Arc<AppState>,
    shares: Shares,
    streams: Mutex<HashMap<ProxyId, Stream>>,
    next_id: AtomicU64,
    clock: MonotonicClock,
    /// Unique per process start: a restarted server never takes over its old leases, which
    /// stay counted until they expire.
    server_id: String,
    /// Set at shutdown: every stream ends.
    stop_tx: watch::Sender<bool>,
    stop: watch::Receiver<bool>,
    /// Runs the tick early (a report may need a first lease).
    wake: Arc<Notify>,
    lease_errors: Throttle,
}

impl RlqsService {
    /// The service for `settings` (read at start: a reload changes the budgets, not the timing).
    pub fn new(state: Arc<AppState>, settings: &RlqsSettings) -> Self {
        let clock = MonotonicClock::new();
        let leased = matches!(state.engine.store(), crate::limiter::Store::Redis(_));
        let shares = Shares::new(
            settings.timing,
            leased,
            settings.max_buckets,
            clock.now_us(),
        );
        let server_id = format!("{}-{}", std::process::id(), clock.now_us());
        let (stop_tx, stop) = watch::channel(false);
        RlqsService {
            inner: Arc::new(Inner {
                state,
                shares,
                streams: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
                clock,
                server_id,
                stop_tx,
                stop,
                wake: Arc::new(Notify::new()),
                lease_errors: Throttle::new(std::time::Duration::from_secs(10)),
            }),
        }
    }

    fn streams(&self) -> MutexGuard<'_, HashMap<ProxyId, Stream>> {
        self.inner
            .streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn now_us(&self) -> u64 {
        self.inner.clock.now_us()
    }

    /// Sends each push on its stream, one response per stream.
    fn deliver(&self, pushes: Vec<Push>) {
        if pushes.is_empty() {
            return;
        }
        let mut by_proxy: HashMap<ProxyId, Vec<Push>> = HashMap::new();
        for push in pushes {
            self.count(&push);
            by_proxy.entry(push.proxy).or_default().push(push);
        }
        let streams = self.streams();
        for (proxy, pushes) in by_proxy {
            if let Some(stream) = streams.get(&proxy) {
                let response = wire::response(&pushes, self.inner.shares.timing());
                // A stream that just ended: its members are already marked gone.
                let _ = stream.tx.send(Ok(response));
            }
        }
    }
}

/// A bucket id's entries sorted by key, bounded before they become a key.
fn bucket_key(
    bucket: &std::collections::HashMap<String, String>,
) -> Result<BucketKey, &'static str> {
    if bucket.is_empty() || bucket.len() > wire::MAX_ENTRIES {
        return Err("a bucket id needs 1 to 16 entries");
    }
    let mut entries: Vec<(String, String)> = Vec::with_capacity(bucket.len());
    for (k, v) in bucket {
        if k.len() > wire::MAX_KEY || v.len() > wire::MAX_VALUE {
            return Err("a bucket id entry is longer than 128 bytes (key) or 256 (value)");
        }
        entries.push((k.clone(), v.clone()));
    }
    entries.sort_unstable();
    Ok(entries.into())
}

/// The canonical text of a bucket id, for its Redis lease key: `key=value` pairs joined by
/// `&`, each part percent-escaped so no two ids share a text.
fn bucket_text(key: &BucketKey) -> String {
    let escape = |s: &str| {
        let mut out = String::with_capacity(s.len());
        for b in s.bytes() {
            if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                out.push(b as char);
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    };
    key.iter()
        .map(|(k, v)| format!("{}={}", escape(k), escape(v)))
        .collect::<Vec<_>>()
        .join("&")
}

impl Inner {
    fn next_proxy(&self) -> ProxyId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}
