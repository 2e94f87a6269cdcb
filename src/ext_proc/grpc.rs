//! `envoy.service.ext_proc.v3.ExternalProcessor/Process` on `ext_proc.listen`: Envoy's
//! `ext_proc` filter opens one bidirectional stream per HTTP request and sends its headers,
//! bodies and trailers as messages, each answered by one message. This file translates them to
//! and from an [`Exchange`].
//!
//! - The request is the `:method`, `:path` and `:authority` pseudo-headers with the other
//!   headers (repeated names kept repeated); the client is the `source.address` attribute
//!   (`request_attributes: [source.address]` in the filter), else the connection's peer (Envoy)
//!   read with `client_ip.trusted_proxies` as the gateway reads its own.
//! - A refusal is an `ImmediateResponse` with the status, headers and body the gateway sends.
//! - After the request headers, `mode_override` asks for only what the route needs (no body
//!   events for a route without a usage cost), honoured when the filter sets
//!   `allow_mode_override: true`.
//! - The stream ending, however it ends, drops the exchange, which settles what it owes.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::{
    BodySendMode, HeaderSendMode,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::value::Kind as ValueKind;
use envoy_types::pb::google::protobuf::Struct;
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, HeaderName, Method, StatusCode};
use http_body_util::BodyExt;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

use super::{field_value, Answer, Changes, Exchange, Needs, RequestStart, ResponseStart};
use crate::forward_auth::grpc::Counted;
use crate::metrics::ext_proc::ExtProcMetrics;
use crate::state::AppState;

/// The ext_proc service.
#[derive(Debug, Clone)]
pub struct ExtProc {
    state: Arc<AppState>,
    metrics: Arc<ExtProcMetrics>,
}

impl ExtProc {
    pub fn new(state: Arc<AppState>) -> Self {
        let metrics = Arc::new(ExtProcMetrics::register(&state.metrics));
        ExtProc { state, metrics }
    }
}

type Replies = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = Replies;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Replies>, Status> {
        let peer = request
            .remote_addr()
            .map_or(IpAddr::from([127, 0, 0, 1]), |a| a.ip());
        let exchange = Exchange::new(self.state.clone(), self.metrics.clone(), peer);
        let state = Processing {
            inbound: request.into_inner(),
            exchange,
            request_body_mode: BodySendMode::BufferedPartial as i32,
        };
        // One reply per message, in order; the stream (and the exchange with it) ends when
        // Envoy's side ends or breaks, or when tonic drops it.
        let replies = futures_util::stream::unfold(state, |mut s| async move {
            let message = match s.inbound.next().await {
                Some(Ok(message)) => message,
                Some(Err(_)) | None => return None,
            };
            let reply = s.reply(message).await;
            Some((Ok(reply), s))
        });
        Ok(Response::new(Box::pin(replies)))
    }
}

/// One `Process` stream: Envoy's messages and the exchange they drive.
struct Processing {
    inbound: Streaming<ProcessingRequest>,
    exchange: Exchange,
    /// The filter's request body mode (its `protocol_config`, else `BUFFERED_PARTIAL`): kept by
    /// the mode override of a route that reads the body.
    request_body_mode: i32,
}

