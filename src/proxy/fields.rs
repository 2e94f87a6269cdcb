//! An upstream response's end-to-end fields, kept as the upstream sent them.
//!
//! Why: making each field a `HeaderName` and a `HeaderValue` in a `HeaderMap`, only for the lean
//! HTTP/1.1 writer (`crate::listener::h1`) to turn them back into bytes, cost about 3k
//! instructions a request, a tenth of the proxy's work (`docs/benchmarks.md`, "seventh pass").
//! A lean upstream exchange ([`super::h1`]) therefore leaves its fields here, in its body, and the
//! response's `HeaderMap` holds only what the gateway sets itself (its rate-limit fields). The lean
//! writer copies the lines as they came; everything else that reads the fields (hyper's server,
//! for HTTP/2, TLS and handed-over connections; response-cost charging) first moves them into the
//! map with [`materialize`]. The gateway's own fields on such a response (its rate-limit fields)
//! are kept beside them, unformatted ([`FieldSink`]). Either way, a name the gateway set replaces
//! the upstream's, as `HeaderMap::insert` did when both were in one map.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response};

use super::body::ResponseBody;
use crate::rate_limit_headers::FieldSink;

/// The fields of one response head, in order. Hop-by-hop fields were left out when the head was
/// parsed. `httparse` admitted each name as a token and each value as HTAB, SP, VCHAR or obs-text,
/// exactly what `HeaderName` and `HeaderValue` accept, so none fails to become a map entry.
#[derive(Debug, Default)]
pub struct RawFields {
    head: Bytes,
    /// Per field: where its name starts and ends, where its value starts and ends, in `head`.
    /// On the heap, not inline: this travels in the response body, which is moved (copied)
    /// several times on its way to the writer, and a few hundred inline bytes cost more in
    /// copies than one allocation does.
    spans: Vec<[u32; 4]>,
    /// The fields the gateway set on this response, in order; each replaces the upstream's of
    /// the same name. Numbers stay numbers until written: no `HeaderValue` is made for them.
    own: Vec<(HeaderName, OwnValue)>,
    /// Bit `n` set: a name in `own` is `n` bytes long (63 for any longer). Most upstream fields
    /// are ruled out by this one test, before any name is compared.
    own_lengths: u64,
}

/// A value the gateway set.
#[derive(Debug)]
pub enum OwnValue {
    Number(u64),
    Value(HeaderValue),
}

impl RawFields {
    /// `head` and, per field to keep, where its name and value start and end in it. A head is
    /// at most [`super::h1::MAX_HEAD`] and one read, far below `u32::MAX`.
    pub(crate) fn new(head: Bytes, spans: Vec<[u32; 4]>) -> Self {
        RawFields {
            head,
            spans,
            own: Vec::new(),
            own_lengths: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty() && self.own.is_empty()
    }

    /// Whether the gateway set a field named `name` (any case).
    pub fn owns(&self, name: &[u8]) -> bool {
        if self.own_lengths & length_bit(name.len()) == 0 {
            return false;
        }
        self.own.iter().any(|(own, _)| {
            let own = own.as_str().as_bytes();
            own.len() == name.len() && own.eq_ignore_ascii_case(name)
        })
    }

    /// The gateway's own fields, in the order it set them.
    pub fn own(&self) -> &[(HeaderName, OwnValue)] {
        &self.own
    }

    /// Each field as `(name, value, line)`: the name in the upstream's case, the value without
    /// its surrounding whitespace, and the whole `Name: value` line as it came, without CRLF.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8], &[u8])> + '_ {
        self.spans.iter().map(|&[ns, ne, vs, ve]| {
            let (ns, ne, vs, ve) = (ns as usize, ne as usize, vs as usize, ve as usize);
            (&self.head[ns..ne], &self.head[vs..ve], &self.head[ns..ve])
        })
    }

    /// Adds these fields to `headers` ahead of what it holds: the upstream's, less every name
    /// the gateway set (here or in `headers`), then the gateway's own.
    pub fn merge_into(self, headers: &mut HeaderMap) {
        let set = std::mem::take(headers);
        let mut merged = HeaderMap::with_capacity(self.spans.len() + self.own.len() + set.len());
        for &[ns, ne, vs, ve] in &self.spans {
            let name = &self.head[ns as usize..ne as usize];
            if has_name(&set, name) || self.owns(name) {
                continue;
            }
            let value = self.head.slice(vs as usize..ve as usize);
            match (
                HeaderName::from_bytes(name),
                HeaderValue::from_maybe_shared(value),
            ) {
                (Ok(name), Ok(value)) => {
                    merged.append(name, value);
                }
                // Unreachable after httparse (see the type's docs); dropped rather than trusted.
                _ => tracing::debug!("dropping an upstream field http refuses"),
            }
        }
        for (name, value) in self.own {
            let value = match value {
                OwnValue::Number(n) => crate::rate_limit_headers::number_value(n),
                OwnValue::Value(value) => value,
            };
            merged.insert(name, value);
        }
        merged.extend(set);
        *headers = merged;
    }
}

