//! The store matrix: one behaviour test, run on the in-process store and on a real Redis, as
//! `tests/conformance.rs` does for the algorithms (and limitador for its storages).
//!
//! A test is an `async fn name(store: TestStore)` that puts [`TestStore::yaml`] into its config;
//! `store_matrix!(name, ...)` then declares `memory::name` and `redis::name`, each starting its
//! own store (a Redis per test, stopped by PID when the test ends).

use super::redis::RedisServer;

/// One store of the matrix.
pub enum TestStore {
    Memory,
    Redis(RedisServer),
}

impl TestStore {
    pub fn memory() -> TestStore {
        TestStore::Memory
    }

    /// A fresh Redis on a free port.
    pub fn redis() -> TestStore {
        TestStore::Redis(RedisServer::start())
    }

    /// The `store:` block of `policies.yaml` (top level, no trailing newline).
    pub fn yaml(&self) -> String {
        match self {
            TestStore::Memory => "store:\n  type: memory".to_owned(),
            TestStore::Redis(redis) => format!("store:\n  type: redis\n  url: {}", redis.url()),
        }
    }

    /// `yaml` (a whole config without a `store:` block) on this store.
    pub fn config(&self, yaml: &str) -> String {
        format!("{}\n{yaml}", self.yaml())
    }

    pub fn name(&self) -> &'static str {
        match self {
            TestStore::Memory => "memory",
            TestStore::Redis(_) => "redis",
        }
    }
}

/// Declares `memory::NAME` and `redis::NAME` tests for each `async fn NAME(store: TestStore)`.
#[macro_export]
macro_rules! store_matrix {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::stores::TestStore::memory()).await
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::stores::TestStore::redis()).await
                }
            )*
        }
    };
}
