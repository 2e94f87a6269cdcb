//! The inline gateway: HTTP in, engine checks out, the verdict back as HTTP.
//!
//! A request goes through three named phases on the current [`Live`] config (one `Arc` load, no
//! config parsing): **admit** (route, keys, one engine decision), **act** (forward it, or answer
//! it directly) and **decorate** (the rate-limit headers of the governing outcome). Every phase
//! that refuses returns a [`Refusal`]; [`respond::refusal`] is the one place it becomes a response.
//!
//! The phases are synchronous steps around two awaits (the engine's decision and the upstream's
//! answer) in one future per request: a nested future is copied whole each time it moves into its
//! caller's state, which cost more than any step (docs/benchmarks.md, issue 14's tenth pass).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response};

use crate::access_log::{Decided, Door, Record};
use crate::admission;
use crate::config::{Action, Route, UpstreamProtocol};
use crate::keys::RequestView;
use crate::metrics::{BodyTimeout, UpstreamErrorKind};
use crate::normalize;
use crate::proxy::body::{ClientBody, ResponseBody};
use crate::proxy::{self, ClientSide, ForwardError};
use crate::rate_limit_headers::FieldSink;
use crate::respond::{self, Refusal};
use crate::route::{Found, PathParams, RequestHead};
use crate::state::{AppState, Live, RouteResources};

