//! `jwks_url`: the fetch task of one [`KeyRing`].
//!
//! - The first fetch starts at once; after a good one, the next comes when its cache headers say
//!   (`Cache-Control: max-age`, minus `Age`; else `Expires` against `Date`; `no-cache` and
//!   `no-store` count as 0, RFC 9111 §5.2.2) clamped to [`jwks_refresh_min`, `jwks_refresh_max`],
//!   or after `jwks_refresh` when there are none.
//! - A token with an unknown `kid` asks for a refetch ([`KeyRing::unknown_kid`]); it runs no
//!   sooner than `jwks_refresh_min` after the last fetch began, so however many forged kids
//!   arrive, the identity provider sees at most one fetch per `jwks_refresh_min`.
//! - A failed fetch (no connection, a TLS failure, a status other than 200, a body over
//!   [`MAX_BODY_BYTES`] or not a usable JWK Set, no answer within `jwks_timeout`) keeps the last
//!   good keys and is retried after 1 s, 2 s, 4 s... up to `jwks_refresh` (at most 5 min); refetch
//!   requests wait for that retry.
//!
//! Requests never wait for any of this: they verify against the set in force.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use http::header::{ACCEPT, AGE, CACHE_CONTROL, DATE, EXPIRES, HOST};
use http::{HeaderMap, HeaderValue, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use tower::ServiceExt;

use super::keys::{parse_jwks, PublicKey, Strictness};
use super::ring::{KeyRing, Refetch, UrlSource};

/// A JWK Set larger than this is refused unread: identity providers publish a few keys, a few KiB.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// The longest wait between retries after failed fetches.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Opens a connection to a URL's host: the runtime lends the upstream connector (TCP, then TLS
/// with the source's trust and the host as SNI and name to verify). Any tower service that
/// dials a URI is one.
pub trait Connect: Clone + Send + Sync + 'static {
    type Io: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static;
    fn connect(&self, uri: Uri) -> Pin<Box<dyn Future<Output = std::io::Result<Self::Io>> + Send>>;
}

impl<C, I> Connect for C
where
    C: tower::Service<Uri, Response = I, Error = std::io::Error> + Clone + Send + Sync + 'static,
    C::Future: Send + 'static,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    type Io = I;

    fn connect(&self, uri: Uri) -> Pin<Box<dyn Future<Output = std::io::Result<I>> + Send>> {
        Box::pin(self.clone().oneshot(uri))
    }
}

/// Fetches until the ring is gone. `first` learns how the first fetch ended.
pub(super) async fn run<C>(
    ring: Weak<KeyRing>,
    refetch: Arc<Refetch>,
    source: UrlSource,
    client: C,
    first: tokio::sync::oneshot::Sender<Result<(), String>>,
) where
    C: Connect,
{
    let mut first = Some(first);
    let mut failures: u32 = 0;
    let mut wait = Duration::ZERO;
    let mut last_start: Option<tokio::time::Instant> = None;
    loop {
        let timer = tokio::time::sleep(wait);
        tokio::select! {
            _ = timer => {}
            // A refetch an unknown kid asked for; while failing, the retry timer decides.
            _ = refetch.notify.notified(), if failures == 0 => {
                if let Some(last) = last_start {
                    tokio::time::sleep_until(last + source.min).await;
                }
            }
        }
        refetch.wanted.store(false, Ordering::Release);
        last_start = Some(tokio::time::Instant::now());
        let result = fetch(&client, &source).await;
        let Some(ring) = ring.upgrade() else {
            return;
        };
        let outcome = match result {
            Ok((keys, lifetime)) => {
                failures = 0;
                ring.fetched(Ok(keys));
                wait = lifetime;
                Ok(())
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                ring.fetched(Err(e.clone()));
                wait = backoff(failures, source.refresh);
                Err(e)
            }
        };
        drop(ring);
        if let Some(tx) = first.take() {
            let _ = tx.send(outcome);
        }
    }
}

/// 1 s after the first failure, doubling, at most `cap` (and [`MAX_BACKOFF`]).
fn backoff(failures: u32, cap: Duration) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    Duration::from_secs(1 << exp)
        .min(cap.min(MAX_BACKOFF))
        .max(Duration::from_millis(100))
}

/// An error and its causes, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        message.push_str(": ");
        message.push_str(&c.to_string());
        cause = c.source();
    }
    message
}

