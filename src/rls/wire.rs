//! gRPC on HTTP/2 directly (the `h2` crate), for the two unary methods this listener serves:
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` and
//! `grpc.health.v1.Health/Check`. Everything else is answered `UNIMPLEMENTED`.
//!
//! Why not tonic's server: per call, its router, timeout and body layers and hyper's task per
//! stream cost about as many instructions as the HTTP/2 framing itself, several times what the
//! decision costs (`docs/benchmarks.md`, "Envoy RLS against Limitador"). Here a connection is one
//! task: it accepts streams and runs their calls to completion beside the framing, with no task,
//! router or boxed body per call. The wire format is gRPC's (the `application/grpc` content type,
//! 5-byte message prefix, `grpc-status`/`grpc-message` trailers), as tonic's clients and Envoy
//! speak it; compressed messages are refused (`UNIMPLEMENTED`), as tonic does unless compression
//! is enabled.

use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use futures_util::stream::{FuturesUnordered, StreamExt};
use h2::server::SendResponse;
use h2::RecvStream;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use prost::Message;
use tokio::sync::{watch, Notify};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use super::ask::Ask;
use super::decide::{RlsError, RlsService};
use super::grpc::HEALTH_SERVICE_NAME;

const RLS_METHOD: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const HEALTH_METHOD: &str = "/grpc.health.v1.Health/Check";
/// The largest request message read, as tonic's default decoding limit.
const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Concurrent calls per connection (hyper's default is 200; Envoy multiplexes many calls on few
/// connections).
const MAX_CONCURRENT_STREAMS: u32 = 1024;
/// Flow-control windows, as tonic/hyper's defaults.
const WINDOW_BYTES: u32 = 1024 * 1024;
/// Request header block limit, as hyper's default.
const MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;

// gRPC status codes used here.
const OK: u32 = 0;
const NOT_FOUND: u32 = 5;
const RESOURCE_EXHAUSTED: u32 = 8;
const UNIMPLEMENTED: u32 = 12;
const INTERNAL: u32 = 13;

/// Serves one connection until the peer closes it, or until `stop` turns true or `shed` picks
/// this connection (its thread is saturated, [`super::balance`]): then a graceful shutdown
/// (GOAWAY; calls in flight finish).
pub(crate) async fn serve_connection<IO>(
    io: IO,
    service: RlsService,
    serving: watch::Receiver<bool>,
    mut stop: watch::Receiver<bool>,
    shed: Arc<Notify>,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let handshake = h2::server::Builder::new()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .initial_window_size(WINDOW_BYTES)
        .initial_connection_window_size(WINDOW_BYTES)
        .max_header_list_size(MAX_HEADER_LIST_BYTES)
        .handshake::<_, Bytes>(io);
    let mut conn = match handshake.await {
        Ok(conn) => conn,
        Err(e) => {
            tracing::debug!(error = %e, "rate limit service: HTTP/2 handshake failed");
            return;
        }
    };
    // Calls still waiting (on the store), and a spare allocation for the next call's future.
    let mut calls = FuturesUnordered::new();
    let mut spare = None;
    // The streams one read delivered, taken before any of them runs (below).
    let mut fresh = Vec::new();
    let mut stopped = Some(Box::pin(async move {
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => {}
            () = shed.notified() => {}
        }
    }));
    // Batching is the point of this loop: take every stream the last read delivered, run every
    // call that can finish, and only then poll the connection again, which writes all their
    // answers in one go. (Polling the connection between calls would write each answer alone:
    // one `writev` per call; so no call runs before the connection has no stream left to give.)
    // A new call is polled once in place, in a reused allocation: on the memory store it
    // finishes there (its DATA frame came with its HEADERS), and only a call still pending (on
    // Redis) joins `calls`, which costs a task node and wake-up bookkeeping per call.
    let ended = std::future::poll_fn(|cx| loop {
        loop {
            match conn.poll_accept(cx) {
                Poll::Ready(Some(Ok(stream))) => fresh.push(stream),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(e)),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => break,
            }
        }
        let mut answered = false;
        for (request, respond) in fresh.drain(..) {
            let next = call(request, respond, &service, &serving);
            let mut future = match spare.take() {
                Some(mut reused) => {
                    Pin::set(&mut reused, next);
                    reused
                }
                None => Box::pin(next),
            };
            if future.as_mut().poll(cx).is_ready() {
                answered = true;
                spare = Some(future);
            } else {
                calls.push(future);
            }
        }
        while let Poll::Ready(Some(())) = calls.poll_next_unpin(cx) {
            answered = true;
        }
        if let Some(signal) = stopped.as_mut() {
            if signal.as_mut().poll(cx).is_ready() {
                stopped = None;
                conn.graceful_shutdown();
                continue;
            }
        }
        if !answered {
            return Poll::Pending;
        }
    })
    .await;
    if let Some(e) = ended {
        tracing::debug!(error = %e, "rate limit service: connection error");
    }
}

/// One call: reads the request message, answers it.
async fn call(
    request: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    service: &RlsService,
    serving: &watch::Receiver<bool>,
) {
    let (parts, mut body) = request.into_parts();
    let is_grpc = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"));
    if !is_grpc {
        // gRPC over HTTP/2: a request that is not gRPC gets HTTP 415.
        let response = Response::builder()
            .status(StatusCode::UNSUPPORTED_MEDIA_TYPE)
            .body(())
            .unwrap_or_default();
        let _ = respond.send_response(response, true);
        return;
    }
    let frame = match read_message(&mut body).await {
        Ok(frame) => frame,
        Err((code, text)) => return send_status(&mut respond, code, text),
    };
    let message = &frame[5..];
    match parts.uri.path() {
        RLS_METHOD => {
            // Read in place (no allocation per string); prost decodes only what that refuses,
            // so that a bad message gets prost's error.
            let decoded;
            let request = match Ask::read(message) {
                Some(ask) => ask,
                None => match RateLimitRequest::decode(message) {
                    Ok(r) => {
                        decoded = r;
                        Ask::of(&decoded)
                    }
                    Err(e) => return send_status(&mut respond, INTERNAL, &decode_error(&e)),
                },
            };
            // gRPC metadata is the stream's header block: Envoy's span of this call.
            let traceparent = parts
                .headers
                .get("traceparent")
                .and_then(|v| v.to_str().ok());
            match service.answer(&request, traceparent).await {
                Ok(response) => send_message(&mut respond, &response),
                Err(e) => {
                    let status = super::grpc::status(&e);
                    let code = status.code() as u32;
                    let text = match &e {
                        RlsError::Invalid(m) => m.as_str(),
                        _ => status.message(),
                    };
                    send_status(&mut respond, code, text);
                }
            }
        }
        HEALTH_METHOD => {
            let request = match HealthCheckRequest::decode(message) {
                Ok(r) => r,
                Err(e) => return send_status(&mut respond, INTERNAL, &decode_error(&e)),
            };
            if !request.service.is_empty() && request.service != HEALTH_SERVICE_NAME {
                // As tonic-health: a service nobody registered.
                return send_status(&mut respond, NOT_FOUND, "service not registered");
            }
            let status = if *serving.borrow() {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            send_message(
                &mut respond,
                &HealthCheckResponse {
                    status: status as i32,
                },
            );
        }
        _ => send_status(&mut respond, UNIMPLEMENTED, ""),
    }
}

fn decode_error(e: &prost::DecodeError) -> String {
    format!("failed to decode the request message: {e}")
}

/// The request's one message: the body read to its end (bounded), one uncompressed gRPC frame,
/// returned whole (the message is its bytes from 5 on: a slice, where a split `Bytes` cost an
/// atomic and a copy of the handle).
async fn read_message(body: &mut RecvStream) -> Result<Bytes, (u32, &'static str)> {
    let mut first: Option<Bytes> = None;
    let mut more = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|_| (INTERNAL, "the request body was cut off"))?;
        // The end of the stream often comes as an empty DATA frame: nothing to release.
        if !chunk.is_empty() {
            let _ = body.flow_control().release_capacity(chunk.len());
        }
        let held = first.as_ref().map_or(0, Bytes::len) + more.len();
        if held + chunk.len() > MAX_MESSAGE_BYTES + 5 {
            return Err((RESOURCE_EXHAUSTED, "the request message is too large"));
        }
        match &first {
            // The usual case, one DATA frame: kept as it came, never copied.
            None => first = Some(chunk),
            Some(f) => {
                if more.is_empty() {
                    more.extend_from_slice(f);
                }
                more.extend_from_slice(&chunk);
            }
        }
    }
    let buf = if more.is_empty() {
        first.unwrap_or_default()
    } else {
        more.freeze()
    };
    if buf.len() < 5 {
        return Err((INTERNAL, "the request has no gRPC message"));
    }
    if buf[0] != 0 {
        return Err((UNIMPLEMENTED, "compressed messages are not supported"));
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if buf.len() != 5 + len {
        return Err((INTERNAL, "the request is not one gRPC message"));
    }
    Ok(buf)
}

fn grpc_headers() -> Response<()> {
    let mut response = Response::new(());
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    response
}

/// A successful answer: headers, one message, `grpc-status: 0`.
fn send_message(respond: &mut SendResponse<Bytes>, message: &impl Message) {
    let Ok(mut stream) = respond.send_response(grpc_headers(), false) else {
        return;
    };
    let len = message.encoded_len();
    let mut out = BytesMut::with_capacity(5 + len);
    out.put_u8(0);
    out.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    if message.encode(&mut out).is_err() {
        stream.send_reset(h2::Reason::INTERNAL_ERROR);
        return;
    }
    if stream.send_data(out.freeze(), false).is_err() {
        return;
    }
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let _ = stream.send_trailers(trailers);
}

/// An error answer: gRPC's trailers-only response (the status in the headers, no message).
fn send_status(respond: &mut SendResponse<Bytes>, code: u32, text: &str) {
    debug_assert_ne!(code, OK);
    let mut response = grpc_headers();
    let headers = response.headers_mut();
    headers.insert("grpc-status", HeaderValue::from(code));
    if !text.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&percent_encode(text)) {
            headers.insert("grpc-message", value);
        }
    }
    let _ = respond.send_response(response, true);
}

/// `grpc-message` is percent-encoded: every byte outside printable ASCII, and `%` itself.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::percent_encode;

    #[test]
    fn grpc_message_is_percent_encoded() {
        assert_eq!(percent_encode("plain text"), "plain text");
        assert_eq!(percent_encode("100%"), "100%25");
        assert_eq!(percent_encode("é\n"), "%C3%A9%0A");
    }
}