impl Processing {
    async fn reply(&mut self, message: ProcessingRequest) -> ProcessingResponse {
        if let Some(config) = &message.protocol_config {
            let buffered = [BodySendMode::Buffered, BodySendMode::BufferedPartial];
            if buffered
                .iter()
                .any(|m| *m as i32 == config.request_body_mode)
            {
                self.request_body_mode = config.request_body_mode;
            }
        }
        let attributes = &message.attributes;
        let Some(request) = message.request else {
            return ProcessingResponse::default();
        };
        if !matches!(
            request,
            Message::RequestHeaders(_) | Message::RequestBody(_)
        ) {
            if let Some(refusal) = self.exchange.no_request_body().await {
                return immediate(refusal).await;
            }
        }
        match request {
            Message::RequestHeaders(headers) => {
                let start = match request_start(&headers, attributes) {
                    Ok(start) => start,
                    Err(message) => {
                        // A 400, counted as the gateway counts a malformed request.
                        let answer = self.exchange.malformed(message);
                        return self.answer_async(answer, Reply::RequestHeaders).await;
                    }
                };
                let answer = self.exchange.request_headers(start).await;
                self.answer_async(answer, Reply::RequestHeaders).await
            }
            Message::RequestBody(body) => {
                let answer = self
                    .exchange
                    .request_body(&body.body, body.end_of_stream)
                    .await;
                self.answer_async(answer, |h| {
                    Reply::RequestBody(BodyResponse {
                        response: h.response,
                    })
                })
                .await
            }
            Message::RequestTrailers(_) => trailers(Reply::RequestTrailers),
            Message::ResponseHeaders(headers) => {
                let answer = self
                    .exchange
                    .response_headers(response_start(&headers, attributes));
                self.answer_async(answer, Reply::ResponseHeaders).await
            }
            Message::ResponseBody(body) => {
                self.exchange.response_body(&body.body, body.end_of_stream);
                reply(Reply::ResponseBody(BodyResponse {
                    response: Some(CommonResponse::default()),
                }))
            }
            Message::ResponseTrailers(_) => {
                self.exchange.response_trailers();
                trailers(Reply::ResponseTrailers)
            }
        }
    }

    /// The reply to a headers or body message: a refusal, or `CONTINUE` with `answer`'s changes.
    async fn answer_async(
        &self,
        answer: Answer,
        wrap: impl FnOnce(HeadersResponse) -> Reply,
    ) -> ProcessingResponse {
        match answer {
            Answer::Respond(response) => immediate(response).await,
            Answer::Continue(changes) => self.proceed(changes, wrap),
        }
    }

    fn proceed(
        &self,
        changes: Changes,
        wrap: impl FnOnce(HeadersResponse) -> Reply,
    ) -> ProcessingResponse {
        let Changes { set, remove, needs } = changes;
        let mutation = (!set.is_empty() || !remove.is_empty()).then(|| HeaderMutation {
            set_headers: header_options(&set),
            remove_headers: remove.iter().map(|n| n.as_str().to_string()).collect(),
        });
        ProcessingResponse {
            response: Some(wrap(HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: mutation,
                    ..CommonResponse::default()
                }),
            })),
            mode_override: needs.map(|n| mode(n, self.request_body_mode)),
            ..ProcessingResponse::default()
        }
    }
}

/// The modes the rest of an exchange needs.
fn mode(needs: Needs, request_body_mode: i32) -> ProcessingMode {
    let send = |yes: bool| {
        if yes {
            HeaderSendMode::Send as i32
        } else {
            HeaderSendMode::Skip as i32
        }
    };
    ProcessingMode {
        request_body_mode: if needs.request_body {
            request_body_mode
        } else {
            BodySendMode::None as i32
        },
        response_header_mode: send(needs.response_headers),
        response_body_mode: if needs.response_body {
            BodySendMode::Streamed as i32
        } else {
            BodySendMode::None as i32
        },
        response_trailer_mode: send(needs.response_body),
        ..ProcessingMode::default()
    }
}

fn reply(reply: Reply) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(reply),
        ..ProcessingResponse::default()
    }
}

fn trailers(wrap: impl FnOnce(TrailersResponse) -> Reply) -> ProcessingResponse {
    reply(wrap(TrailersResponse::default()))
}

/// The gateway's own answer as an `ImmediateResponse` (its body is in memory).
async fn immediate(
    response: http::Response<crate::proxy::body::ResponseBody>,
) -> ProcessingResponse {
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    reply(Reply::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(parts.status.as_u16()),
        }),
        headers: Some(HeaderMutation {
            set_headers: header_options(&parts.headers),
            remove_headers: Vec::new(),
        }),
        body,
        details: "turnstile".to_string(),
        ..ImmediateResponse::default()
    }))
}

