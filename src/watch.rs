//! Watches the config file so that edits apply without a signal.
//!
//! In Kubernetes a ConfigMap volume never sends SIGHUP: the kubelet writes a new timestamped
//! directory and swaps the `..data` symlink to it (`DIR/policies.yaml -> ..data/policies.yaml`,
//! `..data -> ..2026_11_22_xx`). Editors and config tools save by rename; people edit in place. All
//! three show up as directory events, so the watcher follows the directory of the path as given and
//! the directory of every hop of its symlink chain, re-resolving the chain after each change.
//!
//! Events only wake it up: what decides is the file's content. After a short debounce (a tool may
//! write in several steps) it reads the file through its symlinks and reports a change only when
//! the bytes differ from the last ones it reported, so unrelated files in the directory, `touch`,
//! or a swap to identical content cause no reload. Where inotify is unavailable (or a watch was
//! lost) a poll of the content bounds the delay all the same.
//!
//! Two gaps would otherwise leave a change to that poll, seconds late. A change between a caller's
//! load and the watch is caught because the directories are watched before the content is read,
//! and a caller that loaded earlier says what it loaded ([`ConfigWatcher::since`]). An event taken
//! by a `changed()` that was then dropped (the losing branch of a `select!`) is not lost: the
//! wake-up is kept until the content has been checked.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

/// How long the watcher waits after an event for further ones before it reads the file.
pub const DEBOUNCE: Duration = Duration::from_millis(150);
/// The content poll when directory events work (a safety net) and when they do not.
const POLL_WITH_EVENTS: Duration = Duration::from_secs(10);
const POLL_WITHOUT_EVENTS: Duration = Duration::from_secs(1);
/// The most symlink hops followed, as the kernel's own limit for a path.
const MAX_HOPS: usize = 40;

/// Tells when the content of a config file has changed.
pub struct ConfigWatcher {
    path: PathBuf,
    watcher: Option<RecommendedWatcher>,
    watched: BTreeSet<PathBuf>,
    events: mpsc::UnboundedReceiver<()>,
    /// SHA-256 of the content last reported (or seen at start); `None` when unreadable.
    last: Option<[u8; 32]>,
    /// Woken, and the content not checked since: kept across a dropped `changed()`.
    pending: bool,
}

impl std::fmt::Debug for ConfigWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigWatcher")
            .field("path", &self.path)
            .field("watched", &self.watched)
            .field("events", &self.watcher.is_some())
            .finish()
    }
}

impl ConfigWatcher {
    /// Starts watching `path`. The content as it is now counts as seen: the first change reported
    /// is the first one after this call. Never fails: without inotify it polls.
    pub fn new(path: &Path) -> Self {
        let mut this = Self::unread(path);
        this.last = content_hash(path);
        this
    }

    /// Starts watching `path`, which the caller read before this call and found to hold content
    /// whose SHA-256 is `seen` (`None`: nothing counts as seen). The content is checked at the
    /// first `changed()`, so a change made between that read and this call is reported at once.
    pub fn since(path: &Path, seen: Option<[u8; 32]>) -> Self {
        let mut this = Self::unread(path);
        this.last = seen;
        this.pending = true;
        this
    }