/// Serves one request; never fails (refusals become responses).
///
/// The state is borrowed: the lean HTTP/1.1 path awaits this future in place, so a request there
/// takes no reference count on the state every worker shares (`crate::listener::Handler`).
///
/// An async block rather than an `async fn`: an `async fn` keeps its arguments in its state
/// beside the locals they become, and the request is the largest of them. Inlined into its
/// caller, so that the future is built where it is kept rather than built and then copied there.
#[allow(clippy::manual_async_fn)]
#[inline(always)]
pub fn handle(
    state: &Arc<AppState>,
    peer: SocketAddr,
    mut req: Request<ClientBody>,
) -> impl std::future::Future<Output = Result<Response<ResponseBody>, Infallible>> + '_ {
    async move {
        let started = crate::now::read();
        let live = state.live.load_full();
        let peer_ip = peer.ip().to_canonical();
        let request_id = crate::request_id::resolve(
            &live.config.request_id,
            live.config.trusted_proxies.contains(&peer_ip),
            req.headers_mut(),
        );
        // Boxed: an access log that is off adds one word to this future, not a record.
        let mut record = state.access_log.is_on().then(|| {
            let mut record = Record::new(Door::Gateway, std::time::SystemTime::now());
            record.request_id = request_id.clone();
            record.trace_id = crate::request_id::trace_id(req.headers());
            record.method = Some(req.method().clone());
            record.bytes_in = declared_length(&req);
            let proxies = &live.config.trusted_proxies;
            record.client_ip = Some(proxies.client_ip(peer_ip, req.headers()));
            Box::new(record)
        });
        // Boxed too, and only when tracing is on: off, no span is made.
        let mut trace = state
            .tracing
            .begin(req.method(), req.uri().path(), req.headers());
        if let (Some(trace), Some(record)) = (&trace, &mut record) {
            record.trace_id = Some(trace.trace_id());
        }
        let tag = Tag {
            state,
            live: &live,
            id: request_id.as_ref(),
            started,
        };
        // One spelling per request, before anything reads it: routing, keys and the upstream.
        let canonical = normalize::canonicalize(&mut req, live.config.server.paths)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                // Before anything reads the fields: the decision and the upstream see the same.
                proxy::headers::apply_underscores(
                    req.headers_mut(),
                    live.config.server.headers_with_underscores,
                )
                .map_err(str::to_string)
            });
        let host = normalize::host::host(req.headers());
        if let Some(record) = &mut record {
            record.host = host.map(str::to_string);
            record.path = Some(req.uri().path().to_string());
        }
        if let Err(e) = canonical {
            let refusal = Refusal::BadRequest(e);
            let response = respond::refusal(&refusal);
            let response = tag.finish(response, &live.unmatched, record, trace, true);
            return Ok(as_grpc_if(req.headers(), &refusal, response));
        }
        let head = RequestHead {
            method: req.method(),
            host,
            path: req.uri().path(),
            headers: req.headers(),
        };
        // A route's quota endpoint, when any is configured (one length check otherwise); boxed,
        // so the usual request's future does not carry its state.
        if !live.quota_routes.is_empty() {
            if let Some((index, params)) = crate::quota::endpoint_for(&live, &head) {
                let answer = crate::quota::answer(state, &live, index, &params, peer, &req, host);
                let response = Box::pin(answer).await;
                let metrics = live
                    .routes
                    .get(index)
                    .map_or(&live.unmatched, |r| &r.metrics);
                return Ok(tag.finish(response, metrics, record, trace, false));
            }
        }
        // One pass over the routes that could match decides both 404 and 405.
        let (index, params) = match admission::route_for(&live, &head) {
            Found::Route(index, params) => (index, params),
            unmatched => {
                let allow = match unmatched {
                    Found::OtherMethods(from) => admission::allowed_methods(&live, &head, from),
                    _ => None,
                };
                let refusal = match allow {
                    Some(allow) => Refusal::MethodNotAllowed(allow),
                    None => Refusal::NoRoute,
                };
                let response = respond::refusal(&refusal);
                let response = tag.finish(response, &live.unmatched, record, trace, true);
                return Ok(as_grpc_if(req.headers(), &refusal, response));
            }
        };

        let route = &live.config.routes[index];
        let resources = &live.routes[index];
        if let Some(record) = &mut record {
            record.decided.route = Some(route.name.clone());
        }
        // Only where a policy needs it: the body's first bytes, forwarded unchanged after.
        let body = if route.reads_body() {
            let server = &live.config.server;
            match req
                .body_mut()
                .read_prefix(server.json_body_limit, server.body_read_timeout)
                .await
            {
                Ok(whole) => whole.and_then(|bytes| crate::usage::request::parse(&bytes)),
                Err(_) => {
                    let refusal = Refusal::BadRequest("malformed request body".to_string());
                    let response = crate::inflight::refusal(route, &refusal, request_id.as_ref());
                    let response = tag.finish(response, &resources.metrics, record, trace, true);
                    return Ok(as_grpc_if(req.headers(), &refusal, response));
                }
            }
        } else {
            None
        };
        // Read again: the body's read above needed the request whole.
        let host = normalize::host::host(req.headers());
        if let Some(trace) = &mut trace {
            let route = opentelemetry::KeyValue::new("turnstile.route", route.name.to_string());
            trace.server_attributes([route]);
            trace.begin_decision();
        }
        // Admission reads the request (and the host found above); only then is it moved on.
        let note = match (&mut record, &mut trace) {
            (Some(record), _) => Some(&mut record.decided),
            (None, Some(trace)) => Some(&mut trace.decided),
            (None, None) => None,
        };
        let admitted = admit(
            state,
            &live,
            route,
            resources,
            &params,
            peer_ip,
            &req,
            (host, body.as_ref()),
            note,
        )
        .await;
        if let Some(trace) = &mut trace {
            let decided = match &record {
                Some(record) => record.decided.clone(),
                None => std::mem::take(&mut trace.decided),
            };
            trace.end_decision(&decided);
        }
        // A gRPC call's refusal is answered in gRPC's terms (`respond::grpc`), on the routes that
        // can serve gRPC: those to an h2 upstream. Read before the request goes upstream, since
        // the upstream's failure may need it; other routes pay one comparison.
        let grpc = matches!(&route.action, Action::Forward(up) if up.protocol == UpstreamProtocol::H2)
            && respond::grpc::is_grpc(req.headers());
        // The act phase, its steps synchronous but the upstream's: this future holds the request's
        // state itself, and a nested future would be copied whole into it (`proxy::Outgoing`).
        let served = match admitted {
            Ok(Admission {
                limits,
                mut after,
                peer_ip,
                wait,
            }) => {
                // Held from here: a failure below, or the client going away, drops it (released).
                let mut lease = after.lease(state, resources.metrics.in_flight());
                // Admitted for later: wait for the slot (boxed, so the usual request's future
                // does not carry the wait's state). Gone before it, the reservation goes back.
                let held = match wait {
                    Some(wait) => Box::pin(wait.hold(route)).await,
                    None => Ok(()),
                };
                // Likewise settled from here at the latest (charged its fallback unread).
                let meter = after.meter(state, route, resources);
                // Bound before the await, so the step's result is not kept in this future's state.
                if let (Some(trace), Action::Forward(upstream)) = (&mut trace, &route.action) {
                    let method = req.method().clone();
                    trace.begin_upstream(req.headers_mut(), &method, &upstream.name);
                }
                let answered = 'act: {
                    if let Err(refusal) = held {
                        break 'act Err(refusal);
                    }
                    let (outgoing, upgrade) =
                        match begin_act(&live, route, resources, &params, req, peer_ip) {
                            Ok(Act::Forward(outgoing, upgrade)) => (outgoing, upgrade),
                            Ok(Act::Answer(response)) => break 'act Ok(response),
                            Err(refusal) => break 'act Err(refusal),
                        };
                    let sent_at = record.is_some().then(std::time::Instant::now);
                    let sent = outgoing.send().await;
                    if let (Some(record), Some(at), Action::Forward(upstream)) =
                        (&mut record, sent_at, &route.action)
                    {
                        record.upstream = Some(upstream.clone());
                        record.upstream_time = Some(at.elapsed());
                    }
                    sent.and_then(|sent| proxy::finish(sent, upgrade, &mut lease))
                        .map_err(|e| {
                            upstream_failed(route, resources, e, live.config.server.max_body_size)
                        })
                };
                if let Some(trace) = &mut trace {
                    trace.end_upstream(answered.as_ref().ok().map(|r| r.status().as_u16()));
                }
                answered.map(|response| {
                    end_act(
                        state, route, resources, response, &limits, after, lease, meter,
                    )
                })
            }
            Err(refusal) => {
                // Refused: the request is done with, its field map serves the next one.
                proxy::headers::recycle(std::mem::take(req.headers_mut()));
                Err(refusal)
            }
        };
        match served {
            Ok(response) => Ok(tag.finish(response, &resources.metrics, record, trace, false)),
            Err(refusal) => {
                let response = crate::inflight::refusal(route, &refusal, request_id.as_ref());
                // Counted and logged under the refusal's HTTP status (429, 502, ...): what it is,
                // whatever the wire says to a gRPC client.
                let response = tag.finish(response, &resources.metrics, record, trace, true);
                Ok(if grpc {
                    respond::grpc::answer(&refusal, response)
                } else {
                    response
                })
            }
        }
    }
}

