//! Forwarding an admitted request to its upstream and streaming the answer back.
//!
//! One connection pool per upstream target ([`pool`]; its connect timeout is per upstream), the
//! target chosen per request by [`balance`]; a request that could not connect (nothing was sent)
//! is tried once more on another target, never after its first byte left. The response
//! head must arrive within the upstream's `timeout` (504 otherwise); bodies stream both ways.
//! `Upgrade` requests are tunnelled once the upstream answers 101, for the protocols in
//! `server.allowed_upgrades` only (default `websocket`): a tunnel carries requests no decision
//! sees, so any other `Upgrade` (`h2c`, say) is stripped with its `Connection` token and the
//! upstream answers the request itself. An upstream that switches protocols uninvited gets 502.

pub mod balance;
pub mod body;
pub mod fields;
pub mod h1;
pub mod h2;
pub mod headers;
pub mod held;
pub mod pool;
pub use crate::config::rewrite;

use std::net::IpAddr;
use std::sync::Arc;

use http::uri::{Authority, PathAndQuery};
use http::{Method, Request, Response, StatusCode, Uri};

use hyper_util::rt::TokioIo;

use crate::config::{ServerSettings, Upstream};
use crate::metrics::{TargetOutcome, UpstreamErrorKind};
use balance::Balancer;
use body::{
    BadClientBody, BodyReadTimeout, BodyTooLarge, BodyTooSlow, ClientBody, RequestBody,
    ResponseBody,
};
use pool::ClientError;
pub use pool::UpstreamClient;

/// Builds the pooled client of one upstream.
pub fn client(authority: &Authority, limits: pool::Limits) -> UpstreamClient {
    UpstreamClient::new(authority, limits)
}

/// Why forwarding failed; each maps to one status code.
#[derive(Debug)]
pub enum ForwardError {
    /// 502: the upstream could not be reached or broke the exchange.
    Unreachable(UpstreamErrorKind),
    /// 504: no response head within the timeout.
    Timeout,
    /// 413: the body outgrew the limit while streaming.
    BodyTooLarge,
    /// 408: the client stopped sending its body (`server.body_read_timeout`).
    BodyReadTimeout,
    /// 408: the client sent its body slower than `server.min_body_rate`.
    BodyTooSlow,
    /// 503: every connection the upstream may have stayed busy for its `pool_timeout`.
    PoolTimeout,
    /// 400: the client's body broke its own framing (a malformed chunk, say); the client's
    /// fault, not the upstream's.
    BadBody,
}

impl ForwardError {
    /// Whether the client's request body caused it (too large, stalled, malformed).
    pub fn is_clients(&self) -> bool {
        matches!(
            self,
            ForwardError::BodyTooLarge
                | ForwardError::BodyReadTimeout
                | ForwardError::BodyTooSlow
                | ForwardError::BadBody
        )
    }
}

/// What the proxy needs to know about the client side of a request.
#[derive(Debug, Clone, Copy)]
pub struct ClientSide {
    pub peer: IpAddr,
    pub peer_trusted: bool,
}

/// A request made ready for its upstream by [`prepare`], sent by [`Outgoing::send`].
///
/// Forwarding is three steps (prepare, send, finish) rather than one `async fn` so that the
/// caller's future holds only the sending: a nested future is copied whole each time it moves
/// into its caller's state, and the request's futures were most of a proxied request's
/// `memmove` (docs/benchmarks.md, issue 14's tenth pass).
pub struct Outgoing<'a> {
    targets: &'a Arc<Balancer>,
    request: Request<RequestBody>,
    /// CONNECT: the request's authority-form URI is set per target.
    connect: bool,
    /// The client sent no `Host`: each target's default is used.
    own_host: bool,
    /// One deadline for the response head, however many targets are tried.
    deadline: tokio::time::Instant,
}

/// The client's side of an `Upgrade` the upstream may accept ([`finish`] tunnels it).
pub struct ClientUpgrade(Option<hyper::upgrade::OnUpgrade>);

/// What the upstream answered, before [`finish`] makes it the client's response.
pub struct Sent {
    response: Response<pool::UpstreamBody>,
    in_flight: balance::InFlight,
}

