//! A minimal HTTP/1.1 client for tests: one request per connection, bounded by a timeout.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// Lower-cased names.
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// `GET path` on `addr`, failing the test if no complete answer arrives within `limit`.
pub async fn get(addr: SocketAddr, path: &str, limit: Duration) -> Reply {
    tokio::time::timeout(limit, try_get(addr, path))
        .await
        .unwrap_or_else(|_| panic!("GET {path} on {addr}: no answer within {limit:?}"))
        .unwrap_or_else(|e| panic!("GET {path} on {addr}: {e}"))
}

pub async fn try_get(addr: SocketAddr, path: &str) -> std::io::Result<Reply> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response: {text:?}")))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_string(),
    })
}
