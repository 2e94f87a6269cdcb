//! `turnstile healthcheck`: asks a running gateway's admin listener whether it is ready.
//!
//! The container image is distroless (no shell, no curl), so a `HEALTHCHECK` or a docker-compose
//! `healthcheck:` can only run the binary itself. The probe speaks just enough HTTP/1.1 for one
//! `GET` on a loopback admin listener: no TLS, no redirects, a bounded wait and a bounded read.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The admin listener's readiness endpoint at its default address.
pub const DEFAULT_URL: &str = "http://127.0.0.1:9901/readyz";

/// The most of a response the probe reads: a status line and a short body.
const MAX_RESPONSE: usize = 8 * 1024;

/// Why the gateway is not ready, or could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("`{0}` is not an http://HOST:PORT/PATH URL")]
    Url(String),
    #[error("cannot reach {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("no answer from {0}: {1}")]
    Io(String, std::io::Error),
    #[error("{0} answered {1}: {2}")]
    NotReady(String, u16, String),
    #[error("{0} did not answer in HTTP")]
    Malformed(String),
}

/// `GET url` within `timeout`; `Ok` only for a 2xx answer.
pub fn ready(url: &str, timeout: Duration) -> Result<(), ProbeError> {
    let (authority, path) = split_url(url).ok_or_else(|| ProbeError::Url(url.to_string()))?;
    let deadline = Instant::now() + timeout;
    let addrs: Vec<SocketAddr> = authority
        .to_socket_addrs()
        .map_err(|e| ProbeError::Connect(url.to_string(), e))?
        .collect();
    let mut last = None;
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, remaining(deadline)) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = stream.ok_or_else(|| {
        let e = last.unwrap_or_else(|| std::io::Error::other("no address"));
        ProbeError::Connect(url.to_string(), e)
    })?;
    let io = |e| ProbeError::Io(url.to_string(), e);
    stream
        .set_read_timeout(Some(remaining(deadline)))
        .map_err(io)?;
    stream
        .set_write_timeout(Some(remaining(deadline)))
        .map_err(io)?;
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nUser-Agent: turnstile-healthcheck\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(io)?;

    let mut response = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while response.len() < MAX_RESPONSE {
        let n = stream.read(&mut chunk).map_err(io)?;
        if n == 0 {
            break;
        }
        response.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&response);
    let status = text
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.get(2..5))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| ProbeError::Malformed(url.to_string()))?;
    if (200..300).contains(&status) {
        return Ok(());
    }
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, body)| body)
        .trim();
    Err(ProbeError::NotReady(
        url.to_string(),
        status,
        body.chars().take(200).collect(),
    ))
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// `http://HOST:PORT/PATH` into (`HOST:PORT`, `/PATH`).
fn split_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("http://")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let valid = !authority.is_empty()
        && authority.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
        })
        && !path.contains([' ', '\r', '\n']);
    valid.then_some((authority, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_authority_and_path() {
        assert_eq!(
            split_url("http://127.0.0.1:9901/readyz"),
            Some(("127.0.0.1:9901", "/readyz"))
        );
        assert_eq!(split_url("http://[::1]:9901"), Some(("[::1]:9901", "/")));
        assert_eq!(split_url("https://127.0.0.1:9901/readyz"), None);
        assert_eq!(split_url("http://127.0.0.1/readyz"), None);
        assert_eq!(split_url("http://127.0.0.1:99/a b"), None);
    }

    #[test]
    fn nothing_listening_is_a_connect_error() {
        // Bind, read the port, release it: nothing listens there now.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let url = format!("http://127.0.0.1:{port}/readyz");
        assert!(matches!(
            ready(&url, Duration::from_secs(2)),
            Err(ProbeError::Connect(..))
        ));
    }
}