/// Turns the client's request into the one its upstream gets: origin-form, HTTP/1.1, hop-by-hop
/// fields stripped, `Host` and the `Forwarded` family set.
pub fn prepare<'a>(
    upstream: &Upstream,
    targets: &'a Arc<Balancer>,
    req: Request<ClientBody>,
    client_side: ClientSide,
    server: &ServerSettings,
) -> (Outgoing<'a>, ClientUpgrade) {
    let (mut parts, body) = req.into_parts();
    let proto = if parts.extensions.get::<crate::tls::Https>().is_some() {
        "https"
    } else {
        "http"
    };
    // Not allowed: `strip_hop_by_hop` below removes `Upgrade` and `Connection` as for any request.
    let upgrade = headers::is_upgrade(&parts.headers)
        && headers::upgrade_allowed(&parts.headers, &server.allowed_upgrades);
    let client_upgrade = upgrade.then(|| {
        let mut stub = Request::new(());
        *stub.extensions_mut() = std::mem::take(&mut parts.extensions);
        hyper::upgrade::on(stub)
    });

    let original_authority = parts.uri.authority().cloned();
    let connect = parts.method == Method::CONNECT;
    // HTTP/1.1 to an origin server: origin-form (`/path?query`), or authority-form for CONNECT
    // (set per target below).
    if !connect {
        parts.uri = Uri::from(
            parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
        );
    }
    // Requests may arrive as HTTP/2; the upstream pool speaks HTTP/1.1 (an h2 upstream's
    // request is made HTTP/2 per target, `h2::h2_form`).
    parts.version = http::Version::HTTP_11;
    let h2 = upstream.protocol == crate::config::UpstreamProtocol::H2;
    // `TE` is hop-by-hop, but `te: trailers` says the client takes trailers, which a gRPC server
    // requires to hear; HTTP/2 allows that one value (RFC 9113 §8.2.2).
    let te_trailers = h2 && h2::wants_trailers(&parts.headers);
    headers::strip_hop_by_hop(&mut parts.headers, upgrade, Some(&server.read_fields));
    if te_trailers {
        parts
            .headers
            .insert(http::header::TE, h2::TE_TRAILERS.clone());
    }
    // HTTP/2 carries the host in the URI; HTTP/1.1 upstreams need it as a header.
    let host = match parts.headers.get(http::header::HOST) {
        Some(h) => Some(h.clone()),
        None => original_authority.and_then(|a| http::HeaderValue::from_str(a.as_str()).ok()),
    };
    // An HTTP/1.0 client may send none; the upstream gets its own authority (set per target).
    let own_host = host.is_none();
    if let Some(host) = &host {
        parts.headers.insert(http::header::HOST, host.clone());
    }
    headers::set_forwarded_as(
        &mut parts.headers,
        client_side.peer,
        host,
        client_side.peer_trusted,
        proto,
    );

    let body = RequestBody::new(
        body,
        server.max_body_size,
        server.body_read_timeout,
        server.min_body_rate,
    );
    // A body of unknown length (chunked, or h2 DATA without `content-length`) is sent chunked
    // whatever the method: hyper's client would send a `GET`'s as no body at all, where one with
    // `Content-Length` goes whole (RFC 9110 §9.3.1: the body is part of the message either way).
    // HTTP/2 frames its body itself (RFC 9113 §8.2.2 forbids `Transfer-Encoding`).
    if !connect
        && !h2
        && !http_body::Body::is_end_stream(&body)
        && http_body::Body::size_hint(&body).exact().is_none()
        && !parts.headers.contains_key(http::header::CONTENT_LENGTH)
    {
        parts.headers.insert(
            http::header::TRANSFER_ENCODING,
            http::HeaderValue::from_static("chunked"),
        );
    }
    let outgoing = Outgoing {
        targets,
        request: Request::from_parts(parts, body),
        connect,
        own_host,
        deadline: crate::now::recent_tokio() + upstream.timeout,
    };
    (outgoing, ClientUpgrade(client_upgrade))
}