/// `response` to `refusal`, as a gRPC answer when the request (`headers`) is a gRPC call.
fn as_grpc_if(
    headers: &http::HeaderMap,
    refusal: &Refusal<'_>,
    response: Response<ResponseBody>,
) -> Response<ResponseBody> {
    if respond::grpc::is_grpc(headers) {
        respond::grpc::answer(refusal, response)
    } else {
        response
    }
}

/// What every answer of one request is finished with: its request id, its counters, its line.
struct Tag<'a> {
    state: &'a AppState,
    live: &'a Live,
    id: Option<&'a http::HeaderValue>,
    started: Instant,
}

impl Tag<'_> {
    /// Adds the request id to `response`, counts it in `metrics` and logs it (`refused`: the
    /// gateway answered itself instead of acting on the request).
    fn finish(
        &self,
        mut response: Response<ResponseBody>,
        metrics: &crate::metrics::RouteMetrics,
        record: Option<Box<Record>>,
        trace: Option<Box<crate::otel::RequestTrace>>,
        refused: bool,
    ) -> Response<ResponseBody> {
        if let Some(trace) = trace {
            trace.finish(response.status().as_u16());
        }
        if let Some(id) = self.id {
            let name = &self.live.config.request_id.header;
            match response.body_mut().upstream_fields_mut() {
                Some(raw) => raw.set(name, id.clone()),
                None => {
                    response.headers_mut().insert(name.clone(), id.clone());
                }
            }
        }
        let seconds = seconds_since(self.started);
        metrics.record_response(response.status().as_u16(), seconds);
        if let Some(mut record) = record {
            if self.state.access_log.wants(refused) {
                record.status = response.status().as_u16();
                if let ResponseBody::Full(_) = response.body() {
                    // The gateway's own answer goes out whole: its line is complete now.
                    record.bytes_out = http_body::Body::size_hint(response.body()).exact();
                    record.duration = std::time::Duration::from_secs_f64(seconds);
                    self.state.access_log.submit(record);
                } else {
                    record.bytes_out = Some(0);
                    let line = LogAtEnd {
                        log: self.state.access_log.clone(),
                        record: Some(record),
                        started: self.started,
                    };
                    response = response.map(|body| ResponseBody::riding(body, line));
                }
            }
        }
        response
    }
}