fn header_options(headers: &HeaderMap) -> Vec<HeaderValueOption> {
    headers
        .iter()
        .map(|(name, value)| HeaderValueOption {
            header: Some(HeaderValue {
                key: name.as_str().to_string(),
                raw_value: value.as_bytes().to_vec(),
                ..HeaderValue::default()
            }),
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..HeaderValueOption::default()
        })
        .collect()
}

/// The request of the first message: pseudo-headers and fields, and the client's address.
fn request_start(
    headers: &HttpHeaders,
    attributes: &std::collections::HashMap<String, Struct>,
) -> Result<RequestStart, String> {
    let mut method = None;
    let mut path = None;
    let mut authority = None;
    let mut fields = HeaderMap::new();
    for h in headers.headers.iter().flat_map(|m| &m.headers) {
        let Some(value) = field_value(&h.raw_value, &h.value) else {
            continue;
        };
        match h.key.as_str() {
            ":method" => method = Some(value),
            ":path" => path = Some(value),
            ":authority" => authority = Some(value),
            name if name.starts_with(':') => {}
            name => {
                if let Ok(name) = HeaderName::from_bytes(name.as_bytes()) {
                    fields.append(name, value);
                }
            }
        }
    }
    let method = method
        .and_then(|m| Method::from_bytes(m.as_bytes()).ok())
        .ok_or("the request headers carry no valid :method")?;
    let uri = path
        .as_ref()
        .filter(|p| p.as_bytes().starts_with(b"/"))
        .and_then(|p| http::Uri::try_from(p.as_bytes()).ok())
        .ok_or("the request headers carry no valid :path")?;
    if let Some(host) = authority {
        fields.insert(http::header::HOST, host);
    }
    let mut request = http::Request::new(());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = http::Version::HTTP_11;
    *request.headers_mut() = fields;
    let client = attribute(attributes, "source.address").and_then(|a| {
        a.parse::<std::net::SocketAddr>()
            .map(|s| s.ip())
            .or_else(|_| a.parse::<IpAddr>())
            .ok()
    });
    Ok(RequestStart {
        request,
        client,
        end_of_stream: headers.end_of_stream,
    })
}

/// The response head: `:status` and the fields; `response.code_details` (when the filter
/// sends it in `response_attributes`) tells a response Envoy made itself.
fn response_start(
    headers: &HttpHeaders,
    attributes: &std::collections::HashMap<String, Struct>,
) -> ResponseStart {
    let mut status = StatusCode::OK;
    let mut fields = HeaderMap::new();
    for h in headers.headers.iter().flat_map(|m| &m.headers) {
        let Some(value) = field_value(&h.raw_value, &h.value) else {
            continue;
        };
        match h.key.as_str() {
            ":status" => {
                if let Ok(s) = StatusCode::from_bytes(value.as_bytes()) {
                    status = s;
                }
            }
            name if name.starts_with(':') => {}
            name => {
                if let Ok(name) = HeaderName::from_bytes(name.as_bytes()) {
                    fields.append(name, value);
                }
            }
        }
    }
    let local = attribute(attributes, "response.code_details").is_some_and(|d| d != "via_upstream");
    ResponseStart {
        status,
        headers: fields,
        end_of_stream: headers.end_of_stream,
        local,
    }
}

/// A string attribute, in whichever namespace Envoy put it (`envoy.filters.http.ext_proc`).
fn attribute<'a>(
    attributes: &'a std::collections::HashMap<String, Struct>,
    name: &str,
) -> Option<&'a str> {
    attributes
        .values()
        .find_map(|s| match s.fields.get(name)?.kind.as_ref()? {
            ValueKind::StringValue(v) => Some(v.as_str()),
            _ => None,
        })
}

