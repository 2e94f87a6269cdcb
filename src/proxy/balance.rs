//! Which target of an upstream a request goes to, and passive health.
//!
//! Each target has its own connection pool ([`super::pool`]). A request picks a target by
//! `balance` (each in turn, or the fewest in flight with ties taken in turn), skipping targets that
//! are ejected. A target is ejected for `eject_for` when a connection to it cannot be opened
//! (refused, unreachable, or the connect timeout), and is picked again as soon as that time is
//! over: the next request to it is the probe. When every target is ejected, the one ejected
//! longest ago is tried rather than failing outright, so an upstream whose targets all restarted
//! is not left dark for a whole `eject_for`.
//!
//! The state is a few atomics per target and one shared counter: no lock on the request path. It
//! lives with the pools, so a config reload starts every target healthy.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::uri::Authority;

use super::pool::{Limits, UpstreamClient};
use crate::config::{Balance, Upstream};
use crate::metrics::{Metrics, TargetMetrics, TargetOutcome};

/// The targets of one upstream and how to choose among them. Shared by every route that forwards
/// to the upstream.
#[derive(Debug)]
pub struct Balancer {
    targets: Box<[Target]>,
    mode: Balance,
    eject_for_ms: u64,
    /// Round-robin position, also the tie-break of `least_in_flight`.
    next: AtomicUsize,
    /// The origin of `Target::ejected_until`.
    epoch: Instant,
}

/// One target: its pool, its load and its health.
#[derive(Debug)]
pub struct Target {
    pub authority: Authority,
    pub client: UpstreamClient,
    in_flight: AtomicUsize,
    /// Milliseconds after `epoch` (plus one) until which the target is ejected; 0 if never.
    ejected_until: AtomicU64,
    metrics: TargetMetrics,
}

impl Balancer {
    /// One pool per target of `upstream`, with its metric series.
    pub fn new(upstream: &Upstream, metrics: &Metrics) -> Self {
        let limits = Limits {
            connect_timeout: upstream.connect_timeout,
            max_connections: upstream.max_connections,
            pool_timeout: upstream.pool_timeout,
        };
        let targets = upstream
            .targets
            .iter()
            .map(|authority| Target {
                authority: authority.clone(),
                client: UpstreamClient::with_tls(
                    &upstream.scheme,
                    authority,
                    limits,
                    upstream.tls.as_ref(),
                    upstream.protocol,
                ),
                in_flight: AtomicUsize::new(0),
                ejected_until: AtomicU64::new(0),
                metrics: metrics.target(&upstream.name, authority.as_str()),
            })
            .collect();
        Balancer {
            targets,
            mode: upstream.balance,
            eject_for_ms: millis(upstream.eject_for).max(1),
            next: AtomicUsize::new(0),
            epoch: Instant::now(),
        }
    }

    pub fn target(&self, index: usize) -> &Target {
        &self.targets[index]
    }

    /// The target for the next attempt, never `skip` (the one that just failed); `None` when no
    /// other target exists.
    pub fn pick(&self, skip: Option<usize>) -> Option<usize> {
        let n = self.targets.len();
        if n == 1 {
            return (skip != Some(0)).then_some(0);
        }
        let now = self.now();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(usize, usize)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            let target = &self.targets[i];
            if Some(i) == skip || target.ejected_until.load(Ordering::Relaxed) > now {
                continue;
            }
            match self.mode {
                Balance::RoundRobin => return Some(i),
                Balance::LeastInFlight => {
                    let load = target.in_flight.load(Ordering::Relaxed);
                    if best.is_none_or(|(_, least)| load < least) {
                        best = Some((i, load));
                    }
                }
            }
        }
        best.map(|(i, _)| i).or_else(|| {
            // Every other target is ejected: the one whose ejection ends first.
            (0..n)
                .filter(|&i| Some(i) != skip)
                .min_by_key(|&i| self.targets[i].ejected_until.load(Ordering::Relaxed))
        })
    }

    /// Whether `pick` reads the targets' in-flight counts: only `least_in_flight` over several
    /// targets does, so only then does every request move a count all workers share.
    fn counts_load(&self) -> bool {
        self.mode == Balance::LeastInFlight && self.targets.len() > 1
    }

    /// Counts a request on `index` as in flight until the returned guard drops.
    pub fn begin(self: &Arc<Self>, index: usize) -> InFlight {
        let target = &self.targets[index];
        if self.counts_load() {
            target.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        target.metrics.in_flight.inc();
        InFlight {
            balancer: self.clone(),
            index,
        }
    }

    /// Records how an attempt on `index` ended; a connect error ejects the target (counted once
    /// per ejection, however many requests saw it fail). A lone target is never ejected: there is
    /// nothing else to send to.
    pub fn record(&self, index: usize, outcome: TargetOutcome) {
        let target = &self.targets[index];
        target.metrics.record(outcome);
        if outcome == TargetOutcome::ConnectError && self.targets.len() > 1 {
            let now = self.now();
            let before = target
                .ejected_until
                .swap(now + self.eject_for_ms, Ordering::Relaxed);
            if before <= now {
                target.metrics.ejections.inc();
                tracing::warn!(
                    target = %target.authority,
                    eject_for_ms = self.eject_for_ms,
                    "upstream target failed to connect; ejected"
                );
            }
        }
    }

    fn now(&self) -> u64 {
        millis(self.epoch.elapsed()) + 1
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX / 2)
}

