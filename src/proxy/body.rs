//! Body types of the proxy. Bodies stream frame by frame in both directions; nothing is buffered.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::config::MinBodyRate;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the gateway sends to a client: an upstream's streamed body or one it wrote itself.
#[derive(Debug)]
pub enum ResponseBody {
    Upstream(super::pool::UpstreamBody),
    /// An upstream body whose target counts it in flight until it ends or drops.
    Balanced(super::pool::UpstreamBody, super::balance::InFlight),
    Full(Option<Bytes>),
    /// Any of the above carrying a [`Rider`] (a concurrency lease, `crate::inflight`) to its end.
    Riding(Box<Riding<dyn Rider>>),
}

/// What rides on a response body to its end without the proxy knowing what it is: a concurrency
/// lease released when the body ends, say.
pub trait Rider: Send + Sync + std::fmt::Debug {
    /// A data frame on its way to the client.
    fn data(&mut self, _data: &Bytes) {}

    /// The body ended: `complete` when its last frame went out, false when it failed. Called
    /// once; a body dropped before its end (the client went away) drops its rider without it.
    fn ended(&mut self, complete: bool);
}

/// A body carrying `R` ([`ResponseBody::riding`]).
#[derive(Debug)]
pub struct Riding<R: ?Sized> {
    body: ResponseBody,
    ended: bool,
    rider: R,
}

impl ResponseBody {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        ResponseBody::Full(Some(bytes.into()))
    }

    pub fn empty() -> Self {
        ResponseBody::Full(None)
    }

    /// `body`, carrying `rider` to its end (one allocation, as any boxed variant).
    pub fn riding(body: ResponseBody, rider: impl Rider + 'static) -> Self {
        ResponseBody::Riding(Box::new(Riding {
            body,
            ended: false,
            rider,
        }))
    }

    /// The upstream's fields still kept raw ([`super::fields`]): part of the response's fields,
    /// beside its `HeaderMap`.
    pub fn upstream_fields(&self) -> Option<&super::fields::RawFields> {
        match self {
            ResponseBody::Upstream(body) | ResponseBody::Balanced(body, _) => {
                body.upstream_fields()
            }
            ResponseBody::Riding(riding) => riding.body.upstream_fields(),
            ResponseBody::Full(_) => None,
        }
    }

    /// The upstream's raw fields, to set the gateway's own beside them.
    pub fn upstream_fields_mut(&mut self) -> Option<&mut super::fields::RawFields> {
        match self {
            ResponseBody::Upstream(body) | ResponseBody::Balanced(body, _) => {
                body.upstream_fields_mut()
            }
            ResponseBody::Riding(riding) => riding.body.upstream_fields_mut(),
            ResponseBody::Full(_) => None,
        }
    }

    /// Takes the upstream's raw fields, if any are left.
    pub fn take_upstream_fields(&mut self) -> Option<super::fields::RawFields> {
        self.upstream_fields_mut()
            .filter(|fields| !fields.is_empty())
            .map(std::mem::take)
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ResponseBody::Upstream(body) | ResponseBody::Balanced(body, _) => {
                Pin::new(body).poll_frame(cx).map_err(Into::into)
            }
            ResponseBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ResponseBody::Riding(riding) => riding.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Upstream(body) | ResponseBody::Balanced(body, _) => body.is_end_stream(),
            ResponseBody::Full(bytes) => bytes.is_none(),
            ResponseBody::Riding(riding) => riding.body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Upstream(body) | ResponseBody::Balanced(body, _) => body.size_hint(),
            ResponseBody::Full(Some(bytes)) => SizeHint::with_exact(bytes.len() as u64),
            ResponseBody::Full(None) => SizeHint::with_exact(0),
            ResponseBody::Riding(riding) => riding.body.size_hint(),
        }
    }
}

impl Riding<dyn Rider> {
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        let complete = match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.rider.data(data);
                }
                self.body.is_end_stream().then_some(true)
            }
            Poll::Ready(Some(Err(_))) => Some(false),
            Poll::Ready(None) => Some(true),
            Poll::Pending => None,
        };
        if let Some(complete) = complete {
            if !std::mem::replace(&mut self.ended, true) {
                self.rider.ended(complete);
            }
        }
        polled
    }
}

/// The body of a client's request as the gateway receives it: hyper's, or none at all for a
/// request the lean HTTP/1.1 server read whole (`crate::listener::h1`), which takes only requests
/// that declare no body.
#[derive(Debug)]
pub struct ClientBody(Option<Incoming>);

