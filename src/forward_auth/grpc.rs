//! Envoy ext_authz over gRPC: `envoy.service.auth.v3.Authorization/Check` on
//! `forward_auth.grpc_listen` (Envoy's `ext_authz` filter, Envoy Gateway's `SecurityPolicy`
//! extAuth, Istio's `CUSTOM` action, Contour).
//!
//! The original request is `attributes.request.http` (method, path with query, host, headers) and
//! the client is `attributes.source.address`, read with `client_ip.trusted_proxies` as the gateway
//! reads its peer. Allowed: `OK`, with `X-RateLimit-*` for the upstream (`ok_response`). Refused:
//! `denied_response` with `deny_status` (429 by default), `Retry-After`, `X-RateLimit-*` and the
//! gateway's JSON body.

use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::auth::v3::authorization_server::{
    Authorization, AuthorizationServer,
};
use envoy_types::pb::envoy::service::auth::v3::check_response::HttpResponse;
use envoy_types::pb::envoy::service::auth::v3::{
    CheckRequest, CheckResponse, DeniedHttpResponse, OkHttpResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use http::header::HOST;
use http::{HeaderMap, HeaderName, Method, StatusCode};
use http_body_util::BodyExt;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::StreamExt;
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};
use tonic::{Request, Response, Status};

use super::result_of;
use crate::access_log::{Door, Record};
use crate::admission::{self, Checked};
use crate::metrics::{CheckResult, DoorMetrics, RouteMetrics};
use crate::respond::{self, Refusal};
use crate::state::{AppState, Live};
use crate::tls::incoming::{Conn, TlsIncoming};

/// The server span of one `Check` (OpenTelemetry's RPC span name: `service/method`).
const CHECK_SPAN: &str = "envoy.service.auth.v3.Authorization/Check";

/// google.rpc.Code values (google/rpc/code.proto).
const RPC_OK: i32 = 0;
const RPC_INVALID_ARGUMENT: i32 = 3;
const RPC_RESOURCE_EXHAUSTED: i32 = 8;
const RPC_UNAUTHENTICATED: i32 = 16;
const RPC_UNAVAILABLE: i32 = 14;

/// The ext_authz service: a translation onto [`admission::check`].
#[derive(Debug, Clone)]
pub struct ExtAuthz {
    state: Arc<AppState>,
    metrics: DoorMetrics,
}

impl ExtAuthz {
    pub fn new(state: Arc<AppState>) -> Self {
        let metrics = state.metrics.door("ext_authz");
        ExtAuthz { state, metrics }
    }

    /// Decides one `CheckRequest`. Each answer is counted in `turnstile_requests_total` and
    /// `turnstile_request_duration_seconds` under the route it names (or `unmatched`), by the
    /// status it tells the proxy to send (200 when allowed).
    ///
    /// `traceparent` is the one in the call's gRPC metadata (Envoy's span of the check): the
    /// check's server span continues it; without it, the original request's.
    pub async fn decide(&self, request: &CheckRequest, traceparent: Option<&str>) -> CheckResponse {
        let started = crate::now::read();
        let live = self.state.live.load_full();
        let log = &self.state.access_log;
        let mut record = log
            .is_on()
            .then(|| Box::new(Record::new(Door::ExtAuthz, std::time::SystemTime::now())));
        let mut trace = match traceparent {
            Some(_) => self.state.tracing.begin_from(traceparent, CHECK_SPAN),
            None => {
                let original = request.attributes.as_ref().and_then(|a| a.request.as_ref());
                let headers = original.and_then(|r| r.http.as_ref()).map(|h| &h.headers);
                let parent = headers
                    .and_then(|h| h.get("traceparent"))
                    .map(String::as_str);
                self.state.tracing.begin_from(parent, CHECK_SPAN)
            }
        };
        if let Some(trace) = &mut trace {
            trace.server_attributes([
                opentelemetry::KeyValue::new("rpc.system", "grpc"),
                opentelemetry::KeyValue::new("rpc.service", "envoy.service.auth.v3.Authorization"),
                opentelemetry::KeyValue::new("rpc.method", "Check"),
            ]);
        }
        let (response, status, counted) = self
            .answer(&live, request, record.as_deref_mut(), trace.as_deref_mut())
            .await;
        if let Some(trace) = trace {
            trace.finish(status);
        }
        let seconds = crate::now::read()
            .saturating_duration_since(started)
            .as_secs_f64();
        counted
            .unwrap_or(&live.unmatched)
            .record_response(status, seconds);
        if let Some(mut record) = record {
            if log.wants(!(200..300).contains(&status)) {
                record.status = status;
                record.duration = std::time::Duration::from_secs_f64(seconds);
                log.submit(record);
            }
        }
        response
    }