/// One GET of the URL on a connection of its own (fetches are minutes apart): its usable keys
/// and how long they may be kept.
async fn fetch<C: Connect>(
    client: &C,
    source: &UrlSource,
) -> Result<(Vec<PublicKey>, Duration), String> {
    let url = &source.url;
    let host = url
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        .ok_or("the URL has no host")?;
    let path = url.path_and_query().map_or("/", |p| p.as_str());
    let request = Request::get(path)
        .header(HOST, host)
        .header(ACCEPT, "application/jwk-set+json, application/json")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let io = client.connect(url.clone()).await.map_err(|e| chain(&e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| chain(&e))?;
        // Ends with the exchange: the response is read to its end below, then dropped.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let response = sender.send_request(request).await.map_err(|e| chain(&e))?;
        if response.status() != StatusCode::OK {
            return Err(format!("answered {}", response.status()));
        }
        let lifetime = lifetime(response.headers(), source, SystemTime::now());
        let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|e| format!("reading the body: {e}"))?
            .to_bytes();
        let text = std::str::from_utf8(&body).map_err(|_| "the body is not UTF-8".to_string())?;
        let keys = parse_jwks(text, &source.url.to_string(), Strictness::Skip)?;
        Ok((keys, lifetime))
    };
    tokio::time::timeout(source.timeout, exchange)
        .await
        .map_err(|_| format!("no answer within {:?}", source.timeout))?
}

/// How long a fetched set may be kept before the next fetch (RFC 9111 §4.2.1: `max-age` first,
/// then `Expires`), clamped to the source's bounds; `refresh` without either.
pub(super) fn lifetime(headers: &HeaderMap, source: &UrlSource, now: SystemTime) -> Duration {
    let text = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let mut max_age = None;
    for directive in headers
        .get_all(CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
    {
        let directive = directive.trim();
        let lower = directive.to_ascii_lowercase();
        if lower == "no-cache" || lower == "no-store" {
            max_age = Some(0);
        } else if let Some(value) = lower.strip_prefix("max-age=") {
            // An invalid value is stale (RFC 9111 §4.2.1).
            let seconds = value.trim_matches('"').parse::<u64>().unwrap_or(0);
            max_age = Some(max_age.map_or(seconds, |m: u64| m.min(seconds)));
        }
    }
    let fresh = match max_age {
        Some(seconds) => {
            let age = text(AGE).and_then(|a| a.parse::<u64>().ok()).unwrap_or(0);
            Some(Duration::from_secs(seconds.saturating_sub(age)))
        }
        None => text(EXPIRES).map(|expires| {
            let date = text(DATE)
                .and_then(|d| httpdate::parse_http_date(d).ok())
                .unwrap_or(now);
            // An invalid date (`0`) means already expired (RFC 9111 §5.3).
            httpdate::parse_http_date(expires)
                .ok()
                .and_then(|e| e.duration_since(date).ok())
                .unwrap_or(Duration::ZERO)
        }),
    };
    match fresh {
        Some(d) => d.clamp(source.min, source.max),
        None => source.refresh,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> UrlSource {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        UrlSource {
            url: "https://idp.example/jwks".parse().expect("uri"),
            ca: None,
            refresh: Duration::from_secs(300),
            min: Duration::from_secs(30),
            max: Duration::from_secs(3600),
            timeout: Duration::from_secs(5),
            tls: Arc::new(tls),
        }
    }

    fn headers(fields: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            map.append(*name, value.parse().expect("value"));
        }
        map
    }

    #[test]
    fn cache_headers_set_the_next_fetch_within_the_bounds() {
        let s = source();
        let now = httpdate::parse_http_date("Wed, 02 Dec 2026 01:00:00 GMT").expect("date");
        let at = |fields: &[(&'static str, &str)]| lifetime(&headers(fields), &s, now).as_secs();
        assert_eq!(at(&[]), 300, "no cache headers: jwks_refresh");
        assert_eq!(at(&[("cache-control", "public, max-age=600")]), 600);
        assert_eq!(at(&[("cache-control", "max-age=600"), ("age", "100")]), 500);
        assert_eq!(at(&[("cache-control", "max-age=5")]), 30, "clamped to min");
        assert_eq!(at(&[("cache-control", "max-age=86400")]), 3600, "to max");
        assert_eq!(at(&[("cache-control", "no-cache")]), 30);
        assert_eq!(
            at(&[
                ("date", "Wed, 02 Dec 2026 01:00:00 GMT"),
                ("expires", "Wed, 02 Dec 2026 01:20:00 GMT")
            ]),
            1200
        );
        assert_eq!(at(&[("expires", "0")]), 30, "invalid Expires is stale");
        // max-age wins over Expires.
        assert_eq!(
            at(&[
                ("cache-control", "max-age=120"),
                ("expires", "Wed, 02 Dec 2026 01:20:00 GMT")
            ]),
            120
        );
    }

    #[test]
    fn retries_back_off_to_the_refresh_interval() {
        let cap = Duration::from_secs(20);
        let waits: Vec<u64> = (1..8).map(|f| backoff(f, cap).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 20, 20]);
    }
}
