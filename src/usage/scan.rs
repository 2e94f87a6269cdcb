//! Finding JSON values in a response body as its bytes go by, with bounded state.
//!
//! The body is never held back: [`Scanner::feed`] reads a chunk the client gets unchanged. A JSON
//! body is kept (up to `max` bytes) and parsed when it ends; an event stream (`text/event-stream`,
//! the WHATWG HTML "server-sent events" format) is cut into events at blank lines and each event's
//! `data` is parsed as it completes, so only the event being received is kept (up to `max`). A
//! body or event past `max` is skipped: it reports nothing.

use serde_json::Value;

/// How the body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// One JSON document (a response that is not streamed).
    Json,
    /// Server-sent events, each event's `data` one JSON document (or `[DONE]`).
    EventStream,
}

impl Framing {
    /// From the response's `Content-Type`: `text/event-stream` is a stream, anything else one
    /// document.
    pub fn of(content_type: Option<&[u8]>) -> Framing {
        let stream = content_type.is_some_and(|ct| {
            ct.len() >= 17 && ct[..17].eq_ignore_ascii_case(b"text/event-stream")
        });
        if stream {
            Framing::EventStream
        } else {
            Framing::Json
        }
    }
}

/// The scanning state of one response body.
#[derive(Debug)]
pub struct Scanner {
    framing: Framing,
    max: usize,
    /// Json: the body so far; EventStream: the line being received.
    buf: Vec<u8>,
    /// EventStream: the `data` of the event being received.
    data: Vec<u8>,
    /// Past `max`: Json, the body is not kept; EventStream, the rest of this event is skipped.
    over: bool,
    /// Only documents containing these bytes are parsed (a cheap test before a JSON parse).
    needle: Option<&'static [u8]>,
    /// Events or bodies skipped for size.
    skipped: u64,
    /// EventStream: the line being received has a character (other than its `\r`).
    line_has: bool,
}

impl Scanner {
    /// A scanner keeping at most `max` bytes, parsing only documents that contain `needle`.
    pub fn new(framing: Framing, max: usize, needle: Option<&'static [u8]>) -> Self {
        Scanner {
            framing,
            max,
            buf: Vec::new(),
            data: Vec::new(),
            over: false,
            needle,
            skipped: 0,
            line_has: false,
        }
    }

    /// How many bodies or events were too large to read.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Reads `bytes`, the next chunk of the body, calling `found` with each complete document.
    pub fn feed(&mut self, bytes: &[u8], found: &mut impl FnMut(&Value)) {
        match self.framing {
            Framing::Json => {
                if self.over {
                    return;
                }
                if self.buf.len() + bytes.len() > self.max {
                    self.over = true;
                    self.skipped += 1;
                    self.buf = Vec::new();
                    return;
                }
                self.buf.extend_from_slice(bytes);
            }
            Framing::EventStream => {
                let mut rest = bytes;
                while let Some(i) = rest.iter().position(|&b| b == b'\n') {
                    self.line_part(&rest[..i]);
                    self.line_end(found);
                    rest = &rest[i + 1..];
                }
                self.line_part(rest);
            }
        }
    }

    /// The body ended: a JSON body is parsed now. An event not ended by a blank line is dropped
    /// (as an event-stream parser does at the end of the stream).
    pub fn finish(&mut self, found: &mut impl FnMut(&Value)) {
        if self.framing == Framing::Json && !self.over {
            let body = std::mem::take(&mut self.buf);
            self.parse(&body, found);
        }
    }

    /// Part of a line (no newline in it).
    fn line_part(&mut self, part: &[u8]) {
        if !part.is_empty() && part != b"\r" {
            self.line_has = true;
        }
        if self.over {
            return;
        }
        if self.buf.len() + part.len() + self.data.len() > self.max {
            self.over = true;
            self.skipped += 1;
            self.buf.clear();
            self.data.clear();
            return;
        }
        self.buf.extend_from_slice(part);
    }

    /// A line ended: a field of the event, or the blank line that dispatches it.
    fn line_end(&mut self, found: &mut impl FnMut(&Value)) {
        let mut line = std::mem::take(&mut self.buf);
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if !std::mem::take(&mut self.line_has) {
            if !self.over && !self.data.is_empty() {
                let data = std::mem::take(&mut self.data);
                self.parse(&data, found);
                self.data = data;
            }
            self.data.clear();
            self.over = false;
        } else if !self.over {
            if let Some(value) = line.strip_prefix(b"data") {
                // `data:value`, one optional space after the colon; `data` alone is empty.
                let value = match value {
                    [b':', b' ', v @ ..] | [b':', v @ ..] => Some(v),
                    [] => Some(&[][..]),
                    _ => None,
                };
                if let Some(v) = value {
                    if !self.data.is_empty() {
                        self.data.push(b'\n');
                    }
                    self.data.extend_from_slice(v);
                }
            }
        }
        line.clear();
        self.buf = line;
    }

    fn parse(&self, doc: &[u8], found: &mut impl FnMut(&Value)) {
        if let Some(needle) = self.needle {
            if !doc.windows(needle.len()).any(|w| w == needle) {
                return;
            }
        }
        if let Ok(value) = serde_json::from_slice::<Value>(doc) {
            found(&value);
        }
    }
}
