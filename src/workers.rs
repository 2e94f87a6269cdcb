//! Connection workers: with `--workers N` above one, each of N threads runs a single-threaded
//! tokio runtime of its own, and every connection a listener accepts ([`crate::listener`]) lives
//! its whole life on one of them, handed out in turn. The requests of a connection, its upstream
//! exchanges (each worker keeps its own idle upstream connections: [`crate::proxy::pool`]) and
//! their timers then stay on one thread and one core's cache. On tokio's work-stealing scheduler
//! a woken task runs on whichever thread polled the event, and the other thread steals: the same
//! instructions cost about a third more user time at two workers (docs/benchmarks.md).
//!
//! The accept loops, the admin listener, the gRPC doors and the background tasks stay on the
//! main runtime. Without workers (one worker, or in-process tests), connections are spawned on
//! the runtime that accepted them.

use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use tokio::net::TcpStream;
use tokio::runtime::Handle;

/// The process's connection workers, once started.
static WORKERS: OnceLock<Workers> = OnceLock::new();

thread_local! {
    /// This thread's worker number, from 1; 0 on every other thread.
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

struct Workers {
    handles: Box<[Handle]>,
    next: AtomicUsize,
}

/// Starts `count` worker threads (at most once a process; a second call changes nothing), each
/// reading the clock as it wakes with `on_unpark` as the main runtime does.
pub fn start(count: usize, on_unpark: fn()) -> std::io::Result<()> {
    if count == 0 || WORKERS.get().is_some() {
        return Ok(());
    }
    let mut handles = Vec::with_capacity(count);
    for number in 1..=count {
        let (sent, handle) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("turnstile-worker-{number}"))
            .spawn(move || {
                INDEX.with(|index| index.set(number));
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .on_thread_unpark(on_unpark)
                    .enable_all()
                    .build();
                match runtime {
                    Ok(runtime) => {
                        let _ = sent.send(Ok(runtime.handle().clone()));
                        // Runs the connections spawned on it until the process exits.
                        runtime.block_on(std::future::pending::<()>());
                    }
                    Err(e) => {
                        let _ = sent.send(Err(e));
                    }
                }
            })?;
        let handle = handle
            .recv()
            .map_err(|_| std::io::Error::other("a connection worker ended at start"))??;
        handles.push(handle);
    }
    let _ = WORKERS.set(Workers {
        handles: handles.into_boxed_slice(),
        next: AtomicUsize::new(0),
    });
    Ok(())
}

/// How many connection workers run (0 without them).
pub fn count() -> usize {
    WORKERS.get().map_or(0, |workers| workers.handles.len())
}

/// The worker this thread is, from 1 to [`count`]; 0 on any other thread.
pub fn index() -> usize {
    INDEX.with(Cell::get)
}

/// Runs `serve` on the accepted `stream`: on the next worker in turn, the stream moved to that
/// worker's runtime, or without workers as a task of the current runtime.
pub(crate) fn spawn_connection<F, Fut>(stream: TcpStream, serve: F)
where
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let Some(workers) = WORKERS.get() else {
        tokio::spawn(serve(stream));
        return;
    };
    // Deregistered from the accepting runtime; registered again on the worker's.
    let stream = Detached::from(stream);
    let turn = workers.next.fetch_add(1, Ordering::Relaxed) % workers.handles.len();
    workers.handles[turn].spawn(async move {
        match stream.into_tokio() {
            Ok(stream) => serve(stream).await,
            Err(e) => tracing::debug!(error = %e, "a worker cannot take a connection"),
        }
    });
}

/// A connection as it travels to the runtime that serves it.
pub(crate) trait IntoTokio: Send + 'static {
    fn into_tokio(self) -> std::io::Result<TcpStream>;
}

impl IntoTokio for TcpStream {
    fn into_tokio(self) -> std::io::Result<TcpStream> {
        Ok(self)
    }
}

/// Between runtimes a socket travels as a std one and is registered with the receiving runtime.
pub(crate) struct Detached(std::io::Result<std::net::TcpStream>);

impl From<TcpStream> for Detached {
    fn from(stream: TcpStream) -> Self {
        Detached(stream.into_std())
    }
}

impl IntoTokio for Detached {
    fn into_tokio(self) -> std::io::Result<TcpStream> {
        TcpStream::from_std(self.0?)
    }
}
