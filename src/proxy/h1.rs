//! A lean HTTP/1.1 exchange with a plain-TCP upstream, for the requests most traffic is: no body
//! and no upgrade.
//!
//! Why not hyper's client for these: its connection runs as a task of its own, so every request
//! is a message handed to that task, a dispatcher poll to write it, another to read the answer,
//! and wake-ups across tasks, about 12k instructions per request, as much as all of Turnstile's
//! own work on the request. Here the request's task writes the head in one `write` and parses the
//! response head with `httparse` in place; the body is read as the client is sent it. Requests
//! with a body, upgrades, `CONNECT` and TLS upstreams keep hyper's client ([`super::pool`]).
//!
//! Framing follows RFC 9112 §6.3: no body for `HEAD`, 1xx, 204 and 304; `Transfer-Encoding`
//! ending in `chunked` is decoded; `Content-Length` otherwise; else the body runs to the close.
//! A response with both `Transfer-Encoding` and `Content-Length` is refused (a response-splitting
//! signal, §6.3 item 3). A connection is reused (§9.3) only when its response was read whole, said
//! nothing of closing, and left no stray bytes behind.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::request::Parts;
use http::{Method, Response, StatusCode, Version};
use smallvec::SmallVec;
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;

use super::fields::RawFields;

/// Largest response head accepted (status line and fields).
pub const MAX_HEAD: usize = 64 * 1024;
/// Most response fields accepted (hyper's client allows as many).
const MAX_HEADERS: usize = 100;
// Each field has a bit in `parse_head`'s `u128`.
const _: () = assert!(MAX_HEADERS <= 128);
/// Longest chunk-size line (with extensions), and most trailer bytes, accepted.
const MAX_CHUNK_LINE: usize = 4 * 1024;
const MAX_TRAILERS: usize = 16 * 1024;
/// Room offered to each read.
const READ_SIZE: usize = 8 * 1024;

/// One open connection to the upstream. Holds its pool slot until it closes.
///
/// Boxed: a connection travels with its response (pool, exchange, body, back to the pool), and
/// every move of a response would otherwise copy its state too.
#[derive(Debug)]
pub struct Conn(Box<State>);

