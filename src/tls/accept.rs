//! Accepting a TLS connection on the public listener: the handshake within its timeout, then the
//! client's first bytes within `server.header_read_timeout`, as the plain listener waits for them
//! (`crate::listener::protocol_known`) so that a client that completes a handshake and then stays
//! silent, or trickles an h2 preface, cannot hold a connection slot. Those first bytes are read
//! (a TLS stream cannot be peeked) and handed back to hyper in front of the stream ([`Prefixed`]).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

use super::prefixed::Prefixed;
use super::ServerTls;

/// The h2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The handshake, then the first bytes; `None` (counted and logged at debug level) when either
/// fails or takes too long.
pub async fn accept(
    tls: &ServerTls,
    stream: TcpStream,
    first_bytes_within: Duration,
) -> Option<Prefixed<TlsStream<TcpStream>>> {
    let stream = tls.handshake(stream).await?;
    first_bytes(stream, first_bytes_within).await
}

/// Reads until the bytes tell HTTP/1.1 from an h2 preface, for at most `limit`.
async fn first_bytes<S: AsyncRead + Unpin>(mut stream: S, limit: Duration) -> Option<Prefixed<S>> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = Vec::with_capacity(H2_PREFACE.len());
    let mut chunk = [0u8; H2_PREFACE.len()];
    loop {
        let want = H2_PREFACE.len() - buf.len();
        let n = match tokio::time::timeout_at(deadline, stream.read(&mut chunk[..want])).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return None,
        };
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() == H2_PREFACE.len() || buf[..] != H2_PREFACE[..buf.len()] {
            return Some(Prefixed::new(buf, stream));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn the_first_bytes_are_handed_back_in_order() {
        let (mut client, server) = tokio::io::duplex(64);
        client
            .write_all(b"GET / HTTP/1.1\r\n")
            .await
            .expect("write");
        let mut stream = first_bytes(server, Duration::from_secs(5))
            .await
            .expect("known");
        let mut got = vec![0u8; 16];
        stream.read_exact(&mut got).await.expect("read");
        assert_eq!(got, b"GET / HTTP/1.1\r\n");
    }

    #[tokio::test]
    async fn a_trickled_preface_is_cut_off_at_the_deadline() {
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(&H2_PREFACE[..10]).await.expect("write");
        assert!(first_bytes(server, Duration::from_millis(200))
            .await
            .is_none());
        drop(client);
    }
}
