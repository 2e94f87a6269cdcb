//! One owner for the gateway's long-lived background tasks: [`Shutdown`] spawns them, hands each
//! the stop signal, and on [`Shutdown::stop`] signals them and awaits every one. Each task holds a
//! guard while it runs, so [`Tasks::alive`] says how many have not finished yet.
//!
//! Tasks come in two groups: the main group (listeners, sweeper, overrides sync, certificate
//! watch), stopped and awaited first, and the last group (the admin listener), stopped once the
//! main group is done, so `/readyz` keeps answering "draining" while requests finish.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The background tasks of one running gateway, and the signals that stop them.
#[derive(Debug)]
pub struct Shutdown {
    main: Group,
    last: Group,
    alive: Tasks,
}

#[derive(Debug)]
struct Group {
    stop: watch::Sender<bool>,
    tasks: Vec<(&'static str, JoinHandle<()>)>,
}

impl Group {
    fn new() -> Self {
        Group {
            stop: watch::channel(false).0,
            tasks: Vec::new(),
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        for (name, task) in self.tasks {
            if let Err(e) = task.await {
                tracing::error!(task = name, error = %e, "a background task failed");
            }
        }
    }
}

/// A count of the owned tasks still running: each holds one [`Alive`] guard until it ends.
#[derive(Debug, Clone, Default)]
pub struct Tasks(Arc<AtomicUsize>);

impl Tasks {
    /// How many owned tasks have not finished yet.
    pub fn alive(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    fn guard(&self) -> Alive {
        self.0.fetch_add(1, Ordering::SeqCst);
        Alive(self.0.clone())
    }
}

/// Held by a running task; dropped (and counted out) when the task's future ends or is dropped.
struct Alive(Arc<AtomicUsize>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Self {
        Shutdown {
            main: Group::new(),
            last: Group::new(),
            alive: Tasks::default(),
        }
    }

    /// The stop signal of the main group: it changes to `true` when [`Shutdown::stop`] begins.
    pub fn signal(&self) -> watch::Receiver<bool> {
        self.main.stop.subscribe()
    }

    /// The stop signal of the last group: it changes once the main group has finished.
    pub fn last_signal(&self) -> watch::Receiver<bool> {
        self.last.stop.subscribe()
    }

    /// Spawns `task` into the main group. It must end soon after [`Shutdown::signal`] changes.
    pub fn spawn<F>(&mut self, name: &'static str, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.start(task);
        self.main.tasks.push((name, handle));
    }

    /// Spawns `task` into the last group. It must end soon after [`Shutdown::last_signal`]
    /// changes.
    pub fn spawn_last<F>(&mut self, name: &'static str, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.start(task);
        self.last.tasks.push((name, handle));
    }

    /// Spawns `task` into the main group, ended at the stop signal (for a loop with no stop of
    /// its own).
    pub fn spawn_until_stopped<F>(&mut self, name: &'static str, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let mut stop = self.signal();
        self.spawn(name, async move {
            tokio::select! {
                () = task => {}
                _ = stop.wait_for(|stopped| *stopped) => {}
            }
        });
    }

    fn start<F>(&self, task: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let alive = self.alive.guard();
        tokio::spawn(async move {
            let _alive = alive;
            task.await;
        })
    }

    /// The live count of the owned tasks, readable after [`Shutdown::stop`] consumed `self`.
    pub fn tasks(&self) -> Tasks {
        self.alive.clone()
    }

    /// Signals the main group and awaits all of it, then does the same for the last group.
    pub async fn stop(self) {
        self.main.stop().await;
        self.last.stop().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stop_awaits_every_task_in_order() {
        let mut shutdown = Shutdown::new();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (mut stop, log) = (shutdown.signal(), order.clone());
        shutdown.spawn("main", async move {
            let _ = stop.changed().await;
            log.lock().unwrap().push("main");
        });
        let (mut stop, log) = (shutdown.last_signal(), order.clone());
        shutdown.spawn_last("last", async move {
            let _ = stop.changed().await;
            log.lock().unwrap().push("last");
        });
        shutdown.spawn_until_stopped("forever", std::future::pending());
        let tasks = shutdown.tasks();
        assert_eq!(tasks.alive(), 3);
        shutdown.stop().await;
        assert_eq!(tasks.alive(), 0);
        assert_eq!(*order.lock().unwrap(), ["main", "last"]);
    }
}