impl FieldSink for RawFields {
    fn set(&mut self, name: &HeaderName, value: HeaderValue) {
        self.set_own(name, OwnValue::Value(value));
    }

    fn set_number(&mut self, name: &HeaderName, n: u64) {
        self.set_own(name, OwnValue::Number(n));
    }
}

impl RawFields {
    fn set_own(&mut self, name: &HeaderName, value: OwnValue) {
        match self.own.iter_mut().find(|(own, _)| own == name) {
            Some((_, old)) => *old = value,
            None => {
                if self.own.is_empty() {
                    // The x-ratelimit dialect's three (or the IETF draft's two) and the request
                    // id: one allocation.
                    self.own.reserve_exact(4);
                }
                self.own_lengths |= length_bit(name.as_str().len());
                self.own.push((name.clone(), value));
            }
        }
    }
}

/// A name's length as a bit of [`RawFields::own_lengths`].
fn length_bit(len: usize) -> u64 {
    1 << len.min(63)
}

/// Whether `headers` has a field named `name` (any case). A linear look: the gateway sets a
/// handful of fields, and this costs no hashing or name parsing.
pub fn has_name(headers: &HeaderMap, name: &[u8]) -> bool {
    !headers.is_empty()
        && headers
            .keys()
            .any(|key| key.as_str().as_bytes().eq_ignore_ascii_case(name))
}

/// Moves the raw fields of a lean upstream response, if any, into its `HeaderMap`. Called
/// before anything other than the lean writer reads the response's fields.
pub fn materialize(response: &mut Response<ResponseBody>) {
    if let Some(fields) = response.body_mut().take_upstream_fields() {
        fields.merge_into(response.headers_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(head: &'static [u8]) -> RawFields {
        // Spans of every `name: value` line after the status line.
        let mut spans = Vec::new();
        let mut at = head.iter().position(|&b| b == b'\n').map_or(0, |i| i + 1);
        while let Some(len) = head[at..].iter().position(|&b| b == b'\n') {
            let line = &head[at..at + len - 1];
            if line.is_empty() {
                break;
            }
            let colon = line.iter().position(|&b| b == b':').unwrap_or(0);
            let value = line[colon + 1..].trim_ascii();
            let vs = at + colon + 1 + line[colon + 1..].iter().take_while(|b| **b == b' ').count();
            spans.push([at, at + colon, vs, vs + value.len()].map(|n| n as u32));
            at += len + 1;
        }
        RawFields::new(Bytes::from_static(head), spans)
    }

    #[test]
    fn merging_keeps_order_repeats_and_the_gateways_own_fields() {
        let raw = fields(
            b"HTTP/1.1 200 OK\r\nServer: up\r\nSet-Cookie: a=1\r\nX-RateLimit-Limit: 9\r\n\
              Set-Cookie: b=2\r\n\r\n",
        );
        let lines: Vec<_> = raw.iter().map(|(_, _, line)| line.to_vec()).collect();
        assert_eq!(lines[1], b"Set-Cookie: a=1");
        let mut headers = HeaderMap::new();
        headers.insert("x-ratelimit-limit", HeaderValue::from_static("5"));
        raw.merge_into(&mut headers);
        let got: Vec<_> = headers
            .iter()
            .map(|(n, v)| format!("{n}={}", v.to_str().unwrap_or("?")))
            .collect();
        assert_eq!(
            got,
            [
                "server=up",
                "set-cookie=a=1",
                "set-cookie=b=2",
                "x-ratelimit-limit=5"
            ]
        );
    }

    #[test]
    fn owns_matches_any_case_and_only_the_names_set() {
        let mut raw = fields(b"HTTP/1.1 200 OK\r\nServer: up\r\n\r\n");
        assert!(!raw.owns(b"x-request-id"));
        let long = HeaderName::from_bytes(&[b'x'; 70]).unwrap();
        raw.set(
            &HeaderName::from_static("x-request-id"),
            HeaderValue::from_static("a"),
        );
        raw.set_number(&long, 1);
        assert!(raw.owns(b"X-Request-ID"));
        // Same length, another name; a length no name has; a long name, and another as long.
        assert!(!raw.owns(b"content-type"));
        assert!(!raw.owns(b"server"));
        assert!(raw.owns(&[b'X'; 70]));
        assert!(!raw.owns(&[b'y'; 70]));
        assert!(!raw.owns(&[b'x'; 64]));
    }

    #[test]
    fn materialize_without_raw_fields_leaves_the_map_alone() {
        let mut response = Response::new(ResponseBody::empty());
        response
            .headers_mut()
            .insert("content-type", HeaderValue::from_static("text/plain"));
        materialize(&mut response);
        assert_eq!(response.headers().len(), 1);
    }
}