/// Serves the ext_proc service on `listener` until `shutdown`. Its connections count in
/// `turnstile_open_connections{listener="ext_proc"}`.
pub async fn serve(
    listener: TcpListener,
    service: ExtProc,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let open = service.state.metrics.open_connections("ext_proc");
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .map(move |accepted| {
            accepted.map(|stream| Counted::new(crate::tls::incoming::Conn::Plain(stream), &open))
        });
    tonic::transport::Server::builder()
        .add_service(ExternalProcessorServer::new(service))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = shutdown.changed().await;
        })
        .await
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use envoy_types::pb::envoy::config::core::v3::HeaderMap as EnvoyHeaders;
    use envoy_types::pb::google::protobuf::Value;

    use super::*;

    fn headers(pairs: &[(&str, &str)], raw: bool) -> HttpHeaders {
        HttpHeaders {
            headers: Some(EnvoyHeaders {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        value: if raw { String::new() } else { v.to_string() },
                        raw_value: if raw {
                            v.as_bytes().to_vec()
                        } else {
                            Vec::new()
                        },
                    })
                    .collect(),
            }),
            ..HttpHeaders::default()
        }
    }

    fn source(address: &str) -> HashMap<String, Struct> {
        let value = Value {
            kind: Some(ValueKind::StringValue(address.to_string())),
        };
        let fields = HashMap::from([("source.address".to_string(), value)]);
        HashMap::from([("envoy.filters.http.ext_proc".to_string(), Struct { fields })])
    }

    #[test]
    fn the_request_is_rebuilt_from_pseudo_headers_with_repeated_fields_kept() {
        for raw in [true, false] {
            let h = headers(
                &[
                    (":method", "POST"),
                    (":path", "/v1/chat/completions?x=1"),
                    (":authority", "api.example"),
                    (":scheme", "http"),
                    ("x-api-key", "a"),
                    ("x-api-key", "b"),
                ],
                raw,
            );
            let start = request_start(&h, &source("192.0.2.7:4321")).expect("a request");
            let r = &start.request;
            assert_eq!(r.method(), Method::POST);
            assert_eq!(r.uri().path(), "/v1/chat/completions");
            assert_eq!(r.uri().query(), Some("x=1"));
            assert_eq!(r.headers()["host"], "api.example");
            // Twice, so that a key on it is refused as ambiguous, as on the gateway.
            assert_eq!(r.headers().get_all("x-api-key").iter().count(), 2);
            assert_eq!(start.client, "192.0.2.7".parse().ok());
        }
        let no_path = headers(&[(":method", "GET"), (":path", "http://x/")], true);
        assert!(request_start(&no_path, &HashMap::new()).is_err());
        let no_method = headers(&[(":path", "/")], true);
        assert!(request_start(&no_method, &HashMap::new()).is_err());
    }

    #[test]
    fn a_response_envoy_made_itself_is_told_apart() {
        let h = headers(&[(":status", "503"), ("content-type", "text/plain")], true);
        let details = |d: &str| {
            let value = Value {
                kind: Some(ValueKind::StringValue(d.to_string())),
            };
            let fields = HashMap::from([("response.code_details".to_string(), value)]);
            HashMap::from([("envoy.filters.http.ext_proc".to_string(), Struct { fields })])
        };
        let local = response_start(&h, &details("upstream_reset_before_response_started"));
        assert_eq!((local.status.as_u16(), local.local), (503, true));
        assert!(!response_start(&h, &details("via_upstream")).local);
        assert!(!response_start(&h, &HashMap::new()).local);
    }

    #[test]
    fn the_mode_override_asks_only_for_what_the_route_needs() {
        let none = mode(Needs::NONE, BodySendMode::Buffered as i32);
        assert_eq!(none.request_body_mode, BodySendMode::None as i32);
        assert_eq!(none.response_header_mode, HeaderSendMode::Skip as i32);
        assert_eq!(none.response_body_mode, BodySendMode::None as i32);
        let all = Needs {
            request_body: true,
            response_headers: true,
            response_body: true,
        };
        let all = mode(all, BodySendMode::Buffered as i32);
        assert_eq!(all.request_body_mode, BodySendMode::Buffered as i32);
        assert_eq!(all.response_body_mode, BodySendMode::Streamed as i32);
        assert_eq!(all.response_trailer_mode, HeaderSendMode::Send as i32);
    }
}
