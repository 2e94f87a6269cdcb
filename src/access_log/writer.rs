//! The access log's writer: a thread of its own that formats queued records and writes them,
//! so neither formatting nor a slow disk or pipe ever holds up a request's worker.
//!
//! It never sleeps on the queue itself: a receiver asleep there would have every request that
//! queues a record wake it, a system call and a context switch per request on the worker's core.
//! Instead it wakes every [`TICK`], takes every record queued by then, formats them into one
//! buffer and writes that with one call (one per [`BATCH_BYTES`]). It reopens a file output when
//! the reopen flag is raised (SIGUSR1), and stops when [`Writer::run`]'s stop signal changes,
//! after writing every record queued by then.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use prometheus::IntCounter;
use tokio::sync::watch;

use super::format::Formatter;
use super::Record;
use crate::config::observability::{AccessLogSettings, LogOutput};

/// How often the writer takes what was queued (and looks at its flags: reopen, stop). At 100k
/// requests a second a tick queues 1,000 records, far below the default `buffer`.
const TICK: Duration = Duration::from_millis(10);
/// Bytes formatted before a write, at most.
const BATCH_BYTES: usize = 64 * 1024;

/// The running writer thread, stopped by [`Writer::run`].
#[derive(Debug)]
pub struct Writer {
    reopen: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Where lines go.
enum Output {
    Stdout(io::Stdout),
    File { path: PathBuf, file: File },
}

impl Output {
    fn open(output: &LogOutput) -> io::Result<Output> {
        Ok(match output {
            LogOutput::Stdout => Output::Stdout(io::stdout()),
            LogOutput::File(path) => Output::File {
                file: append(path)?,
                path: path.clone(),
            },
        })
    }

    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Output::Stdout(out) => {
                let mut out = out.lock();
                out.write_all(bytes)?;
                out.flush()
            }
            Output::File { file, .. } => file.write_all(bytes),
        }
    }

    /// A file output opens its path afresh: logrotate has renamed the old file.
    fn reopen(&mut self) {
        if let Output::File { path, file } = self {
            match append(path) {
                Ok(fresh) => *file = fresh,
                Err(e) => tracing::error!(
                    file = %path.display(),
                    error = %e,
                    "cannot reopen the access log; writing on to the old file"
                ),
            }
        }
    }
}

fn append(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("access_log.output {}: {e}", path.display()),
            )
        })
}

impl Writer {
    /// Opens the output (an error names it) and starts the thread; returns the queue's sender.
    pub fn start(
        settings: &AccessLogSettings,
        written: IntCounter,
    ) -> io::Result<(SyncSender<Box<Record>>, Writer)> {
        let output = Output::open(&settings.output)?;
        let (tx, rx) = sync_channel(settings.buffer);
        let reopen = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let formatter = Formatter::new(settings);
        let flags = (reopen.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("access-log".to_string())
            .spawn(move || write_loop(rx, output, formatter, flags, written))?;
        Ok((
            tx,
            Writer {
                reopen,
                stop,
                thread: Some(thread),
            },
        ))
    }

    pub(super) fn reopen_flag(&self) -> Arc<AtomicBool> {
        self.reopen.clone()
    }

    /// Waits for `stop` to change, then stops the thread once it has written every queued
    /// record (for [`crate::shutdown::Shutdown`]).
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let _ = stop.wait_for(|stopped| *stopped).await;
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let joined = tokio::task::spawn_blocking(move || thread.join()).await;
            if !matches!(joined, Ok(Ok(()))) {
                tracing::error!("the access log writer failed");
            }
        }
    }
}

fn write_loop(
    rx: Receiver<Box<Record>>,
    mut output: Output,
    mut formatter: Formatter,
    (reopen, stop): (Arc<AtomicBool>, Arc<AtomicBool>),
    written: IntCounter,
) {
    let mut buf = Vec::with_capacity(BATCH_BYTES + 4096);
    let mut failing = false;
    loop {
        if reopen.swap(false, Ordering::Relaxed) {
            output.reopen();
        }
        // Read before draining: whatever was queued before the stop is written.
        let stopping = stop.load(Ordering::Relaxed);
        let mut lines = 0;
        let closed = loop {
            match rx.try_recv() {
                Ok(record) => {
                    formatter.line(&record, &mut buf);
                    lines += 1;
                    if buf.len() >= BATCH_BYTES {
                        write(&mut output, &mut buf, &mut failing);
                    }
                }
                Err(TryRecvError::Empty) => break false,
                Err(TryRecvError::Disconnected) => break true,
            }
        };
        write(&mut output, &mut buf, &mut failing);
        written.inc_by(lines);
        if stopping || closed {
            return;
        }
        std::thread::sleep(TICK);
    }
}

fn write(output: &mut Output, buf: &mut Vec<u8>, failing: &mut bool) {
    if buf.is_empty() {
        return;
    }
    match output.write_all(buf) {
        Ok(()) => *failing = false,
        Err(e) => {
            // One line per run of failures, not one per batch.
            if !*failing {
                tracing::error!(error = %e, "cannot write the access log");
            }
            *failing = true;
        }
    }
    buf.clear();
}