/// A request in flight on a target: held until its response body ends (or the attempt fails).
#[derive(Debug)]
pub struct InFlight {
    balancer: Arc<Balancer>,
    index: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let target = &self.balancer.targets[self.index];
        if self.balancer.counts_load() {
            target.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        target.metrics.in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn balancer(n: usize, mode: Balance) -> Arc<Balancer> {
        let targets: Vec<Authority> = (0..n)
            .map(|i| format!("127.0.0.1:{}", 10_000 + i).parse().unwrap())
            .collect();
        let upstream = Upstream {
            name: "up".into(),
            scheme: http::uri::Scheme::HTTP,
            authority: targets[0].clone(),
            targets,
            balance: mode,
            eject_for: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            max_connections: 1,
            pool_timeout: Duration::from_secs(1),
            tls: None,
            protocol: crate::config::UpstreamProtocol::Http1,
        };
        Arc::new(Balancer::new(&upstream, &Metrics::new()))
    }

    #[tokio::test]
    async fn round_robin_takes_each_in_turn_and_skips_the_ejected() {
        let b = balancer(3, Balance::RoundRobin);
        let picks: Vec<_> = (0..6).map(|_| b.pick(None).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        b.record(1, TargetOutcome::ConnectError);
        let picks: Vec<_> = (0..4).map(|_| b.pick(None).unwrap()).collect();
        assert_eq!(picks, [0, 2, 2, 0]);
        assert_eq!(b.targets[1].metrics.ejections.get(), 1);
        // A second failure while ejected is the same ejection.
        b.record(1, TargetOutcome::ConnectError);
        assert_eq!(b.targets[1].metrics.ejections.get(), 1);
    }

    #[tokio::test]
    async fn retry_never_returns_the_failed_target() {
        let b = balancer(2, Balance::RoundRobin);
        for _ in 0..4 {
            assert_eq!(b.pick(Some(0)), Some(1));
        }
        assert_eq!(balancer(1, Balance::RoundRobin).pick(Some(0)), None);
    }

    #[tokio::test]
    async fn all_ejected_tries_the_one_ejected_longest_ago() {
        let b = balancer(2, Balance::RoundRobin);
        b.record(1, TargetOutcome::ConnectError);
        std::thread::sleep(Duration::from_millis(5));
        b.record(0, TargetOutcome::ConnectError);
        assert_eq!(b.pick(None), Some(1));
        assert_eq!(b.pick(Some(1)), Some(0));
    }

    #[tokio::test]
    async fn least_in_flight_prefers_the_idle_target() {
        let b = balancer(2, Balance::LeastInFlight);
        let busy = b.begin(0);
        for _ in 0..4 {
            assert_eq!(b.pick(None), Some(1));
        }
        drop(busy);
        let picks: Vec<_> = (0..4).map(|_| b.pick(None).unwrap()).collect();
        assert_eq!(picks.iter().filter(|&&i| i == 0).count(), 2);
    }
}