    /// Watching, before the content is read: a change after the read then always wakes it.
    fn unread(path: &Path) -> Self {
        let (tx, events) = mpsc::unbounded_channel();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            if may_change(&event) {
                let _ = tx.send(());
            }
        })
        .map_err(
            |e| tracing::warn!(error = %e, "cannot watch the config file; polling it every second"),
        )
        .ok();
        let mut this = ConfigWatcher {
            path: path.to_path_buf(),
            watcher,
            watched: BTreeSet::new(),
            events,
            last: None,
            pending: false,
        };
        this.rewatch();
        this
    }

    /// The file whose content is watched.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directories being watched (for tests and logs).
    pub fn watched(&self) -> impl Iterator<Item = &Path> {
        self.watched.iter().map(PathBuf::as_path)
    }

    /// Waits until the file's content differs from the last content reported.
    ///
    /// Cancel-safe: dropped while it debounces, the next call checks the content all the same.
    pub async fn changed(&mut self) {
        loop {
            if !self.pending {
                let poll = if self.watcher.is_some() && !self.watched.is_empty() {
                    POLL_WITH_EVENTS
                } else {
                    POLL_WITHOUT_EVENTS
                };
                let _ = tokio::time::timeout(poll, self.events.recv()).await;
                self.pending = true;
            }
            // Debounce: a writer may still be at work; take every event of the burst at once.
            tokio::time::sleep(DEBOUNCE).await;
            while self.events.try_recv().is_ok() {}
            self.rewatch();
            let now = content_hash(&self.path);
            self.pending = false;
            if now.is_some() && now != self.last {
                self.last = now;
                return;
            }
        }
    }

    /// Watches exactly the directories of the current symlink chain.
    fn rewatch(&mut self) {
        let Some(watcher) = self.watcher.as_mut() else {
            return;
        };
        let wanted = chain_dirs(&self.path);
        for gone in self.watched.difference(&wanted) {
            let _ = watcher.unwatch(gone);
        }
        let mut now = BTreeSet::new();
        for dir in wanted {
            if self.watched.contains(&dir)
                || watcher.watch(&dir, RecursiveMode::NonRecursive).is_ok()
            {
                now.insert(dir);
            }
        }
        self.watched = now;
    }
}

/// Whether an event may mean new content. Opening and reading do not, and they must not wake the
/// watcher: it reads the file itself after every wake-up, and that read's own open event would
/// wake it again, 150 ms later, for ever. Errors (a queue overflow) are a reason to look.
fn may_change(event: &notify::Result<notify::Event>) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match event {
        Ok(event) => match event.kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
            EventKind::Access(_) => false,
            _ => true,
        },
        Err(_) => true,
    }
}

/// The directory of `path` and of every link target along its symlink chain, and the directory
/// the chain finally resolves to.
fn chain_dirs(path: &Path) -> BTreeSet<PathBuf> {
    let mut dirs = BTreeSet::new();
    let mut current = absolute(path);
    for _ in 0..MAX_HOPS {
        if let Some(dir) = current.parent() {
            dirs.insert(dir.to_path_buf());
        }
        match std::fs::read_link(&current) {
            Ok(target) => {
                current = match current.parent() {
                    Some(dir) if target.is_relative() => dir.join(target),
                    _ => target,
                };
            }
            Err(_) => break,
        }
    }
    if let Some(dir) = std::fs::canonicalize(path)
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
    {
        dirs.insert(dir);
    }
    dirs
}

fn absolute(path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|cwd| cwd.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    }
}

/// SHA-256 of the file's bytes, through its symlinks; `None` while it cannot be read (a rename in
/// progress, a deleted file).
fn content_hash(path: &Path) -> Option<[u8; 32]> {
    std::fs::read(path).ok().map(|bytes| digest(&bytes))
}