/// An upstream response's access-log line, riding on its body: written when the body ends or
/// the client goes away, with the bytes sent and the request's whole time (NGINX's
/// `$body_bytes_sent` and `$request_time`).
#[derive(Debug)]
struct LogAtEnd {
    log: crate::access_log::AccessLog,
    record: Option<Box<Record>>,
    started: Instant,
}

impl LogAtEnd {
    fn submit(&mut self) {
        if let Some(mut record) = self.record.take() {
            record.duration = std::time::Duration::from_secs_f64(seconds_since(self.started));
            self.log.submit(record);
        }
    }
}

impl crate::proxy::body::Rider for LogAtEnd {
    fn data(&mut self, data: &bytes::Bytes) {
        if let Some(record) = &mut self.record {
            *record.bytes_out.get_or_insert(0) += data.len() as u64;
        }
    }

    fn ended(&mut self, _complete: bool) {
        self.submit();
    }
}

impl Drop for LogAtEnd {
    fn drop(&mut self) {
        self.submit();
    }
}

/// A request's time so far, read fresh: this reading is the one its last steps share
/// (`crate::now`: the pooled upstream connection's and the keep-alive wait's start, the `Date`).
fn seconds_since(started: Instant) -> f64 {
    crate::now::read()
        .saturating_duration_since(started)
        .as_secs_f64()
}

/// What admission hands the act phase.
struct Admission {
    limits: crate::respond::Limits,
    after: crate::inflight::AfterAdmission,
    peer_ip: std::net::IpAddr,
    /// Admitted for later: the wait for its slot.
    wait: Option<Box<admission::Wait>>,
}

/// The admit phase: everything that reads the request before it is forwarded.
#[allow(clippy::too_many_arguments)]
async fn admit<'l>(
    state: &Arc<AppState>,
    live: &'l Live,
    route: &'l Route,
    resources: &'l RouteResources,
    params: &PathParams,
    peer_ip: std::net::IpAddr,
    req: &Request<ClientBody>,
    (host, body): (Option<&str>, Option<&crate::keys::JsonBody>),
    note: Option<&mut Decided>,
) -> Result<Admission, Refusal<'l>> {
    if matches!(route.action, Action::CheckOnly) {
        // Nowhere to send it; answered before any counter is touched.
        return Err(Refusal::CheckOnly(&route.name));
    }
    let max_body = live.config.server.max_body_size;
    if declared_length(req).is_some_and(|len| len > max_body) {
        return Err(Refusal::BodyTooLarge(max_body));
    }
    let client_ip = live
        .config
        .trusted_proxies
        .client_ip(peer_ip, req.headers());
    let view = RequestView {
        method: req.method(),
        host,
        path: req.uri().path(),
        query: req.uri().query(),
        headers: req.headers(),
        params,
        client_ip,
        client_prefix: live.config.client_prefix,
        body,
        // Only a listener with a client CA hands requests a certificate.
        client_cert: if live.config.asks_client_cert() {
            req.extensions()
                .get::<std::sync::Arc<crate::client_cert::ClientCert>>()
                .map(|c| &**c)
        } else {
            None
        },
    };
    let (admitted, after, wait) =
        admission::admit_inline(state, route, resources, &view, note).await?;
    Ok(Admission {
        limits: admitted.limits,
        after,
        peer_ip,
        wait,
    })
}

/// What the act phase does with an admitted request.
enum Act<'l> {
    /// The route answers it itself.
    Answer(Response<ResponseBody>),
    /// To the upstream.
    Forward(proxy::Outgoing<'l>, proxy::ClientUpgrade),
}

