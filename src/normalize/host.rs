//! One canonical authority per request, used for routing, keys and the forwarded `Host`.
//!
//! - An absolute-form request target's authority wins over `Host` (RFC 9112 §3.2.2).
//! - In HTTP/2, `:authority` and a `host` field that disagree are an error (RFC 9113 §8.3.1).
//! - Two `Host` fields are an error, and so is none in HTTP/1.1 (RFC 9112 §3.2); HTTP/1.0 may
//!   omit it.
//! - Hosts are compared case-insensitively (RFC 3986 §3.2.2), a fully qualified `a.example.`
//!   names `a.example`, and `:80` is the default port of `http` (RFC 9110 §4.2.1): all are
//!   removed from the canonical form.

use std::borrow::Cow;

use http::header::HOST;
use http::{HeaderMap, Uri, Version};

/// Why a request's authority is refused with 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error("more than one Host header (RFC 9112 §3.2)")]
    Duplicate,
    #[error("an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)")]
    Missing,
    #[error("the host header disagrees with :authority (RFC 9113 §8.3.1)")]
    Conflict,
    #[error("the host is not a valid host[:port]")]
    Invalid,
}

/// Where the canonical authority came from; it must be written to `Host` unless it is already
/// the `Host` header's own text.
#[derive(Debug, PartialEq, Eq)]
pub enum Authority<'a> {
    /// The request carries no host at all (HTTP/1.0).
    None,
    /// The `Host` header, already canonical.
    HostHeader(&'a str),
    /// A canonical form that differs from the `Host` header (or there is none).
    Rewrite(Cow<'a, str>),
}

/// The request's canonical authority.
pub fn request_authority<'a>(
    uri: &'a Uri,
    headers: &'a HeaderMap,
    version: Version,
) -> Result<Authority<'a>, HostError> {
    let mut fields = headers.get_all(HOST).iter();
    let header = fields.next();
    if fields.next().is_some() {
        return Err(HostError::Duplicate);
    }
    let header = match header {
        Some(value) => Some(value.to_str().map_err(|_| HostError::Invalid)?),
        None => None,
    };
    if let Some(target) = uri.authority() {
        let canonical = canonical_host(target.as_str())?.ok_or(HostError::Invalid)?;
        if version >= Version::HTTP_2 {
            if let Some(header) = header {
                if canonical_host(header)?.as_deref() != Some(&*canonical) {
                    return Err(HostError::Conflict);
                }
            }
        }
        return Ok(match header {
            Some(h) if h == canonical => Authority::HostHeader(h),
            _ => Authority::Rewrite(canonical),
        });
    }
    Ok(match header.map(canonical_host).transpose()?.flatten() {
        None if header.is_none() && version == Version::HTTP_11 => return Err(HostError::Missing),
        None => Authority::None,
        Some(Cow::Borrowed(h)) => Authority::HostHeader(h),
        Some(owned) => Authority::Rewrite(owned),
    })
}

/// `host[:port]` lower-cased, without a trailing dot or the default port; `None` when empty.
/// Borrowed when already canonical.
pub fn canonical_host(raw: &str) -> Result<Option<Cow<'_, str>>, HostError> {
    if raw.is_empty() {
        return Ok(None);
    }
    let (host, port) = split_port(raw)?;
    let bracketed = host.starts_with('[');
    let valid = if bracketed {
        host.len() > 2
            && host[1..host.len() - 1]
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
    } else {
        !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    };
    if !valid {
        return Err(HostError::Invalid);
    }
    let name = match host.strip_suffix('.') {
        Some(stripped) if !bracketed && !stripped.is_empty() => stripped,
        _ => host,
    };
    let port = match port {
        None => None,
        Some(p) => {
            // Digits only (`split_port`), at least one: `u16`'s range is all that is left to
            // check, in the same loop that reads them.
            let n = p
                .bytes()
                .try_fold(0u32, |n, d| {
                    let n = n * 10 + u32::from(d - b'0');
                    (n <= u32::from(u16::MAX)).then_some(n)
                })
                .ok_or(HostError::Invalid)? as u16;
            (n != 80).then_some((n, p))
        }
    };
    let port_canonical = port.is_none_or(|(_, text)| !(text.len() > 1 && text.starts_with('0')));
    let same = name.len() == host.len()
        && port_canonical
        && port.is_some() == raw[host.len()..].starts_with(':')
        && !name.bytes().any(|b| b.is_ascii_uppercase());
    if same {
        return Ok(Some(Cow::Borrowed(raw)));
    }
    let mut out = name.to_ascii_lowercase();
    if let Some((n, _)) = port {
        out.push(':');
        out.push_str(&n.to_string());
    }
    Ok(Some(Cow::Owned(out)))
}

/// Splits `host:port`, `[v6]:port`, `host` and `[v6]`; the port is digits, possibly empty.
fn split_port(raw: &str) -> Result<(&str, Option<&str>), HostError> {
    let (host, rest) = if raw.starts_with('[') {
        let end = raw.find(']').ok_or(HostError::Invalid)?;
        raw.split_at(end + 1)
    } else {
        // A byte search: `str::find` sets up a pattern searcher, dearer than a host's length.
        match raw.bytes().position(|b| b == b':') {
            Some(colon) => raw.split_at(colon),
            None => (raw, ""),
        }
    };
    match rest.strip_prefix(':') {
        None if rest.is_empty() => Ok((host, None)),
        None => Err(HostError::Invalid),
        Some("") => Ok((host, None)),
        Some(port) if port.bytes().all(|b| b.is_ascii_digit()) => Ok((host, Some(port))),
        Some(_) => Err(HostError::Invalid),
    }
}

/// The canonical host after [`super::canonicalize`] (which writes it to `Host`).
pub fn host(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| !h.is_empty())
}
