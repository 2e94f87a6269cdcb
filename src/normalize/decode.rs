//! Key values in their canonical form: what a percent-encoded value means, not how it was
//! spelt, so `/users/%31` and `/users/1` are one counter (RFC 3986 §2.1: equivalent octets).
//! Header values are not URL-encoded and are used as sent.

use std::borrow::Cow;

use super::path::escape_at;

/// A path parameter's octets: every `%XX` decoded; `+` is a literal plus in a path. A malformed
/// escape (possible only when the path was not validated) is kept as written.
pub fn path_param(value: &str) -> Cow<'_, [u8]> {
    decode(value, false)
}

/// A query name or value's octets, decoded as `application/x-www-form-urlencoded` (WHATWG URL
/// standard, what upstream frameworks use): `+` is a space, then `%XX` is decoded; a `%` not
/// followed by two hex digits is kept.
pub fn query_component(value: &str) -> Cow<'_, [u8]> {
    decode(value, true)
}

fn decode(value: &str, plus_is_space: bool) -> Cow<'_, [u8]> {
    let bytes = value.as_bytes();
    if !bytes
        .iter()
        .any(|&b| b == b'%' || (plus_is_space && b == b'+'))
    {
        return Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => match escape_at(bytes, i) {
                Ok(byte) => {
                    out.push(byte);
                    i += 3;
                    continue;
                }
                Err(_) => out.push(b'%'),
            },
            b'+' if plus_is_space => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    Cow::Owned(out)
}

/// The value of query parameter `name` (compared after decoding), raw. `Err` when the query
/// carries it more than once: the limiter and the upstream could read different ones.
pub fn query_value<'q>(query: Option<&'q str>, name: &str) -> Result<Option<&'q str>, Repeated> {
    let Some(query) = query else {
        return Ok(None);
    };
    let mut found = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if *query_component(key) == *name.as_bytes() {
            if found.is_some() {
                return Err(Repeated);
            }
            found = Some(value);
        }
    }
    Ok(found)
}

/// A key parameter given more than once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeated;
