//! The lean HTTP/1.1 server path: the common request served without hyper's connection machinery.
//!
//! hyper's server dispatcher costs about a third of a proxied request's instructions, most of it
//! bookkeeping a plain `GET` does not need (a boxed header-read timer armed and dropped per
//! request, the dispatcher's state machine, a second header encoder). This path serves what most
//! API traffic is: a `GET` over plain TCP whose whole head came in one read, with no body and
//! nothing asked of the connection. It parses the head with `httparse` in place, calls the same
//! handler, and writes the answer's head and first bytes of body in one `write`.
//!
//! Anything else is handed to hyper, with the bytes already read, for the rest of the connection:
//! another method (a body, `HEAD`'s framing, `CONNECT`), HTTP/1.0, a head split across reads,
//! `Content-Length`, `Transfer-Encoding`, `Upgrade`, `Expect`, `TE`, a `Connection` field other
//! than `keep-alive`, and every head `httparse` or `http` refuses. hyper's answers to odd and
//! hostile input (400, 414, 431, its header-read timeout, upgrades, `100-continue`) are therefore
//! exactly what they were; this path never writes an error of its own.
//!
//! What this path keeps from hyper's: an idle keep-alive connection is closed after
//! `server.header_read_timeout` (one lazily re-armed timer per connection, not one per request);
//! a client that closes while its request is in flight cancels it (the handler's future is
//! dropped, as hyper drops it); pipelined requests are answered in order; shutdown closes idle
//! connections and lets a request in flight finish with `Connection: close`; responses carry
//! `Date`, and `Content-Length` when the body's size is known, chunked framing otherwise
//! (RFC 9112 §6.1, §7.1; trailers are dropped, as hyper drops them for clients that did not ask).

use std::future::{poll_fn, Future};
use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, DATE, TRANSFER_ENCODING};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::Prefixed;
use crate::proxy::body::{ClientBody, ResponseBody};
use crate::proxy::fields::{has_name, OwnValue};

/// As hyper's default: a head with more fields goes to hyper, which refuses it.
const MAX_HEADERS: usize = 100;
/// hyper answers 414 from this length on.
const MAX_URI_LEN: usize = u16::MAX as usize - 1;
/// Read buffer per connection; a larger head is split across reads and goes to hyper.
const READ_BUF: usize = 8 * 1024;
/// Fields the gateway may add to a request on its way upstream (the `X-Forwarded-*` family, the
/// request id).
const ADDED_FIELDS: usize = 7;
/// Less room than this left in the read buffer, and it is grown (or reclaimed) first.
const MIN_READ: usize = 1024;
/// Body bytes gathered before a write; larger frames are written as they come.
const WRITE_GATHER: usize = 16 * 1024;

/// How a lean connection ended.
pub(super) enum Ended {
    /// Closed: by the client, an error, the idle timeout or shutdown.
    Closed,
    /// hyper serves the rest: the connection, with what was read of it first.
    HandOff(Prefixed<TcpStream>),
}

/// The bounds this path keeps (`server.*`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub header_read_timeout: Duration,
    pub max_header_size: usize,
}

/// Serves `stream`'s requests while they are the common kind; hands the connection to hyper at
/// the first that is not.
pub(super) async fn serve<H: super::Handler>(
    mut stream: TcpStream,
    peer: SocketAddr,
    handler: &H,
    limits: Limits,
    stopping: &watch::Receiver<bool>,
) -> Ended {
    let mut buf = BytesMut::with_capacity(READ_BUF);
    let mut out = BytesMut::with_capacity(READ_BUF);
    let mut idle = IdleTimer::new(limits.header_read_timeout);
    let mut stop_rx = stopping.clone();
    let mut stop = pin!(async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    });
    loop {
        if buf.is_empty() {
            if *stopping.borrow() {
                return Ended::Closed;
            }
            // Idle between requests: hyper's header-read timeout covers this wait too. It began
            // at about the last reading of the clock (`crate::now`), the response's.
            let since = crate::now::recent_tokio();
            loop {
                room(&mut buf);
                tokio::select! {
                    biased;
                    read = stream.read_buf(&mut buf) => match read {
                        Ok(0) | Err(_) => return Ended::Closed,
                        Ok(_) => break,
                    },
                    expired = idle.wait(since) => if expired {
                        return Ended::Closed;
                    },
                    () = &mut stop => return Ended::Closed,
                }
            }
        }
        let Some(request) = parse_request(&mut buf, limits.max_header_size) else {
            return Ended::HandOff(Prefixed::new(buf.freeze(), stream));
        };

        // In flight: the client closing cancels the request, as with hyper. Bytes that arrive
        // meanwhile are the next requests (pipelining), kept up to the head size limit.
        // Scoped: the finished future's room is free for the write below to reuse.
        let response = {
            let mut response = pin!(handler.call(peer, request));
            loop {
                let watching = buf.len() < limits.max_header_size;
                if watching {
                    room(&mut buf);
                }
                tokio::select! {
                    biased;
                    response = &mut response => break response,
                    read = stream.read_buf(&mut buf), if watching => match read {
                        Ok(0) | Err(_) => return Ended::Closed,
                        Ok(_) => {}
                    },
                }
            }
        };
        let Ok(response) = response;
        let closing = *stopping.borrow();
        match write_response(&mut stream, &mut out, &mut buf, &limits, response, closing).await {
            Ok(true) => {}
            Ok(_) | Err(_) => {
                let _ = stream.shutdown().await;
                return Ended::Closed;
            }
        }
    }
}