/// The act phase, up to the upstream: the direct answer, or the request made ready for it.
// The refusal is what `handle` answers with: boxing it would allocate for nothing.
#[allow(clippy::result_large_err)]
fn begin_act<'l>(
    live: &'l Live,
    route: &'l Route,
    resources: &'l RouteResources,
    params: &PathParams,
    mut req: Request<ClientBody>,
    peer_ip: std::net::IpAddr,
) -> Result<Act<'l>, Refusal<'l>> {
    match &route.action {
        Action::Respond(direct) => {
            let mut r = Response::new(ResponseBody::full(direct.body.clone()));
            *r.status_mut() = direct.status;
            r.headers_mut()
                .insert(http::header::CONTENT_TYPE, direct.content_type.clone());
            Ok(Act::Answer(r))
        }
        Action::Forward(upstream) => {
            // After the decision: keys were made from the request's own path.
            if let Some(rewrite) = &route.rewrite {
                match rewrite.apply(req.uri(), params) {
                    Some(uri) => *req.uri_mut() = uri,
                    None => return Err(Refusal::BadRequest("unforwardable path".to_string())),
                }
            }
            // A compressed body hides its usage: the upstream is asked for identity
            // (`docs/llm.md`); the client gets the body uncompressed.
            if route.policies.iter().any(|p| {
                p.response_cost
                    .as_ref()
                    .is_some_and(|rc| rc.usage().is_some())
            }) {
                req.headers_mut().remove(http::header::ACCEPT_ENCODING);
            }
            let client_side = ClientSide {
                peer: peer_ip,
                peer_trusted: live.config.trusted_proxies.contains(&peer_ip),
            };
            let Some(client) = &resources.client else {
                return Err(Refusal::UpstreamUnreachable(&route.name));
            };
            let (outgoing, upgrade) =
                proxy::prepare(upstream, client, req, client_side, &live.config.server);
            Ok(Act::Forward(outgoing, upgrade))
        }
        Action::CheckOnly => Err(Refusal::CheckOnly(&route.name)),
    }
}

/// The act phase, after the answer: the response's cost charged, the rate-limit fields added,
/// the lease and the usage meter carried by the body.
#[allow(clippy::too_many_arguments)]
fn end_act(
    state: &Arc<AppState>,
    route: &Route,
    resources: &RouteResources,
    mut response: Response<ResponseBody>,
    limits: &crate::respond::Limits,
    after: crate::inflight::AfterAdmission,
    lease: Option<crate::inflight::LeaseGuard>,
    mut meter: Option<crate::inflight::Meter>,
) -> Response<ResponseBody> {
    if after.reads_response() || meter.is_some() {
        crate::proxy::fields::materialize(&mut response);
    }
    if let Some(meter) = &mut meter {
        meter.head(response.status(), response.headers());
    }
    after.charge(state, route, resources, response.headers());
    // A lean upstream response keeps its fields raw: the gateway's go beside them, unformatted.
    let fields = &route.rate_limit_headers;
    match response.body_mut().upstream_fields_mut() {
        Some(raw) => fields.insert(raw, limits, false),
        None => fields.insert(response.headers_mut(), limits, false),
    }
    if let Some(lease) = lease {
        response = response.map(|body| ResponseBody::riding(body, lease));
    }
    if let Some(meter) = meter {
        response = response.map(|body| ResponseBody::riding(body, meter));
    }
    response
}

/// Counts an upstream failure and names the refusal it becomes.
fn upstream_failed<'l>(
    route: &'l Route,
    resources: &RouteResources,
    error: ForwardError,
    max_body: u64,
) -> Refusal<'l> {
    match error {
        ForwardError::Timeout => {
            resources
                .metrics
                .record_upstream_error(UpstreamErrorKind::Timeout);
            Refusal::UpstreamTimeout(&route.name)
        }
        ForwardError::Unreachable(kind) => {
            resources.metrics.record_upstream_error(kind);
            Refusal::UpstreamUnreachable(&route.name)
        }
        ForwardError::BodyTooLarge => Refusal::BodyTooLarge(max_body),
        ForwardError::BodyReadTimeout => {
            resources.metrics.record_body_timeout(BodyTimeout::Idle);
            Refusal::BodyReadTimeout
        }
        ForwardError::BodyTooSlow => {
            resources.metrics.record_body_timeout(BodyTimeout::TooSlow);
            Refusal::BodyReadTimeout
        }
        ForwardError::PoolTimeout => {
            resources
                .metrics
                .record_upstream_error(UpstreamErrorKind::Busy);
            Refusal::UpstreamBusy(&route.name)
        }
        ForwardError::BadBody => Refusal::BadRequest("malformed request body".to_string()),
    }
}

fn declared_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}
