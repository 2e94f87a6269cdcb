//! The HTTP/2 side of an upstream target (`protocol: h2`): one multiplexed connection, shared by
//! every request to the target, opened on first use and opened again once it has closed (the
//! upstream went away, sent GOAWAY, or stopped answering pings).
//!
//! The connection is h2c with prior knowledge (RFC 9113 §3.3) to an `http://` target and TLS with
//! ALPN `h2` to an `https://` one. Streams beyond the upstream's `SETTINGS_MAX_CONCURRENT_STREAMS`
//! wait in hyper for a free one, within the request's deadline for its response head. Bodies and
//! trailers stream both ways as frames: what gRPC's streaming calls need.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Request, Uri, Version};
use hyper::client::conn::http2::{self, SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use super::body::RequestBody;
use super::pool::ClientError;
use crate::tls::connect::Stream;

/// How often a connection is pinged (idle or not), and how long a ping may go unanswered before
/// the connection counts as dead (and the next request opens another).
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(10);

/// One target's HTTP/2 connection.
#[derive(Default)]
pub struct H2Conn {
    /// The open connection's handle (cheap to clone: one per request).
    current: Mutex<Option<SendRequest<RequestBody>>>,
    /// Held while a connection is opened, so that the requests that find none wait for the one
    /// connect rather than each opening its own.
    opening: tokio::sync::Mutex<()>,
}

impl H2Conn {
    /// The open connection, if there is one.
    pub fn current(&self) -> Option<SendRequest<RequestBody>> {
        let mut current = lock(&self.current);
        if current.as_ref().is_some_and(SendRequest::is_closed) {
            *current = None;
        }
        current.clone()
    }

    /// The open connection, or a new one made over what `dial` connects.
    pub async fn open<F>(&self, dial: F) -> Result<SendRequest<RequestBody>, ClientError>
    where
        F: std::future::Future<Output = Result<TokioIo<Stream>, ClientError>>,
    {
        let _opening = self.opening.lock().await;
        if let Some(open) = self.current() {
            return Ok(open);
        }
        let io = dial.await?;
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(PING_INTERVAL)
            .keep_alive_timeout(PING_TIMEOUT)
            .keep_alive_while_idle(true)
            .handshake(io)
            .await
            .map_err(|e| ClientError::Connect(e.into()))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "upstream h2 connection ended with an error");
            }
        });
        *lock(&self.current) = Some(sender.clone());
        Ok(sender)
    }
}

/// Makes an HTTP/1.1-shaped request (origin-form URI, `Host`) an HTTP/2 one: the authority moves
/// from `Host` into the URI, which h2 sends as `:authority` (RFC 9113 §8.3.1), with the target's
/// scheme. `fallback` is used when the request names no valid authority. Applying it twice
/// (a retry on another target) changes nothing more.
pub fn h2_form(req: &mut Request<RequestBody>, scheme: &Scheme, fallback: &Authority) {
    let host = req.headers_mut().remove(http::header::HOST);
    let authority = host
        .as_ref()
        .and_then(|h| Authority::try_from(h.as_bytes()).ok())
        .or_else(|| req.uri().authority().cloned())
        .unwrap_or_else(|| fallback.clone());
    let path = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(scheme.clone());
    parts.authority = Some(authority);
    parts.path_and_query = Some(path);
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    }
    *req.version_mut() = Version::HTTP_2;
}

/// `te: trailers`, the one `TE` HTTP/2 allows (RFC 9113 §8.2.2), which gRPC servers require.
pub static TE_TRAILERS: HeaderValue = HeaderValue::from_static("trailers");

/// Whether the client's `TE` asks for trailers (RFC 9110 §10.1.4): kept for an h2 upstream.
pub fn wants_trailers(headers: &http::HeaderMap) -> bool {
    headers.get_all(http::header::TE).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
    })
}

/// A poisoned lock only means a panic elsewhere while it was held; the handle is still valid.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(uri: &str, host: Option<&str>) -> Request<RequestBody> {
        let mut req = Request::new(RequestBody::new(
            super::super::body::ClientBody::empty(),
            1,
            Duration::from_secs(1),
            None,
        ));
        *req.uri_mut() = uri.parse().unwrap();
        if let Some(host) = host {
            req.headers_mut()
                .insert(http::header::HOST, HeaderValue::from_str(host).unwrap());
        }
        req
    }

    #[test]
    fn the_host_becomes_the_authority_once() {
        let fallback: Authority = "10.0.0.1:50051".parse().unwrap();
        let mut req = request("/pkg.Svc/Call?x=1", Some("api.example:8080"));
        h2_form(&mut req, &Scheme::HTTP, &fallback);
        assert_eq!(req.uri(), "http://api.example:8080/pkg.Svc/Call?x=1");
        assert!(req.headers().get(http::header::HOST).is_none());
        assert_eq!(req.version(), Version::HTTP_2);
        h2_form(&mut req, &Scheme::HTTP, &fallback);
        assert_eq!(req.uri(), "http://api.example:8080/pkg.Svc/Call?x=1");

        let mut bare = request("/pkg.Svc/Call", None);
        h2_form(&mut bare, &Scheme::HTTPS, &fallback);
        assert_eq!(bare.uri(), "https://10.0.0.1:50051/pkg.Svc/Call");
    }

    #[test]
    fn trailers_are_read_from_a_te_list() {
        let mut h = http::HeaderMap::new();
        assert!(!wants_trailers(&h));
        h.insert(http::header::TE, HeaderValue::from_static("gzip, Trailers"));
        assert!(wants_trailers(&h));
        h.insert(http::header::TE, HeaderValue::from_static("gzip"));
        assert!(!wants_trailers(&h));
    }
}
