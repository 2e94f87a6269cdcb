//! Waking the requests that wait for a lease on Redis (`lease_queue`, decide.lua's "Waiting for a
//! lease"): the script that hands a lease on PUBLISHes its id on the channel of the waiter's
//! instance; each instance holds one subscriber connection to its own channel, opened when its
//! first request waits, and wakes the local waiter the id names. Nothing polls.
//!
//! A message lost while the subscriber reconnects costs its waiter the wait: it gives up at its
//! `max_delay`, and its leaving releases the lease it was handed, which hands it on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use fred::clients::SubscriberClient;
use fred::prelude::ReconnectPolicy;
use fred::prelude::{Builder, ClientLike, EventInterface, PubsubInterface};
use fred::types::config::{Config, ConnectionConfig};
use tokio::sync::{oneshot, OnceCell};

use crate::limiter::StoreError;

/// This instance's waiters and its wake channel.
pub(super) struct Wake {
    /// This process's name in tickets (random hex: unique among the instances on one Redis).
    pub instance: String,
    /// The channels' common prefix (the store's key prefix, then `turnstile-wake:`); this
    /// instance's channel is the prefix and `instance`.
    pub prefix: String,
    config: Config,
    connection: ConnectionConfig,
    /// Lease id → its waiter, from before its ticket is queued until it is woken or leaves.
    waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<()>>>>,
    subscriber: OnceCell<SubscriberClient>,
}

impl Wake {
    pub fn new(config: Config, connection: ConnectionConfig, key_prefix: &str) -> Self {
        use std::hash::{BuildHasher, Hasher};
        // Unique among the instances on one Redis: the standard library's per-process hash keys,
        // the process id and the time.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        let instance = h.finish();
        Wake {
            instance: format!("{instance:x}"),
            prefix: format!("{key_prefix}turnstile-wake:"),
            config,
            connection,
            waiting: Arc::default(),
            subscriber: OnceCell::new(),
        }
    }

    /// Subscribes to this instance's channel, once: a ticket is only queued once a hand-off to
    /// it would be heard.
    pub async fn ready(&self) -> Result<(), StoreError> {
        self.subscriber
            .get_or_try_init(|| self.subscribe())
            .await
            .map(|_| ())
    }

    async fn subscribe(&self) -> Result<SubscriberClient, StoreError> {
        let failed = |e: fred::error::Error| StoreError::Connection(e.details().to_string());
        let client = Builder::from_config(self.config.clone())
            .set_connection_config(self.connection.clone())
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 1_000, 2))
            .build_subscriber_client()
            .map_err(failed)?;
        client.init().await.map_err(failed)?;
        // Subscribed again after every reconnection.
        drop(client.manage_subscriptions());
        let waiting = self.waiting.clone();
        let mut messages = client.message_rx();
        tokio::spawn(async move {
            loop {
                match messages.recv().await {
                    Ok(message) => {
                        let lease = message.value.as_string().and_then(|v| v.parse().ok());
                        let woken = lease.and_then(|lease: u64| lock(&waiting).remove(&lease));
                        if let Some(wake) = woken {
                            // A waiter gone meanwhile leaves, releasing the lease.
                            let _ = wake.send(());
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        });
        let channel = format!("{}{}", self.prefix, self.instance);
        client.subscribe(channel).await.map_err(failed)?;
        Ok(client)
    }

    /// Registers the waiter for `lease` before its ticket is queued, so its wake-up cannot come
    /// first.
    pub fn register(&self, lease: u64) -> oneshot::Receiver<()> {
        let (wake, woken) = oneshot::channel();
        lock(&self.waiting).insert(lease, wake);
        woken
    }

    /// Forgets the waiter for `lease` (granted at once, queued in vain, or leaving).
    pub fn forget(&self, lease: u64) {
        lock(&self.waiting).remove(&lease);
    }

    /// Waiters registered now.
    pub fn waiting(&self) -> usize {
        lock(&self.waiting).len()
    }

    /// Closes the subscriber connection.
    pub fn quit(&self) {
        if let Some(client) = self.subscriber.get() {
            let client = client.clone();
            tokio::spawn(async move {
                let _ = client.quit().await;
            });
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
