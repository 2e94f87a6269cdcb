//! An I/O stream that keeps something alive exactly as long as itself: a connection's
//! `max_connections` slot, and its count in the open-connections gauge.
//!
//! hyper gives an upgraded connection's stream to a tunnel when it answers `101`, and its
//! connection task ends there. What is tied to the task would be released while the tunnel still
//! holds the connection; what rides on the stream is released when the tunnel closes it.

use std::pin::Pin;
use std::task::{Context, Poll};

/// `io`, holding `held` until it is dropped.
pub struct Held<T, G> {
    io: T,
    _held: G,
}

impl<T, G> Held<T, G> {
    pub fn new(io: T, held: G) -> Self {
        Held { io, _held: held }
    }
}

impl<T: hyper::rt::Read + Unpin, G: Unpin> hyper::rt::Read for Held<T, G> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin, G: Unpin> hyper::rt::Write for Held<T, G> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
}