impl<'a> Outgoing<'a> {
    /// Sends the request to a target, and to one other when nothing could be sent to the first
    /// (a failed connect); the response head must come by the deadline.
    ///
    /// Taken apart before the future is made, which then holds each part once (an `async fn`
    /// would keep `self` beside them). Inlined, so that the future is built in the awaiting
    /// future's state, not built and then copied there.
    #[inline(always)]
    pub fn send(self) -> impl std::future::Future<Output = Result<Sent, ForwardError>> + 'a {
        let Outgoing {
            targets,
            request: mut outgoing,
            connect,
            own_host,
            deadline,
        } = self;
        async move {
            let mut failed = None;
            loop {
                let Some(index) = targets.pick(failed) else {
                    return Err(ForwardError::Unreachable(UpstreamErrorKind::Connect));
                };
                let target = targets.target(index);
                if connect {
                    *outgoing.uri_mut() = Uri::from(target.authority.clone());
                }
                if own_host {
                    if let Some(default) = target.client.default_host() {
                        outgoing
                            .headers_mut()
                            .insert(http::header::HOST, default.clone());
                    }
                }
                let in_flight = targets.begin(index);
                // Awaited where it is made: a future held in a local first takes room in this
                // future's state twice (the local and the await).
                let error = match target.client.send_or_return(outgoing, deadline).await {
                    Ok(response) => {
                        targets.record(index, TargetOutcome::Ok);
                        return Ok(Sent {
                            response,
                            in_flight,
                        });
                    }
                    Err((ClientError::Connect(e), Some(back))) => {
                        tracing::debug!(target = %target.authority, error = %e, "upstream connect failed");
                        targets.record(index, TargetOutcome::ConnectError);
                        if failed.is_none() {
                            // Nothing was sent: the request is whole, another target may take it.
                            failed = Some(index);
                            outgoing = back;
                            continue;
                        }
                        return Err(ForwardError::Unreachable(UpstreamErrorKind::Connect));
                    }
                    Err((e, _)) => classify(&e),
                };
                if error.is_clients() {
                    // The client's body failed: nothing to hold against the target.
                    return Err(error);
                }
                targets.record(
                    index,
                    match &error {
                        ForwardError::Timeout => TargetOutcome::Timeout,
                        ForwardError::PoolTimeout => TargetOutcome::Busy,
                        ForwardError::Unreachable(UpstreamErrorKind::Connect) => {
                            TargetOutcome::ConnectError
                        }
                        _ => TargetOutcome::Error,
                    },
                );
                return Err(error);
            }
        }
    }
}

/// Makes the upstream's answer the client's response: an accepted upgrade is tunnelled, an
/// uninvited one refused, hop-by-hop fields stripped. A tunnel takes `held` (the request's
/// concurrency lease) and keeps it until the tunnel closes: a tunnel is a request that lasts.
pub fn finish<H: Send + 'static>(
    sent: Sent,
    client_upgrade: ClientUpgrade,
    held: &mut Option<H>,
) -> Result<Response<ResponseBody>, ForwardError> {
    let Sent {
        response,
        in_flight,
    } = sent;
    let client_upgrade = client_upgrade.0;
    let (mut parts, mut body) = response.into_parts();
    if parts.status == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            body.detach();
            let upstream_upgrade = hyper::upgrade::on(Response::from_parts(parts.clone(), ()));
            let held = held.take();
            tokio::spawn(async move {
                tunnel(client_upgrade, upstream_upgrade).await;
                drop(held);
            });
            headers::strip_hop_by_hop(&mut parts.headers, true, None);
            return Ok(Response::from_parts(parts, ResponseBody::empty()));
        }
        // Switching without being asked to would hand the client a raw upstream connection; that
        // connection has left HTTP and never returns to the pool.
        body.detach();
        tracing::debug!("upstream answered 101 to a request that did not upgrade");
        return Err(ForwardError::Unreachable(UpstreamErrorKind::Other));
    }
    headers::strip_hop_by_hop(&mut parts.headers, false, None);
    // RFC 9110 §2.5: the version is the sender's own. An HTTP/1.0 upstream's would make hyper
    // answer the client in HTTP/1.0 and close its kept-alive connection.
    parts.version = http::Version::HTTP_11;
    Ok(Response::from_parts(
        parts,
        ResponseBody::Balanced(body, in_flight),
    ))
}

/// Copies bytes both ways between the upgraded client and upstream connections until either
/// closes.
async fn tunnel(client: hyper::upgrade::OnUpgrade, upstream: hyper::upgrade::OnUpgrade) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(pair) => pair,
        Err(e) => {
            tracing::debug!(error = %e, "upgrade failed");
            return;
        }
    };
    let mut client = TokioIo::new(client);
    let mut upstream = TokioIo::new(upstream);
    if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        tracing::debug!(error = %e, "upgraded connection ended with an error");
    }
}

fn classify(e: &ClientError) -> ForwardError {
    let e = match e {
        ClientError::Connect(_) => return ForwardError::Unreachable(UpstreamErrorKind::Connect),
        ClientError::PoolTimeout => return ForwardError::PoolTimeout,
        ClientError::Timeout => return ForwardError::Timeout,
        ClientError::Request(e) => e,
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&**e);
    while let Some(err) = source {
        if err.is::<BodyTooLarge>() {
            return ForwardError::BodyTooLarge;
        }
        if err.is::<BodyReadTimeout>() {
            return ForwardError::BodyReadTimeout;
        }
        if err.is::<BodyTooSlow>() {
            return ForwardError::BodyTooSlow;
        }
        if err.is::<BadClientBody>() {
            return ForwardError::BadBody;
        }
        source = err.source();
    }
    ForwardError::Unreachable(UpstreamErrorKind::Other)
}