/// Room to read into. The buffer is grown only when nearly full: a request's fields share its
/// allocation while it is in flight, and once they are gone `reserve` takes the space back in
/// place instead of allocating.
fn room(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < MIN_READ {
        buf.reserve(READ_BUF);
    }
}

/// The request at the start of `buf` if it is the common kind (see the module docs), taken out
/// of `buf`; `None` leaves `buf` whole for hyper.
fn parse_request(buf: &mut BytesMut, max_head: usize) -> Option<Request<ClientBody>> {
    // Uninitialised: a table of empty fields would be written in full for every request.
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let len = match parsed.parse_with_uninit_headers(buf, &mut fields) {
        // Over `max_header_size`: hyper's 431, even when it came in one read.
        Ok(httparse::Status::Complete(len)) if len <= max_head => len,
        _ => return None,
    };
    if parsed.method != Some("GET") || parsed.version != Some(1) {
        return None;
    }
    let path = parsed.path?;
    if path.len() >= MAX_URI_LEN {
        return None;
    }
    let base = buf.as_ptr() as usize;
    let span = |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        (start, start + s.len())
    };
    let mut spans: smallvec::SmallVec<[(Span, Span); 16]> = smallvec::SmallVec::new();
    for field in parsed.headers.iter() {
        if asks_more(field.name.as_bytes(), field.value) {
            return None;
        }
        spans.push((span(field.name.as_bytes()), span(field.value)));
    }
    let path = span(path.as_bytes());

    let head = buf.split_to(len).freeze();
    match build(&head, path, &spans) {
        Some(request) => Some(request),
        None => {
            // Refused by `http`: hyper gets the bytes back and answers as it always has.
            let mut whole = BytesMut::with_capacity(head.len() + buf.len());
            whole.extend_from_slice(&head);
            whole.extend_from_slice(buf);
            *buf = whole;
            None
        }
    }
}

/// Whether a request field asks for something only hyper does: a body, an upgrade, a
/// `100-continue`, trailers, or a `Connection` option other than `keep-alive`.
fn asks_more(name: &[u8], value: &[u8]) -> bool {
    let is = |known: &str| name.eq_ignore_ascii_case(known.as_bytes());
    match name.len() {
        2 => is("te"),
        6 => is("expect"),
        7 => is("upgrade"),
        10 => is("connection") && !value.trim_ascii().eq_ignore_ascii_case(b"keep-alive"),
        14 => is("content-length"),
        17 => is("transfer-encoding"),
        _ => false,
    }
}

type Span = (usize, usize);

fn build(head: &Bytes, path: Span, fields: &[(Span, Span)]) -> Option<Request<ClientBody>> {
    let uri = Uri::from_maybe_shared(head.slice(path.0..path.1)).ok()?;
    // Room for the fields the proxy adds (`X-Forwarded-*`, `Forwarded`, `Via`) without growing.
    let mut headers = crate::proxy::headers::field_map(fields.len() + ADDED_FIELDS);
    for &((ns, ne), (vs, ve)) in fields {
        let name = HeaderName::from_bytes(&head[ns..ne]).ok()?;
        let value = HeaderValue::from_maybe_shared(head.slice(vs..ve)).ok()?;
        headers.append(name, value);
    }
    let mut request = Request::new(ClientBody::empty());
    *request.method_mut() = Method::GET;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    Some(request)
}

/// How the body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// 1xx, 204, 304: no body whatever the fields say.
    None,
    Length(u64),
    Chunked,
}

