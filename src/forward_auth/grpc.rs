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
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use super::result_of;
use crate::admission::{self, Checked};
use crate::metrics::{CheckResult, DoorMetrics};
use crate::respond::{self, Refusal};
use crate::state::AppState;

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

    /// Decides one `CheckRequest`.
    pub async fn decide(&self, request: &CheckRequest) -> CheckResponse {
        let (mut original, peer) = match original_request(request) {
            Ok(pair) => pair,
            Err(message) => {
                self.metrics.record(CheckResult::BadRequest);
                return denied(
                    RPC_INVALID_ARGUMENT,
                    respond::refusal(&Refusal::BadRequest(message)),
                )
                .await;
            }
        };
        let live = self.state.live.load_full();
        let deny = live
            .config
            .forward_auth
            .as_ref()
            .map_or(StatusCode::TOO_MANY_REQUESTS, |f| f.deny_status);
        let (checked, _) = admission::check(&self.state, &live, &mut original, peer).await;
        self.metrics.record(result_of(&checked));
        match checked {
            Checked::NoRoute => ok(HeaderMap::new()),
            Checked::Admitted(route, admitted) => {
                let mut headers = HeaderMap::new();
                route
                    .rate_limit_headers
                    .insert(&mut headers, &admitted.limits, false);
                ok(headers)
            }
            Checked::Refused(refusal @ Refusal::RateLimited { .. }) => {
                let mut response = respond::refusal(&refusal);
                *response.status_mut() = deny;
                denied(RPC_RESOURCE_EXHAUSTED, response).await
            }
            Checked::Refused(refusal @ Refusal::StoreUnavailable(_)) => {
                denied(RPC_UNAVAILABLE, respond::refusal(&refusal)).await
            }
            Checked::Refused(refusal @ Refusal::Unauthorized { .. }) => {
                denied(RPC_UNAUTHENTICATED, respond::refusal(&refusal)).await
            }
            Checked::Refused(refusal) => {
                denied(RPC_INVALID_ARGUMENT, respond::refusal(&refusal)).await
            }
        }
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
        Ok(Response::new(self.decide(request.get_ref()).await))
    }
}

/// Serves ext_authz on `listener` until `shutdown` changes.
pub async fn serve(
    listener: TcpListener,
    service: ExtAuthz,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(AuthorizationServer::new(service))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = shutdown.changed().await;
        })
        .await
}