    /// The answer to one call, the HTTP status it carries, and the counters of its route.
    async fn answer<'l>(
        &self,
        live: &'l Live,
        request: &CheckRequest,
        mut record: Option<&mut Record>,
        mut trace: Option<&mut crate::otel::RequestTrace>,
    ) -> (CheckResponse, u16, Option<&'l RouteMetrics>) {
        let (mut original, peer) = match original_request(request) {
            Ok(pair) => pair,
            Err(message) => {
                self.metrics.record(CheckResult::BadRequest);
                let response = respond::refusal(&Refusal::BadRequest(message));
                let status = response.status().as_u16();
                return (denied(RPC_INVALID_ARGUMENT, response).await, status, None);
            }
        };
        let deny = live
            .config
            .forward_auth
            .as_ref()
            .map_or(StatusCode::TOO_MANY_REQUESTS, |f| f.deny_status);
        // Envoy is trusted with the request's id (it makes one itself) as with the request.
        let id_name = &live.config.request_id.header;
        let brought = original.headers().contains_key(id_name);
        let request_id =
            crate::request_id::resolve(&live.config.request_id, true, original.headers_mut());
        if let Some(record) = &mut record {
            record.request_id = request_id.clone();
            record.trace_id = crate::request_id::trace_id(original.headers());
            let proxies = &live.config.trusted_proxies;
            record.client_ip = Some(proxies.client_ip(peer.to_canonical(), original.headers()));
        }
        if let Some(trace) = &mut trace {
            trace.begin_decision();
        }
        let note = match (&mut record, &mut trace) {
            (Some(record), _) => Some(&mut record.decided),
            (None, Some(trace)) => Some(&mut trace.decided),
            (None, None) => None,
        };
        let (checked, counted) =
            admission::check(&self.state, live, &mut original, peer, note).await;
        if let Some(trace) = &mut trace {
            let decided = match &record {
                Some(record) => record.decided.clone(),
                None => std::mem::take(&mut trace.decided),
            };
            trace.end_decision(&decided);
        }
        self.metrics.record(result_of(&checked));
        if let Some(record) = &mut record {
            record.method = Some(original.method().clone());
            record.host = crate::normalize::host::host(original.headers()).map(str::to_string);
            record.path = Some(original.uri().path().to_string());
        }
        // A made id goes upstream with the request; every refusal carries it to the client.
        let mut allowed = HeaderMap::new();
        if let (Some(id), false) = (&request_id, brought) {
            allowed.insert(id_name.clone(), id.clone());
        }
        let (code, mut response) = match checked {
            Checked::NoRoute => return (ok(allowed), 200, Some(counted)),
            Checked::Admitted(route, admitted) => {
                route
                    .rate_limit_headers
                    .insert(&mut allowed, &admitted.limits, false);
                return (ok(allowed), 200, Some(counted));
            }
            Checked::Refused(refusal @ Refusal::RateLimited { .. }) => {
                let mut response = respond::refusal_for(&refusal, request_id.as_ref());
                *response.status_mut() = deny;
                (RPC_RESOURCE_EXHAUSTED, response)
            }
            Checked::Refused(refusal @ Refusal::StoreUnavailable(_)) => {
                (RPC_UNAVAILABLE, respond::refusal(&refusal))
            }
            Checked::Refused(refusal @ Refusal::Unauthorized { .. }) => {
                (RPC_UNAUTHENTICATED, respond::refusal(&refusal))
            }
            Checked::Refused(refusal) => (RPC_INVALID_ARGUMENT, respond::refusal(&refusal)),
        };
        if let Some(id) = request_id {
            response.headers_mut().insert(id_name.clone(), id);
        }
        let status = response.status().as_u16();
        (denied(code, response).await, status, Some(counted))
    }
}