/// What a [`Conn`] holds.
#[derive(Debug)]
pub struct State {
    io: TcpStream,
    read: BytesMut,
    write: Vec<u8>,
    /// The last read filled less than the room it was offered: the socket was empty then.
    drained: bool,
    /// The response-head deadline, kept from one exchange to the next: tokio's timer wheel is
    /// touched only when a timer moves earlier, so resetting this one to each exchange's (later)
    /// deadline costs no wheel insertion and removal, as a timer per request did (1-2% of a
    /// proxied request: docs/benchmarks.md, issue 14's tenth pass).
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The connection worker whose runtime the socket was opened on (`crate::workers::index`).
    home: usize,
    _slot: OwnedSemaphorePermit,
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("upstream I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("upstream closed the connection before answering")]
    Closed,
    #[error("upstream closed the connection mid-response")]
    Truncated,
    #[error("malformed upstream response: {0}")]
    Malformed(&'static str),
    #[error("upstream response head over {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("upstream switched protocols uninvited")]
    Switched,
    #[error("no upstream response head by the deadline")]
    TimedOut,
}

/// A failed exchange, and whether the upstream can have seen nothing of it: the connection was
/// closed (or reset) before a single response byte came back, as happens when a reused
/// connection's upstream closed it while it sat idle.
#[derive(Debug)]
pub struct Failure {
    pub error: Error,
    pub unanswered: bool,
}

/// How the response body is delimited, and how far it has been read.
#[derive(Debug)]
enum Framing {
    Length(u64),
    Chunked(Chunk),
    UntilClose,
    Done,
}

#[derive(Debug, Clone, Copy)]
enum Chunk {
    Size,
    Data(u64),
    DataEnd,
    Trailers(usize),
}

/// A response body being read from its connection.
#[derive(Debug)]
pub struct Body {
    conn: Option<Conn>,
    framing: Framing,
    keep_alive: bool,
    /// The response's fields, until the writer or [`super::fields::materialize`] takes them.
    fields: RawFields,
}

/// Whether a request can take the lean path: no body to stream, nothing to upgrade.
pub fn suits(parts: &Parts, body_ended: bool) -> bool {
    body_ended
        && parts.method != Method::CONNECT
        && !parts.headers.contains_key(http::header::UPGRADE)
}

/// RFC 9110 §9.2.2: requests a client may send again when a connection fails before any answer.
pub fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

impl std::ops::Deref for Conn {
    type Target = State;

    fn deref(&self) -> &State {
        &self.0
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.0
    }
}

impl Conn {
    pub fn new(io: TcpStream, slot: OwnedSemaphorePermit) -> Self {
        Conn(Box::new(State {
            io,
            read: BytesMut::new(),
            write: Vec::new(),
            drained: false,
            timer: None,
            home: crate::workers::index(),
            _slot: slot,
        }))
    }

    /// The connection worker it was opened on.
    pub fn home(&self) -> usize {
        self.0.home
    }

    /// Whether an idle connection can carry a request: the upstream has not closed it and sent
    /// nothing unasked. Costs no system call unless the socket became readable while idle.
    pub fn usable(&self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        match self.io.poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            // A close, stray bytes, or readiness left from the last exchange: look.
            Poll::Ready(Ok(())) => {
                let mut probe = [0u8; 1];
                matches!(self.io.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
            }
        }
    }

    /// Sends a bodiless request and reads the response head; the connection goes on with the
    /// body. Informational (1xx) answers before the final one are skipped.
    pub async fn exchange(
        mut self,
        parts: &Parts,
        deadline: tokio::time::Instant,
    ) -> Result<(Response<()>, Body), Failure> {
        let mut timer = match self.timer.take() {
            Some(mut timer) => {
                timer.as_mut().reset(deadline);
                timer
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        };
        let timed_out = || Failure {
            error: Error::TimedOut,
            unanswered: false,
        };
        encode_head(&mut self.write, parts);
        let State { io, write, .. } = &mut *self.0;
        let written = tokio::select! {
            biased;
            written = io.write_all(write) => written,
            () = timer.as_mut() => return Err(timed_out()),
        };
        if let Err(e) = written {
            return Err(Failure {
                unanswered: closed_kind(&e),
                error: Error::Io(e),
            });
        }
        let head_only = parts.method == Method::HEAD;
        let mut answered = false;
        loop {
            if !self.read.is_empty() {
                answered = true;
                let fail = |error| Failure {
                    error,
                    unanswered: false,
                };
                if let Some(Head {
                    response,
                    fields,
                    framing,
                    keep_alive,
                }) = parse_head(&mut self.read, head_only).map_err(fail)?
                {
                    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                        return Err(fail(Error::Switched));
                    }
                    if response.status().is_informational() {
                        continue;
                    }
                    self.timer = Some(timer);
                    let body = Body {
                        conn: Some(self),
                        framing,
                        keep_alive,
                        fields,
                    };
                    return Ok((response, body));
                }
                if self.read.len() >= MAX_HEAD {
                    return Err(fail(Error::HeadTooLarge));
                }
            }
            let read = std::future::poll_fn(|cx| match self.poll_read_more(cx) {
                Poll::Ready(read) => Poll::Ready(Some(read)),
                Poll::Pending => timer.as_mut().poll(cx).map(|()| None),
            })
            .await;
            let Some(read) = read else {
                return Err(timed_out());
            };
            match read {
                Ok(0) if answered => {
                    return Err(Failure {
                        error: Error::Truncated,
                        unanswered: false,
                    })
                }
                Ok(0) => {
                    return Err(Failure {
                        error: Error::Closed,
                        unanswered: true,
                    })
                }
                Ok(_) => {}
                Err(e) => {
                    return Err(Failure {
                        unanswered: !answered && closed_kind(&e),
                        error: Error::Io(e),
                    })
                }
            }
        }
    }

    /// Reads what the socket has into the buffer (0 at the end of the stream).
    fn poll_read_more(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        self.read.reserve(READ_SIZE);
        loop {
            let room = self.read.capacity() - self.read.len();
            let state = &mut *self.0;
            match state.io.try_read_buf(&mut state.read) {
                Ok(n) => {
                    self.drained = n < room;
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::task::ready!(self.io.poll_read_ready(cx))?;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Readies a connection whose exchange is over for the pool. When its last read emptied the
    /// socket, the readiness that read left is cleared here, so that looking at it next time
    /// ([`usable`](Self::usable)) costs no system call. A close that came meanwhile is kept:
    /// tokio never clears a closed state.
    fn settle(self) -> Option<Conn> {
        if !self.read.is_empty() {
            return None;
        }
        if self.drained {
            let _ = self.io.try_io(Interest::READABLE, || {
                Err::<(), _>(io::Error::from(io::ErrorKind::WouldBlock))
            });
        }
        Some(self)
    }
}

impl Body {
    /// The next piece of the body, `None` at its end.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Error>>> {
        loop {
            let Some(conn) = self.conn.as_mut() else {
                return Poll::Ready(None);
            };
            let buf = &mut conn.read;
            match &mut self.framing {
                Framing::Done => return Poll::Ready(None),
                Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Poll::Ready(None);
                }
                Framing::Length(remaining) | Framing::Chunked(Chunk::Data(remaining))
                    if !buf.is_empty() =>
                {
                    let take = (*remaining).min(buf.len() as u64);
                    *remaining -= take;
                    // `take` fits: it is at most the buffer's length.
                    let piece = buf.split_to(take as usize).freeze();
                    if let Framing::Chunked(chunk @ Chunk::Data(0)) = &mut self.framing {
                        *chunk = Chunk::DataEnd;
                    }
                    return Poll::Ready(Some(Ok(piece)));
                }
                Framing::UntilClose if !buf.is_empty() => {
                    let piece = buf.split().freeze();
                    return Poll::Ready(Some(Ok(piece)));
                }
                Framing::Chunked(Chunk::Size) => {
                    if let Some(end) = buf.iter().position(|&b| b == b'\n') {
                        let size = chunk_size(&buf[..end]).ok_or(Error::Malformed("chunk size"));
                        let size = match size {
                            Ok(size) => size,
                            Err(e) => return Poll::Ready(Some(Err(e))),
                        };
                        let _ = buf.split_to(end + 1);
                        self.framing = Framing::Chunked(if size == 0 {
                            Chunk::Trailers(0)
                        } else {
                            Chunk::Data(size)
                        });
                        continue;
                    }
                    if buf.len() > MAX_CHUNK_LINE {
                        return Poll::Ready(Some(Err(Error::Malformed(
                            "chunk size line too long",
                        ))));
                    }
                }
                Framing::Chunked(Chunk::DataEnd) if buf.len() >= 2 => {
                    if &buf[..2] != b"\r\n" {
                        return Poll::Ready(Some(Err(Error::Malformed("chunk not ended by CRLF"))));
                    }
                    let _ = buf.split_to(2);
                    self.framing = Framing::Chunked(Chunk::Size);
                    continue;
                }
                Framing::Chunked(Chunk::Trailers(seen)) => {
                    if let Some(end) = buf.iter().position(|&b| b == b'\n') {
                        let line = &buf[..end];
                        let blank = line.is_empty() || line == b"\r";
                        *seen += end + 1;
                        if *seen > MAX_TRAILERS {
                            return Poll::Ready(Some(Err(Error::Malformed("trailers too long"))));
                        }
                        // Trailer fields are dropped: nothing downstream asked for them.
                        let _ = buf.split_to(end + 1);
                        if blank {
                            self.framing = Framing::Done;
                            return Poll::Ready(None);
                        }
                        continue;
                    }
                    if buf.len() > MAX_TRAILERS {
                        return Poll::Ready(Some(Err(Error::Malformed("trailers too long"))));
                    }
                }
                // Nothing buffered for this state: read.
                _ => {}
            }
            match std::task::ready!(conn.poll_read_more(cx)) {
                Ok(0) => {
                    if matches!(self.framing, Framing::UntilClose) {
                        self.framing = Framing::Done;
                        self.keep_alive = false;
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Err(Error::Truncated)));
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(Error::Io(e)))),
            }
        }
    }

    /// The response's fields, as they came.
    pub fn fields(&self) -> &RawFields {
        &self.fields
    }

    /// The same, to add the gateway's own or take them.
    pub fn fields_mut(&mut self) -> &mut RawFields {
        &mut self.fields
    }

    /// Whether the body has been read to its end (nothing more to poll).
    pub fn is_end(&self) -> bool {
        matches!(self.framing, Framing::Done | Framing::Length(0))
    }

    /// The exact length still to come, when the upstream declared it.
    pub fn remaining(&self) -> Option<u64> {
        match self.framing {
            Framing::Length(n) => Some(n),
            Framing::Done => Some(0),
            _ => None,
        }
    }

    /// The connection, once the body has ended on it cleanly and it may carry another request.
    pub fn take_reusable(&mut self) -> Option<Conn> {
        if !self.is_end() || !self.keep_alive {
            return None;
        }
        self.conn.take().and_then(Conn::settle)
    }
}

/// `METHOD origin-form HTTP/1.1`, the fields as they are, and `Content-Length: 0` where the
/// method defines a body and the client sent none (RFC 9110 §8.6).
fn encode_head(buf: &mut Vec<u8>, parts: &Parts) {
    buf.clear();
    buf.extend_from_slice(parts.method.as_str().as_bytes());
    buf.push(b' ');
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    buf.extend_from_slice(target.as_bytes());
    buf.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        buf.extend_from_slice(name.as_str().as_bytes());
        buf.extend_from_slice(b": ");
        buf.extend_from_slice(value.as_bytes());
        buf.extend_from_slice(b"\r\n");
    }
    if matches!(parts.method, Method::POST | Method::PUT | Method::PATCH)
        && !parts.headers.contains_key(CONTENT_LENGTH)
    {
        buf.extend_from_slice(b"content-length: 0\r\n");
    }
    buf.extend_from_slice(b"\r\n");
}

/// A parsed response head: the status (its field map empty), the fields kept, the body's
/// framing, and whether the connection may be reused after it.
struct Head {
    response: Response<()>,
    fields: RawFields,
    framing: Framing,
    keep_alive: bool,
}

/// Parses a response head off the front of `buf`: `None` while it is incomplete. The fields stay
/// in the head's bytes ([`RawFields`]); the response's own field map is left empty. Hop-by-hop
/// fields (RFC 9110 §7.6.1: `Connection`, the fields it names, and the fixed list) are read for
/// framing and reuse but never kept.
fn parse_head(buf: &mut BytesMut, head_only: bool) -> Result<Option<Head>, Error> {
    // Uninitialised: a table of empty fields would be written in full for every response.
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut parsed,
        buf,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(Error::Malformed("too many fields")),
        Err(_) => return Err(Error::Malformed("unparsable head")),
    };
    let status = parsed
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or(Error::Malformed("status code"))?;
    let version = if parsed.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };

    let mut length: Option<u64> = None;
    let mut chunked = None;
    let mut close = false;
    let mut keep_alive = false;
    // Names a `Connection` field lists (besides its own options): hop-by-hop for this response.
    let mut named: SmallVec<[&[u8]; 4]> = SmallVec::new();
    // Bit `i`: field `i` is hop-by-hop by its own name. Each name is classified once, here.
    let mut hop: u128 = 0;
    for (i, field) in parsed.headers.iter().enumerate() {
        let kind = classify(field.name.as_bytes());
        if !matches!(kind, Field::EndToEnd | Field::ContentLength) {
            hop |= 1 << i;
        }
        match kind {
            Field::ContentLength => {
                for part in field.value.split(|&b| b == b',') {
                    let n = content_length(part).ok_or(Error::Malformed("content-length"))?;
                    if length.is_some_and(|seen| seen != n) {
                        return Err(Error::Malformed("conflicting content-length"));
                    }
                    length = Some(n);
                }
            }
            Field::TransferEncoding => {
                // The last coding decides (RFC 9112 §6.3 item 4).
                if let Some(last) = field.value.rsplit(|&b| b == b',').next() {
                    chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
                }
            }
            Field::Connection => {
                for token in field.value.split(|&b| b == b',') {
                    let token = token.trim_ascii();
                    if token.eq_ignore_ascii_case(b"close") {
                        close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        keep_alive = true;
                    } else if !token.is_empty() {
                        named.push(token);
                    }
                }
            }
            Field::OtherHop | Field::EndToEnd => {}
        }
    }
    // Every offset below is under `len`, so it fits the spans' `u32`.
    if u32::try_from(len).is_err() {
        return Err(Error::HeadTooLarge);
    }
    let base = buf.as_ptr() as usize;
    let mut spans = Vec::with_capacity(parsed.headers.len());
    for (i, f) in parsed.headers.iter().enumerate() {
        let name = f.name.as_bytes();
        if hop & (1 << i) != 0 || named.iter().any(|n| name.eq_ignore_ascii_case(n)) {
            continue;
        }
        let name = f.name.as_ptr() as usize - base;
        let value = f.value.as_ptr() as usize - base;
        spans.push([name, name + f.name.len(), value, value + f.value.len()].map(|n| n as u32));
    }
    drop(named);
    let fields = RawFields::new(buf.split_to(len).freeze(), spans);
    let keep_alive = !close && (version == Version::HTTP_11 || keep_alive);

    let bodiless = head_only
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let framing = if bodiless {
        Framing::Done
    } else {
        match (chunked, length) {
            (Some(_), Some(_)) => {
                return Err(Error::Malformed(
                    "both transfer-encoding and content-length",
                ))
            }
            (Some(true), None) => Framing::Chunked(Chunk::Size),
            (Some(false), None) | (None, None) => Framing::UntilClose,
            (None, Some(n)) => Framing::Length(n),
        }
    };
    let keep_alive = keep_alive && !matches!(framing, Framing::UntilClose);

    let mut response = Response::new(());
    *response.status_mut() = status;
    *response.version_mut() = version;
    Ok(Some(Head {
        response,
        fields,
        framing,
        keep_alive,
    }))
}

