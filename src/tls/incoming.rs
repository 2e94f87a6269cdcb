//! TLS for servers that take their connections from a listener or a stream (axum for the admin
//! listener, tonic for ext_authz): [`TlsIncoming`] accepts, runs each handshake in its own task
//! (so a slow or silent client delays nobody else), and yields only the connections whose
//! handshake succeeded. [`Conn`] is one connection, plain or TLS, for code that serves both.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;

use super::ServerTls;

/// Handshakes in progress at once; past this, accepting waits (connections queue in the kernel's
/// backlog). Each lasts at most the handshake timeout.
const MAX_HANDSHAKES: usize = 1024;

/// Connections whose handshake is done and that the server has not taken yet.
const READY_QUEUE: usize = 64;

/// The accepted TLS connections of a listener. Dropping it stops accepting.
#[derive(Debug)]
pub struct TlsIncoming {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl TlsIncoming {
    /// Starts accepting on `listener` with `tls`.
    pub fn new(listener: TcpListener, tls: Arc<ServerTls>) -> io::Result<TlsIncoming> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_QUEUE);
        let accepting = tokio::spawn(accept_loop(listener, tls, tx));
        Ok(TlsIncoming {
            ready,
            local,
            accepting,
        })
    }

    /// The next connection whose handshake succeeded.
    pub async fn next(&mut self) -> Option<(TlsStream<TcpStream>, SocketAddr)> {
        self.ready.recv().await
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Arc<ServerTls>,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let permit = tokio::select! {
            permit = handshakes.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            () = ready.closed() => return,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = ready.closed() => return,
        };
        let _ = stream.set_nodelay(true);
        let (tls, ready) = (tls.clone(), ready.clone());
        tokio::spawn(async move {
            if let Some(stream) = tls.handshake(stream).await {
                let _ = ready.send((stream, peer)).await;
            }
            drop(permit);
        });
    }
}

impl axum::serve::Listener for TlsIncoming {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.next().await {
            Some(pair) => pair,
            // The accept task ended (only on drop): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}

impl futures_util::Stream for TlsIncoming {
    type Item = (TlsStream<TcpStream>, SocketAddr);

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().ready.poll_recv(cx)
    }
}

/// One accepted connection, plain or TLS.
#[derive(Debug)]
pub enum Conn {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Conn {
    /// The TCP connection underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Plain(stream) => stream,
            Conn::Tls(stream) => stream.get_ref().0,
        }
    }
}

super::plain_or_tls_io!(Conn);