impl ClientBody {
    /// No body: nothing to read, and the request says so.
    pub fn empty() -> Self {
        ClientBody(None)
    }
}

impl From<Incoming> for ClientBody {
    fn from(body: Incoming) -> Self {
        ClientBody(Some(body))
    }
}

/// A client's request body on its way upstream, cut off past `max_body_size`, when the client
/// sends nothing for `body_read_timeout`, or when it sends slower than `min_body_rate` (hyper
/// then aborts the upstream request, which frees the upstream connection, and the client gets 408
/// if no response has started).
///
/// The rate counts only the time spent waiting on the client (from a `Pending` to the next
/// frame): while the upstream takes no more, the body is not polled and its clock stands still.
#[derive(Debug)]
pub struct RequestBody {
    inner: Option<Incoming>,
    limit: u64,
    remaining: u64,
    idle_timeout: Duration,
    min_rate: Option<MinBodyRate>,
    /// Armed when the client has nothing to give; created on the first wait only, so bodies that
    /// arrive whole (and empty ones, never polled) cost no timer and no clock reading.
    idle: Option<Pin<Box<Sleep>>>,
    /// When the current wait on the client began (`None`: not waiting).
    waiting_since: Option<Instant>,
    /// Time spent waiting on the client before the current wait.
    waited: Duration,
    /// Whether the armed deadline is the rate's (else the idle timeout's).
    rate_deadline: bool,
}

/// The client sent no body bytes for `server.body_read_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("no request body bytes within the body read timeout")]
pub struct BodyReadTimeout;

/// The client sent its body slower than `server.min_body_rate`.
#[derive(Debug, thiserror::Error)]
#[error("request body slower than the minimum body rate")]
pub struct BodyTooSlow;

/// The request body outgrew `server.max_body_size` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body larger than the configured limit")]
pub struct BodyTooLarge;

/// The client's request body broke (a malformed chunk, a reset stream): answered 400.
#[derive(Debug, thiserror::Error)]
#[error("malformed request body: {0}")]
pub struct BadClientBody(#[source] hyper::Error);

impl RequestBody {
    pub fn new(
        inner: ClientBody,
        limit: u64,
        idle_timeout: Duration,
        min_rate: Option<MinBodyRate>,
    ) -> Self {
        RequestBody {
            inner: inner.0,
            limit,
            remaining: limit,
            idle_timeout,
            min_rate,
            idle: None,
            waiting_since: None,
            waited: Duration::ZERO,
            rate_deadline: false,
        }
    }

    /// The client failed to keep up, when it has: silent for the idle timeout since this wait
    /// began, or its waits past the grace plus one second per `bytes_per_second` received.
    fn poll_wait(&mut self, cx: &mut Context<'_>) -> Option<BoxError> {
        if self.waiting_since.is_none() {
            let now = Instant::now();
            self.waiting_since = Some(now);
            let mut deadline = now + self.idle_timeout;
            self.rate_deadline = false;
            if let Some(rate) = self.min_rate {
                let received = self.limit - self.remaining;
                let allowed = rate.grace
                    + Duration::from_secs_f64(received as f64 / rate.bytes_per_second as f64);
                let by_rate = now + allowed.saturating_sub(self.waited);
                if by_rate < deadline {
                    deadline = by_rate;
                    self.rate_deadline = true;
                }
            }
            match &mut self.idle {
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => self.idle = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        let sleep = self.idle.as_mut()?;
        if sleep.as_mut().poll(cx).is_pending() {
            return None;
        }
        Some(if self.rate_deadline {
            Box::new(BodyTooSlow)
        } else {
            Box::new(BodyReadTimeout)
        })
    }

    /// A frame came: the wait under way, if any, is over.
    fn waited_for(&mut self) {
        if let Some(since) = self.waiting_since.take() {
            self.waited += since.elapsed();
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(inner) = &mut this.inner else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Pending => match this.poll_wait(cx) {
                Some(error) => Poll::Ready(Some(Err(error))),
                None => Poll::Pending,
            },
            Poll::Ready(Some(Ok(frame))) => {
                this.waited_for();
                if let Some(data) = frame.data_ref() {
                    let len = data.len() as u64;
                    if len > this.remaining {
                        return Poll::Ready(Some(Err(Box::new(BodyTooLarge))));
                    }
                    this.remaining -= len;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(BadClientBody(e))))),
            Poll::Ready(None) => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}