/// What a response field's name makes it, for framing and for forwarding. Every kind but
/// `EndToEnd` and `ContentLength` is hop-by-hop: the fields every proxy treats so in a response
/// (RFC 9110 §7.6.1), besides those a `Connection` field names. `Upgrade` is among them: this
/// exchange never carries an upgrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    ContentLength,
    TransferEncoding,
    Connection,
    /// Hop-by-hop, and nothing to read in it: `Keep-Alive`, `Proxy-Connection`, `TE`,
    /// `Trailer`, `Upgrade`.
    OtherHop,
    EndToEnd,
}

/// A field name's kind: its length picks the one or two names it can be.
fn classify(name: &[u8]) -> Field {
    let is = |known: &[u8]| token_eq(name, known);
    match name.len() {
        2 if is(b"te") => Field::OtherHop,
        7 if is(b"trailer") || is(b"upgrade") => Field::OtherHop,
        10 if is(b"connection") => Field::Connection,
        10 if is(b"keep-alive") => Field::OtherHop,
        14 if is(b"content-length") => Field::ContentLength,
        16 if is(b"proxy-connection") => Field::OtherHop,
        17 if is(b"transfer-encoding") => Field::TransferEncoding,
        _ => Field::EndToEnd,
    }
}

/// Whether the token `name` is `known` (lower-case letters and `-`) in any case. A token has no
/// byte that setting bit 5 makes a letter or `-` other than an upper-case letter, so one OR
/// per byte compares it (RFC 9110 §5.6.2: `httparse` admits only tokens as names).
fn token_eq(name: &[u8], known: &[u8]) -> bool {
    name.len() == known.len() && name.iter().zip(known).all(|(&a, &b)| a | 0x20 == b)
}

fn content_length(digits: &[u8]) -> Option<u64> {
    let digits = digits.trim_ascii();
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| {
        d.is_ascii_digit().then(|| n * 10 + u64::from(d - b'0'))
    })
}

/// The size of a chunk-size line (`1a;ext=1\r`), hexadecimal, extensions ignored.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let hex = line.split(|&b| b == b';').next().map(<[u8]>::trim_ascii)?;
    if hex.is_empty() || hex.len() > 15 {
        return None;
    }
    hex.iter().try_fold(0u64, |n, &d| {
        let digit = (d as char).to_digit(16)?;
        Some(n * 16 + u64::from(digit))
    })
}

/// Errors that mean the peer closed or reset the connection.
fn closed_kind(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
    )
}

#[cfg(test)]
#[path = "h1_tests.rs"]
mod tests;