/// Writes `response`; `Ok(true)` when the connection may carry another request. While the body
/// waits for its upstream, the client's side is watched too: its close ends the exchange (the
/// body, and whatever it holds, is dropped, as hyper drops it), and what it sends meanwhile is
/// kept in `buf` for the next request.
///
/// The head is encoded before the future is made, which then holds only the body (an `async fn`
/// would keep the whole response in its state beside it). Inlined, so that the future is built
/// in the connection's state, not built and then copied there.
#[inline(always)]
fn write_response<'a>(
    stream: &'a mut TcpStream,
    out: &'a mut BytesMut,
    buf: &'a mut BytesMut,
    limits: &'a Limits,
    response: Response<ResponseBody>,
    closing: bool,
) -> impl Future<Output = io::Result<bool>> + 'a {
    let (parts, mut body) = response.into_parts();
    out.clear();
    let (framing, mut reusable) = encode_head(out, &parts.status, &parts.headers, &body, closing);
    drop(parts);
    async move {
        if framing == Framing::None {
            stream.write_all(out).await?;
            return Ok(reusable);
        }
        let mut body = Pin::new(&mut body);
        let mut sent: u64 = 0;
        loop {
            // The head waits for the first body bytes when they are already here: one write.
            let watching = buf.len() < limits.max_header_size;
            let step = poll_fn(|cx| match body.as_mut().poll_frame(cx) {
                Poll::Ready(Some(frame)) => Poll::Ready(Step::Frame(frame)),
                Poll::Ready(None) => Poll::Ready(Step::End),
                Poll::Pending if !out.is_empty() => Poll::Ready(Step::Flush),
                Poll::Pending if watching && stream.poll_read_ready(cx).is_ready() => {
                    Poll::Ready(Step::Readable)
                }
                Poll::Pending => Poll::Pending,
            })
            .await;
            match step {
                Step::Readable => {
                    room(buf);
                    match stream.try_read_buf(buf) {
                        Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
                Step::Flush => {
                    stream.write_all(out).await?;
                    out.clear();
                }
                Step::End => {
                    match framing {
                        Framing::Chunked => out.extend_from_slice(b"0\r\n\r\n"),
                        // Shorter than announced: the client must see the connection end.
                        Framing::Length(n) if sent != n => reusable = false,
                        _ => {}
                    }
                    stream.write_all(out).await?;
                    out.clear();
                    return Ok(reusable);
                }
                Step::Frame(Err(_)) => {
                    // The body broke: what was sent stands, and the close tells the client it is cut.
                    if !out.is_empty() {
                        stream.write_all(out).await?;
                    }
                    return Ok(false);
                }
                Step::Frame(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if data.is_empty() {
                        continue;
                    }
                    sent += data.len() as u64;
                    match framing {
                        Framing::Length(n) if sent > n => {
                            // Longer than announced: stop at the end of the announced length.
                            let keep = data.len() - usize::try_from(sent - n).unwrap_or(data.len());
                            out.extend_from_slice(&data[..keep]);
                            stream.write_all(out).await?;
                            return Ok(false);
                        }
                        Framing::Chunked => {
                            put_hex(out, data.len());
                            out.extend_from_slice(b"\r\n");
                            gather(stream, out, data).await?;
                            out.extend_from_slice(b"\r\n");
                        }
                        _ => gather(stream, out, data).await?,
                    }
                }
            }
        }
    }
}

enum Step {
    Frame(Result<http_body::Frame<Bytes>, crate::proxy::body::BoxError>),
    End,
    /// Body bytes are gathered and the body has nothing more yet: write them.
    Flush,
    /// The client sent something (or closed) while the body waits.
    Readable,
}

/// Appends `data` to `out`, or for a large frame writes `out` and then `data` itself.
async fn gather(stream: &mut TcpStream, out: &mut BytesMut, data: Bytes) -> io::Result<()> {
    if out.len() + data.len() <= WRITE_GATHER {
        out.extend_from_slice(&data);
        return Ok(());
    }
    if !out.is_empty() {
        stream.write_all(out).await?;
        out.clear();
    }
    stream.write_all(&data).await
}

/// Writes the status line and fields into `out` and says how the body is framed, and whether
/// the connection may be kept.
fn encode_head(
    out: &mut BytesMut,
    status: &StatusCode,
    headers: &HeaderMap,
    body: &ResponseBody,
    closing: bool,
) -> (Framing, bool) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.extend_from_slice(b" ");
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let bodiless = status.is_informational()
        || *status == StatusCode::NO_CONTENT
        || *status == StatusCode::NOT_MODIFIED;
    let mut length = None;
    let mut reusable = !closing;
    let mut has_date = false;
    // A lean upstream exchange's fields, copied as they came (its hop-by-hop fields were never
    // kept), less those the gateway set itself: the gateway's replace the upstream's.
    if let Some(raw) = body.upstream_fields() {
        for (name, value, line) in raw.iter() {
            if raw.owns(name) || has_name(headers, name) {
                continue;
            }
            if name.eq_ignore_ascii_case(b"content-length") {
                match length_value(value) {
                    Some(n) if length.is_none() => length = Some(n),
                    _ => continue,
                }
            } else if name.eq_ignore_ascii_case(b"date") {
                has_date = true;
            }
            out.extend_from_slice(line);
            out.extend_from_slice(b"\r\n");
        }
        for (name, value) in raw.own() {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            match value {
                OwnValue::Number(n) => put_decimal(out, *n),
                OwnValue::Value(value) => out.extend_from_slice(value.as_bytes()),
            }
            out.extend_from_slice(b"\r\n");
        }
    }
    for (name, value) in headers {
        if *name == CONTENT_LENGTH {
            // One valid length is written, as hyper writes it.
            match length_value(value.as_bytes()) {
                Some(n) if length.is_none() => length = Some(n),
                _ => continue,
            }
        } else if *name == CONNECTION {
            if value
                .as_bytes()
                .split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"))
            {
                reusable = false;
            }
            if closing {
                continue;
            }
        } else if *name == DATE {
            has_date = true;
        } else if *name == TRANSFER_ENCODING {
            // Framing is this writer's (below); the proxy strips it from upstream answers anyway.
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !has_date {
        put_date(out);
    }
    if closing {
        out.extend_from_slice(b"connection: close\r\n");
    }
    let framing = if bodiless {
        Framing::None
    } else if let Some(n) = length {
        Framing::Length(n)
    } else if let Some(n) = body.size_hint().exact() {
        out.extend_from_slice(b"content-length: ");
        put_decimal(out, n);
        out.extend_from_slice(b"\r\n");
        Framing::Length(n)
    } else {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        Framing::Chunked
    };
    out.extend_from_slice(b"\r\n");
    (framing, reusable)
}

/// A `Content-Length` value hyper would write: one decimal number, spaces around it allowed.
fn length_value(value: &[u8]) -> Option<u64> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

fn put_decimal(out: &mut BytesMut, n: u64) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(crate::respond::digits(n, &mut buf));
}

fn put_hex(out: &mut BytesMut, n: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    let mut start = digits.len();
    let mut rest = n;
    loop {
        start -= 1;
        digits[start] = HEX[rest & 0xf];
        rest >>= 4;
        if rest == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[start..]);
}

thread_local! {
    /// `date: <IMF-fixdate>\r\n` for the current second (RFC 9110 §6.6.1), made once a second.
    static DATE_LINE: std::cell::RefCell<DateLine> = const {
        std::cell::RefCell::new(DateLine { until: None, line: Vec::new() })
    };
}

/// The `date` field of this second, and the monotonic instant the second ends at.
struct DateLine {
    until: Option<Instant>,
    line: Vec<u8>,
}

/// Writes the `date` field: the wall clock is read once a second, the last monotonic reading
/// (`crate::now`) tells when the second is over.
fn put_date(out: &mut BytesMut) {
    let now = crate::now::recent();
    DATE_LINE.with(|cell| {
        let mut date = cell.borrow_mut();
        if date.until.is_none_or(|until| now >= until) {
            let wall = SystemTime::now();
            let into_second = wall
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let left = Duration::from_secs(1) - Duration::from_nanos(u64::from(into_second));
            date.until = Some(now + left);
            date.line = format!("date: {}\r\n", httpdate::fmt_http_date(wall)).into_bytes();
        }
        out.extend_from_slice(&date.line);
    });
}

/// Closes an idle keep-alive connection after the header-read timeout. One timer per connection,
/// moved only when it fires early: a wait that starts later than the timer's deadline assumed
/// re-arms it then, so a busy connection costs no timer-wheel work (and no clock read: a wait
/// starts at `crate::now::recent`).
struct IdleTimer {
    limit: Duration,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl IdleTimer {
    fn new(limit: Duration) -> Self {
        IdleTimer {
            limit,
            sleep: Box::pin(tokio::time::sleep(limit)),
        }
    }

    /// Resolves `true` once the wait that began at `since` has lasted the limit. Resolves `false`
    /// (to be called again) when the timer fired for an earlier wait and has been moved on.
    async fn wait(&mut self, since: tokio::time::Instant) -> bool {
        let deadline = since + self.limit;
        if self.sleep.deadline() > deadline {
            self.sleep.as_mut().reset(deadline);
        }
        self.sleep.as_mut().await;
        if tokio::time::Instant::now() >= deadline {
            return true;
        }
        self.sleep.as_mut().reset(deadline);
        false
    }
}

#[cfg(test)]
#[path = "h1_tests.rs"]
mod tests;