/// The digest [`ConfigWatcher::since`] takes for content a caller has read.
pub fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// `DIR/policies.yaml -> ..data/policies.yaml`, `..data -> ..v1`, as the kubelet lays it out.
    fn configmap_layout(dir: &Path, version: &str, content: &str) {
        let versioned = dir.join(version);
        std::fs::create_dir_all(&versioned).expect("mkdir");
        std::fs::write(versioned.join("policies.yaml"), content).expect("write");
        let tmp = dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        symlink(version, &tmp).expect("symlink");
        std::fs::rename(&tmp, dir.join("..data")).expect("swap ..data");
        let link = dir.join("policies.yaml");
        if std::fs::symlink_metadata(&link).is_err() {
            symlink("..data/policies.yaml", &link).expect("symlink");
        }
    }

    #[test]
    fn the_chain_of_a_configmap_mount_is_watched_at_every_hop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("canonical");
        configmap_layout(&root, "..v1", "a: 1\n");
        let dirs = chain_dirs(&root.join("policies.yaml"));
        assert!(dirs.contains(&root), "{dirs:?}");
        assert!(dirs.contains(&root.join("..v1")), "{dirs:?}");
    }

    async fn changes_within(watcher: &mut ConfigWatcher, bound: Duration) -> bool {
        tokio::time::timeout(bound, watcher.changed()).await.is_ok()
    }

    /// The watcher's own read of the file (and anyone else's) is no event: before this check it
    /// woke itself every 150 ms, reading and hashing the file each time, for as long as it ran.
    #[tokio::test]
    async fn reading_the_file_wakes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policies.yaml");
        std::fs::write(&path, "a: 1\n").expect("write");
        let mut watcher = ConfigWatcher::new(&path);
        tokio::time::sleep(Duration::from_millis(200)).await;
        while watcher.events.try_recv().is_ok() {}

        for _ in 0..3 {
            assert!(content_hash(&path).is_some());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            watcher.events.try_recv().is_err(),
            "a read woke the watcher"
        );

        // A write still does.
        std::fs::write(&path, "a: 2\n").expect("write");
        let woken = tokio::time::timeout(Duration::from_secs(5), watcher.events.recv()).await;
        assert!(
            matches!(woken, Ok(Some(()))),
            "a write did not wake the watcher"
        );
    }

    /// A caller that loaded the file before the watch began hears of a change made in between
    /// at once, not at the next poll (10 s); the content it loaded is no change.
    #[tokio::test]
    async fn a_change_between_the_load_and_the_watch_is_reported_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("overrides.yaml");
        std::fs::write(&path, "a: 1\n").expect("write");
        let loaded = digest(b"a: 1\n");

        let mut unchanged = ConfigWatcher::since(&path, Some(loaded));
        assert!(!changes_within(&mut unchanged, Duration::from_millis(600)).await);

        std::fs::write(&path, "a: 2\n").expect("write");
        let mut watcher = ConfigWatcher::since(&path, Some(loaded));
        assert!(changes_within(&mut watcher, Duration::from_secs(2)).await);
        // Reported once: the new content is now the content seen.
        assert!(!changes_within(&mut watcher, Duration::from_millis(600)).await);
    }

    /// `changed()` dropped while it debounces (the losing branch of a `select!`) has taken the
    /// event from the queue; the next call must still check the content rather than wait for the
    /// poll, 10 s later.
    #[tokio::test]
    async fn a_dropped_wait_loses_no_wake_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policies.yaml");
        std::fs::write(&path, "a: 1\n").expect("write");
        let mut watcher = ConfigWatcher::new(&path);
        // One write on a file already open is one event (a save by `write` or rename makes
        // several, and a later one would hide the loss).
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open");
        tokio::time::sleep(Duration::from_millis(100)).await;
        while watcher.events.try_recv().is_ok() {}
        std::io::Write::write_all(&mut file, b"a: 2\n").expect("write");
        // The event is queued well before the wait that takes it is dropped, mid-debounce.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!changes_within(&mut watcher, DEBOUNCE / 3).await);
        assert!(
            changes_within(&mut watcher, Duration::from_secs(2)).await,
            "the wake-up was lost with the dropped wait"
        );
        drop(file);
    }

    #[tokio::test]
    async fn each_kind_of_save_is_seen_and_identical_content_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("canonical");
        configmap_layout(&root, "..v1", "a: 1\n");
        let path = root.join("policies.yaml");
        let mut watcher = ConfigWatcher::new(&path);
        let bound = Duration::from_secs(2);

        // The kubelet's swap of `..data`.
        configmap_layout(&root, "..v2", "a: 2\n");
        assert!(changes_within(&mut watcher, bound).await, "..data swap");

        // A swap to identical content changes nothing.
        configmap_layout(&root, "..v3", "a: 2\n");
        assert!(!changes_within(&mut watcher, Duration::from_millis(800)).await);

        // An edit in place of the file the chain resolves to.
        std::fs::write(root.join("..v3/policies.yaml"), "a: 3\n").expect("write");
        assert!(changes_within(&mut watcher, bound).await, "edit in place");

        // A plain file replaced by rename, as editors save.
        let plain = root.join("plain.yaml");
        std::fs::write(&plain, "b: 1\n").expect("write");
        let mut watcher = ConfigWatcher::new(&plain);
        std::fs::write(root.join("plain.yaml.tmp"), "b: 2\n").expect("write");
        std::fs::rename(root.join("plain.yaml.tmp"), &plain).expect("rename");
        assert!(changes_within(&mut watcher, bound).await, "rename");

        // An unrelated file in the directory wakes the watcher but is no change.
        std::fs::write(root.join("other.txt"), "x").expect("write");
        assert!(!changes_within(&mut watcher, Duration::from_millis(800)).await);
    }
}
