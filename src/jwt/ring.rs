//! The keys in force and the tasks that keep them current (`docs/jwt.md`, "Keys that rotate").
//!
//! A [`KeyRing`] holds one [`KeySet`], swapped whole: a request loads it once and verifies
//! against it, never waiting for a fetch or a file read. Its sources are the HMAC secret (a file
//! or an environment variable), `jwks_file` and `jwks_url`. Config load reads the files (a bad
//! one fails the load); once the config serves, [`KeyRing::start`] watches the files as the
//! config file is watched ([`crate::watch::ConfigWatcher`]) and fetches the URL in the background
//! ([`super::fetch`]). A source that fails (a bad new file, a failed fetch) keeps its last good
//! keys, counted in `turnstile_jwt_key_loads_total{result="failed"}` and logged.
//!
//! A reload whose `jwt:` key sources are unchanged takes over the running ring, its keys and its
//! tasks ([`super::Verifier::activate`]); otherwise the new ring starts its own and the old one's
//! tasks end with it (dropping a ring aborts them).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts};
use tokio::sync::Notify;

use super::keys::{parse_jwks, secret_key, Key, KeySet, PublicKey, Strictness};

/// Where the keys come from, as the config names them: two rings with equal sources hold the
/// same keys, so a reload that keeps them keeps the running ring.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sources {
    pub hs256_secret_file: Option<PathBuf>,
    pub hs256_secret_env: Option<String>,
    pub jwks_file: Option<PathBuf>,
    pub jwks_url: Option<UrlSource>,
}

/// `jwks_url` and the settings of its fetches.
#[derive(Clone)]
pub struct UrlSource {
    pub url: http::Uri,
    /// `jwks_ca`, and SHA-256 of its content when read: a changed CA file is a changed source.
    pub ca: Option<(PathBuf, [u8; 32])>,
    /// `jwks_refresh`: the refresh interval of a response without cache headers.
    pub refresh: Duration,
    /// `jwks_refresh_min` / `jwks_refresh_max`: cache headers are clamped to these; `min` is
    /// also the least time from a fetch's start to a refetch an unknown `kid` asks for.
    pub min: Duration,
    pub max: Duration,
    /// `jwks_timeout`: one fetch, connect to last body byte.
    pub timeout: Duration,
    /// Trust: the system's CAs, or only `jwks_ca`'s (built by the config with `crate::tls`).
    pub tls: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for UrlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UrlSource")
            .field("url", &self.url)
            .field("ca", &self.ca.as_ref().map(|(p, _)| p))
            .field("refresh", &self.refresh)
            .field("min", &self.min)
            .field("max", &self.max)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl PartialEq for UrlSource {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.url,
            &self.ca,
            self.refresh,
            self.min,
            self.max,
            self.timeout,
        ) == (
            &other.url,
            &other.ca,
            other.refresh,
            other.min,
            other.max,
            other.timeout,
        )
    }
}

/// Which source a load came from (the `source` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    JwksUrl,
    JwksFile,
    SecretFile,
}

impl Source {
    const ALL: [Source; 3] = [Source::JwksUrl, Source::JwksFile, Source::SecretFile];

    pub fn as_str(self) -> &'static str {
        match self {
            Source::JwksUrl => "jwks_url",
            Source::JwksFile => "jwks_file",
            Source::SecretFile => "hs256_secret_file",
        }
    }
}

/// The key sources' and the token cache's series, made once per registry
/// (`crate::metrics::Metrics` registers them) and handed to each ring it starts.
#[derive(Debug, Clone)]
pub struct KeyMetrics {
    loads: IntCounterVec,
    keys: IntGaugeVec,
    cache: IntCounterVec,
    unknown_kid: IntCounter,
    /// (ok, failed) per [`Source::ALL`].
    by_source: [(IntCounter, IntCounter); 3],
    pub(crate) hits: IntCounter,
    pub(crate) misses: IntCounter,
}