/// The original request and the client's address, from `attributes`.
fn original_request(request: &CheckRequest) -> Result<(http::Request<()>, IpAddr), String> {
    let attributes = request
        .attributes
        .as_ref()
        .ok_or("the CheckRequest has no attributes")?;
    let http = attributes
        .request
        .as_ref()
        .and_then(|r| r.http.as_ref())
        .ok_or("the CheckRequest has no attributes.request.http")?;
    let peer = attributes
        .source
        .as_ref()
        .and_then(|s| s.address.as_ref())
        .and_then(|a| match &a.address {
            Some(AddressKind::SocketAddress(s)) => s.address.parse::<IpAddr>().ok(),
            _ => None,
        })
        .ok_or("attributes.source.address is not an IP socket address")?;
    let method = Method::from_bytes(http.method.as_bytes())
        .map_err(|_| format!("`{}` is not a method", http.method))?;
    let uri = http
        .path
        .parse::<http::Uri>()
        .ok()
        .filter(|u| u.scheme().is_none() && http.path.starts_with('/'))
        .ok_or_else(|| format!("`{}` is not a request target", http.path))?;
    let mut headers = HeaderMap::with_capacity(http.headers.len());
    for (name, value) in &http.headers {
        // Pseudo-headers (`:path`, `:authority`) are given as fields above.
        if name.starts_with(':') {
            continue;
        }
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(value),
        ) else {
            continue;
        };
        headers.insert(name, value);
    }
    if !http.host.is_empty() {
        let host = http::HeaderValue::from_str(&http.host)
            .map_err(|_| format!("`{}` is not a host", http.host))?;
        headers.insert(HOST, host);
    }
    let mut req = http::Request::new(());
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = http::Version::HTTP_11;
    *req.headers_mut() = headers;
    Ok((req, peer))
}

fn header_options(headers: &HeaderMap) -> Vec<HeaderValueOption> {
    headers
        .iter()
        .map(|(name, value)| HeaderValueOption {
            header: Some(HeaderValue {
                key: name.as_str().to_string(),
                value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
                ..Default::default()
            }),
            // A client cannot pre-set the headers the upstream trusts.
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        })
        .collect()
}

fn ok(headers: HeaderMap) -> CheckResponse {
    CheckResponse {
        status: Some(RpcStatus {
            code: RPC_OK,
            ..Default::default()
        }),
        http_response: Some(HttpResponse::OkResponse(OkHttpResponse {
            headers: header_options(&headers),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A refusal, with the status, headers and body the gateway would send.
async fn denied(
    code: i32,
    response: http::Response<crate::proxy::body::ResponseBody>,
) -> CheckResponse {
    let (parts, body) = response.into_parts();
    // The gateway's own answers are in memory: collecting never waits.
    let body = body
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    CheckResponse {
        status: Some(RpcStatus {
            code,
            message: parts
                .status
                .canonical_reason()
                .unwrap_or_default()
                .to_string(),
            ..Default::default()
        }),
        http_response: Some(HttpResponse::DeniedResponse(DeniedHttpResponse {
            status: Some(HttpStatus {
                code: i32::from(parts.status.as_u16()),
            }),
            headers: header_options(&parts.headers),
            body,
        })),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl Authorization for ExtAuthz {
    async fn check(
        &self,
        request: Request<CheckRequest>,
    ) -> Result<Response<CheckResponse>, Status> {
        let traceparent = request
            .metadata()
            .get("traceparent")
            .and_then(|v| v.to_str().ok());
        Ok(Response::new(
            self.decide(request.get_ref(), traceparent).await,
        ))
    }
}

/// Serves the ext_authz service on `listener` (over TLS with `tls`) until `shutdown`. Its
/// connections count in `turnstile_open_connections{listener="ext_authz"}`.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<crate::tls::ServerTls>>,
    service: ExtAuthz,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let open = service.state.metrics.open_connections("ext_authz");
    let server = tonic::transport::Server::builder().add_service(AuthorizationServer::new(service));
    let stopped = async move {
        let _ = shutdown.changed().await;
    };
    match tls {
        None => {
            let incoming =
                TcpIncoming::from(listener)
                    .with_nodelay(Some(true))
                    .map(move |accepted| {
                        accepted.map(|stream| Counted::new(Conn::Plain(stream), &open))
                    });
            server.serve_with_incoming_shutdown(incoming, stopped).await
        }
        Some(tls) => {
            let incoming = match TlsIncoming::new(listener, tls) {
                Ok(incoming) => incoming,
                Err(e) => {
                    tracing::error!(error = %e, "ext_authz listener: cannot accept");
                    return Ok(());
                }
            };
            let incoming = incoming.map(move |(stream, _)| {
                Ok::<_, std::io::Error>(Counted::new(Conn::Tls(Box::new(stream)), &open))
            });
            server.serve_with_incoming_shutdown(incoming, stopped).await
        }
    }
}

/// A connection counted in its listener's open-connections gauge until it is dropped (the
/// ext_authz and ext_proc listeners).
pub(crate) struct Counted {
    stream: Conn,
    open: IntGauge,
}

impl Counted {
    pub(crate) fn new(stream: Conn, open: &IntGauge) -> Self {
        open.inc();
        Counted {
            stream,
            open: open.clone(),
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl Connected for Counted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.tcp().connect_info()
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
