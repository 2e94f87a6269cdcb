//! The waiting room of requests admitted for later (`on_limit: delay`, `docs/algorithms.md`
//! "Pacing"): the engine reserved each one's slot in its decision; here the gateway bounds how
//! many wait per route and wakes them all when it shuts down. The waiting itself is
//! `admission::Wait`, which holds a [`Place`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// Requests waiting for their slot, counted per route name on this instance (a reload keeps the
/// count: a route's waiters under the old config still count against its new `max_waiting`).
#[derive(Debug, Clone)]
pub struct Waiters(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    counts: Mutex<HashMap<Arc<str>, usize>>,
    stop: watch::Sender<bool>,
}

impl Default for Waiters {
    fn default() -> Self {
        Waiters(Arc::new(Inner {
            counts: Mutex::default(),
            stop: watch::channel(false).0,
        }))
    }
}

impl Waiters {
    /// A place among `route`'s waiters when fewer than `cap` hold one; `None` once it is full
    /// or the gateway is shutting down (the request is then decided without waiting).
    pub fn enter(&self, route: &Arc<str>, cap: usize) -> Option<Place> {
        if *self.0.stop.borrow() {
            return None;
        }
        let mut counts = lock(&self.0.counts);
        let count = counts.entry(route.clone()).or_insert(0);
        if *count >= cap {
            return None;
        }
        *count += 1;
        Some(Place {
            waiters: self.clone(),
            route: route.clone(),
        })
    }

    /// How many hold a place on `route` now.
    pub fn waiting(&self, route: &str) -> usize {
        lock(&self.0.counts).get(route).copied().unwrap_or(0)
    }

    /// Shutdown: every waiter is woken and answered now (`admission::Wait`), and no request
    /// waits from here on.
    pub fn stop(&self) {
        self.0.stop.send_replace(true);
    }

    /// Resolves once [`Waiters::stop`] has been called.
    pub async fn stopped(&self) {
        let mut rx = self.0.stop.subscribe();
        // The sender lives as long as `self`: `wait_for` ends only by the stop.
        let _ = rx.wait_for(|stopped| *stopped).await;
    }
}

/// One waiter's place on its route, given back when dropped.
#[derive(Debug)]
pub struct Place {
    waiters: Waiters,
    route: Arc<str>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut counts = lock(&self.waiters.0.counts);
        if let Some(count) = counts.get_mut(&self.route) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&self.route);
            }
        }
    }
}

/// A poisoned lock only means a panic elsewhere mid-update of a count; the counts stay usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_holds_at_most_its_cap_and_places_come_back() {
        let waiters = Waiters::default();
        let route: Arc<str> = "r".into();
        let a = waiters.enter(&route, 2).expect("first");
        let b = waiters.enter(&route, 2).expect("second");
        assert!(waiters.enter(&route, 2).is_none(), "full");
        assert!(waiters.enter(&"other".into(), 2).is_some(), "per route");
        drop(a);
        assert_eq!(waiters.waiting("r"), 1);
        assert!(waiters.enter(&route, 2).is_some());
        drop(b);
        waiters.stop();
        assert!(
            waiters.enter(&route, 2).is_none(),
            "no waiting once stopping"
        );
    }
}