impl Default for KeyMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyMetrics {
    pub fn new() -> KeyMetrics {
        fn fail<T>(e: prometheus::Error) -> T {
            panic!("jwt metrics: {e}")
        }
        let loads = IntCounterVec::new(
            Opts::new(
                "turnstile_jwt_key_loads_total",
                "Loads of JWT verification keys by source (jwks_url fetches, jwks_file and \
                 hs256_secret_file reads after a change): ok, or failed (the last good keys stay).",
            ),
            &["source", "result"],
        )
        .unwrap_or_else(fail);
        let keys = IntGaugeVec::new(
            Opts::new(
                "turnstile_jwt_keys",
                "Verification keys in force, by source.",
            ),
            &["source"],
        )
        .unwrap_or_else(fail);
        let cache = IntCounterVec::new(
            Opts::new(
                "turnstile_jwt_token_cache_total",
                "Bearer tokens looked up in the cache of verified tokens: hit (no signature \
                 check), or miss.",
            ),
            &["result"],
        )
        .unwrap_or_else(fail);
        let unknown_kid = IntCounter::new(
            "turnstile_jwt_unknown_kid_total",
            "Tokens whose kid no key in force has (each asks for a jwks_url refetch, at most \
             one per jwks_refresh_min).",
        )
        .unwrap_or_else(fail);
        let by_source = Source::ALL.map(|s| {
            (
                loads.with_label_values(&[s.as_str(), "ok"]),
                loads.with_label_values(&[s.as_str(), "failed"]),
            )
        });
        KeyMetrics {
            hits: cache.with_label_values(&["hit"]),
            misses: cache.with_label_values(&["miss"]),
            loads,
            keys,
            cache,
            unknown_kid,
            by_source,
        }
    }

    /// The collectors to register.
    pub fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.loads.clone()),
            Box::new(self.keys.clone()),
            Box::new(self.cache.clone()),
            Box::new(self.unknown_kid.clone()),
        ]
    }

    fn load(&self, source: Source, ok: bool) {
        let (good, bad) = &self.by_source[source as usize];
        if ok { good } else { bad }.inc();
    }
}

/// The keys of each source, as last loaded.
#[derive(Default)]
struct Parts {
    hmac: Option<Key>,
    file: Vec<PublicKey>,
    url: Vec<PublicKey>,
}

/// A request for a refetch, set by a token with an unknown `kid`.
#[derive(Default)]
pub(super) struct Refetch {
    pub wanted: AtomicBool,
    pub notify: Notify,
}

/// The keys in force, and the tasks that keep them current (aborted when the ring is dropped).
pub struct KeyRing {
    pub(super) sources: Sources,
    set: ArcSwap<KeySet>,
    parts: Mutex<Parts>,
    pub(super) refetch: Arc<Refetch>,
    pub(super) metrics: OnceLock<KeyMetrics>,
    /// SHA-256 of the files as config load read them: their watches start from these.
    seen: (Option<[u8; 32]>, Option<[u8; 32]>),
    started: AtomicBool,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl Drop for KeyRing {
    fn drop(&mut self) {
        let tasks = self.tasks.get_mut().unwrap_or_else(|e| e.into_inner());
        for task in tasks.drain(..) {
            task.abort();
        }
    }
}

impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.set.load();
        f.debug_struct("KeyRing")
            .field("sources", &self.sources)
            .field("hmac", &set.hmac.is_some())
            .field(
                "jwks_kids",
                &set.jwks
                    .iter()
                    .map(|k| k.kid.as_deref())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// What config load read: the secret and the file's keys, with the files' digests.
pub(super) struct Loaded {
    pub hmac: Option<Key>,
    pub file: Vec<PublicKey>,
    pub secret_seen: Option<[u8; 32]>,
    pub jwks_seen: Option<[u8; 32]>,
}

impl KeyRing {
    pub(super) fn new(sources: Sources, loaded: Loaded) -> KeyRing {
        let parts = Parts {
            hmac: loaded.hmac,
            file: loaded.file,
            url: Vec::new(),
        };
        let ring = KeyRing {
            sources,
            set: ArcSwap::from_pointee(KeySet::default()),
            parts: Mutex::new(parts),
            refetch: Arc::default(),
            metrics: OnceLock::new(),
            seen: (loaded.secret_seen, loaded.jwks_seen),
            started: AtomicBool::new(false),
            tasks: Mutex::default(),
        };
        ring.update(|_| {});
        ring
    }

    /// The set in force now.
    pub(super) fn set(&self) -> arc_swap::Guard<Arc<KeySet>> {
        self.set.load()
    }

    fn parts(&self) -> std::sync::MutexGuard<'_, Parts> {
        self.parts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Installs the set `parts` make (called with the parts' lock held, so two sources that
    /// change at once never install a set without the other's keys).
    fn install(&self, parts: &Parts) {
        let mut jwks = parts.file.clone();
        jwks.extend(parts.url.iter().cloned());
        self.set.store(Arc::new(KeySet {
            hmac: parts.hmac.clone(),
            jwks,
        }));
        if let Some(m) = self.metrics.get() {
            let count = |s: Source, n: usize| {
                m.keys.with_label_values(&[s.as_str()]).set(n as i64);
            };
            if self.sources.jwks_url.is_some() {
                count(Source::JwksUrl, parts.url.len());
            }
            if self.sources.jwks_file.is_some() {
                count(Source::JwksFile, parts.file.len());
            }
            if self.sources.hs256_secret_file.is_some() || self.sources.hs256_secret_env.is_some() {
                count(Source::SecretFile, usize::from(parts.hmac.is_some()));
            }
        }
    }

    fn update(&self, change: impl FnOnce(&mut Parts)) {
        let mut parts = self.parts();
        change(&mut parts);
        self.install(&parts);
    }

    /// A fetch of `jwks_url` succeeded (`Ok`) or failed: the set is replaced, or kept.
    pub(super) fn fetched(&self, result: Result<Vec<PublicKey>, String>) -> bool {
        let source = Source::JwksUrl;
        match result {
            Ok(keys) => {
                let kids: Vec<_> = keys.iter().filter_map(|k| k.kid.clone()).collect();
                self.update(|p| p.url = keys);
                self.record(source, true);
                tracing::debug!(?kids, "JWKS fetched");
                true
            }
            Err(e) => {
                self.record(source, false);
                tracing::warn!(
                    url = %self.sources.jwks_url.as_ref().map(|u| u.url.to_string()).unwrap_or_default(),
                    error = %e,
                    "JWKS fetch failed; the last good keys stay in force"
                );
                false
            }
        }
    }

    fn record(&self, source: Source, ok: bool) {
        if let Some(m) = self.metrics.get() {
            m.load(source, ok);
        }
    }

    /// A token named a `kid` no key has: ask for one refetch (the fetch task spaces them by
    /// `jwks_refresh_min`), and count it.
    pub(super) fn unknown_kid(&self) {
        if let Some(m) = self.metrics.get() {
            m.unknown_kid.inc();
        }
        if self.sources.jwks_url.is_some() && !self.refetch.wanted.swap(true, Ordering::AcqRel) {
            self.refetch.notify.notify_one();
        }
    }

    /// Re-reads a watched file after a change: its keys replace the old ones, or, when the new
    /// file is bad, the old ones stay (counted, logged).
    pub(super) fn reread(&self, source: Source, path: &Path) {
        let result = std::fs::read(path)
            .map_err(|e| format!("cannot read `{}`: {e}", path.display()))
            .and_then(|bytes| match source {
                Source::SecretFile => secret_key(bytes).map(|k| self.update(|p| p.hmac = Some(k))),
                _ => {
                    let text = String::from_utf8(bytes)
                        .map_err(|_| format!("`{}` is not UTF-8", path.display()))?;
                    let keys = parse_jwks(&text, &path.display().to_string(), Strictness::Refuse)?;
                    self.update(|p| p.file = keys);
                    Ok(())
                }
            });
        match result {
            Ok(()) => {
                self.record(source, true);
                tracing::info!(file = %path.display(), "JWT keys reloaded after a change");
            }
            Err(e) => {
                self.record(source, false);
                tracing::error!(
                    file = %path.display(),
                    error = %e,
                    "JWT key file changed but cannot be used; the keys in force stay"
                );
            }
        }
    }

    /// Starts the watches on the key files and the fetches of the URL, once; the tasks end with
    /// the ring. `connect` builds the connector for `jwks_url` from its TLS settings. Returns,
    /// with a URL, how the first fetch ended (its error when it failed).
    pub(super) fn start<C>(
        self: &Arc<Self>,
        metrics: &KeyMetrics,
        connect: impl FnOnce(&UrlSource) -> C,
    ) -> Option<tokio::sync::oneshot::Receiver<Result<(), String>>>
    where
        C: super::fetch::Connect,
    {
        if self.started.swap(true, Ordering::AcqRel) {
            return None;
        }
        let _ = self.metrics.set(metrics.clone());
        self.update(|_| {});
        let mut tasks = Vec::new();
        let files = [
            (
                Source::SecretFile,
                &self.sources.hs256_secret_file,
                self.seen.0,
            ),
            (Source::JwksFile, &self.sources.jwks_file, self.seen.1),
        ];
        for (source, path, seen) in files {
            if let Some(path) = path.clone() {
                tasks.push(tokio::spawn(watch_file(
                    Arc::downgrade(self),
                    source,
                    path,
                    seen,
                )));
            }
        }
        let first = self.sources.jwks_url.as_ref().map(|url| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let client = connect(url);
            tasks.push(tokio::spawn(super::fetch::run(
                Arc::downgrade(self),
                self.refetch.clone(),
                url.clone(),
                client,
                tx,
            )));
            rx
        });
        self.tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(tasks.iter().map(tokio::task::JoinHandle::abort_handle));
        first
    }
}

/// Re-reads `path` whenever its content changes (as the config file is watched), until the ring
/// is gone.
async fn watch_file(ring: Weak<KeyRing>, source: Source, path: PathBuf, seen: Option<[u8; 32]>) {
    let mut watcher = crate::watch::ConfigWatcher::since(&path, seen);
    loop {
        watcher.changed().await;
        let Some(ring) = ring.upgrade() else {
            return;
        };
        ring.reread(source, &path);
    }
}
