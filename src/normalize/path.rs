//! Path normalisation, done once before routing; the result is also what the upstream receives.
//!
//! Three steps, each of which an upstream such as NGINX applies on its own side, so that a route
//! cannot be skipped by spelling the same resource differently:
//! - decode percent-encoded unreserved characters and upper-case the hex digits of the other
//!   escapes (RFC 3986 §6.2.2.1, §6.2.2.2);
//! - merge repeated slashes (what NGINX's `merge_slashes on` does);
//! - remove `.` and `..` segments (RFC 3986 §5.2.4), after decoding, so `%2E%2E` is `..` too.
//!
//! Unlike §5.2.4, a `..` that would climb above the root is an error, not silently dropped.
//! Encoded slashes (`%2F`, and `%5C`, which some servers treat as `/`) are either refused or kept
//! encoded: decoding them would change the path's segments.

use std::borrow::Cow;

/// What to do with `%2F` and `%5C` in a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EscapedSlashes {
    /// 400: the upstream may decode them into a path separator the router never saw.
    Reject,
    /// Forwarded as `%2F` / `%5C` (hex upper-cased); they never split a segment here.
    Keep,
}

/// What to do with `;` path parameters (`/a;jsessionid=1/b`, `/..;/admin`): Tomcat, Jetty and
/// Spring cut a segment at its `;` before routing, so `/u/rt1;x` is their `/u/rt1` and `/a/..;/b`
/// their `/b`, while a router that keeps the `;` sees other segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathParameters {
    /// 400 for a `;` anywhere in the path, or an encoded one (`%3B`).
    Reject,
    /// Each segment is cut at its first `;` before dot segments are removed (`/a/..;x/b` is
    /// `/b`); an encoded `%3B` is still refused, since an upstream may decode it first.
    Strip,
    /// Forwarded as sent; `;` is an ordinary character of its segment.
    Keep,
}

/// The `server:` options of path normalisation. Each step may be turned off for upstreams that
/// need raw paths; the defaults are the safe ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathOptions {
    /// Decode unreserved escapes and remove dot segments.
    pub normalize_path: bool,
    /// `//` becomes `/`.
    pub merge_slashes: bool,
    pub escaped_slashes: EscapedSlashes,
    pub path_parameters: PathParameters,
}

impl Default for PathOptions {
    fn default() -> Self {
        PathOptions {
            normalize_path: true,
            merge_slashes: true,
            escaped_slashes: EscapedSlashes::Reject,
            path_parameters: PathParameters::Reject,
        }
    }
}

/// Why a path is refused with 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("invalid percent-encoding in the path (RFC 3986 §2.1)")]
    BadPercent,
    #[error("the path climbs above the root with `..`")]
    AboveRoot,
    #[error("the path contains an encoded slash (%2F or %5C)")]
    EncodedSlash,
    #[error("the path contains a `;` path parameter (or an encoded `%3B`)")]
    PathParameter,
}

/// The normalised form of an origin-form `path` (borrowed, without allocating, when it is
/// already canonical: the common case). Anything that does not start with `/` (`*`, an
/// authority-form target) is returned as it is.
pub fn normalize_path(path: &str, opts: PathOptions) -> Result<Cow<'_, str>, PathError> {
    if !path.starts_with('/') || is_canonical(path.as_bytes(), opts)? {
        return Ok(Cow::Borrowed(path));
    }
    rewrite(path, opts).map(Cow::Owned)
}

/// Whether `path` is already in normal form; validates every escape on the way, so a path it
/// accepts can be rewritten without errors other than climbing above the root.
fn is_canonical(bytes: &[u8], opts: PathOptions) -> Result<bool, PathError> {
    let mut canonical = true;
    let mut segment_start = 1;
    let mut i = 1;
    while i <= bytes.len() {
        match bytes.get(i) {
            end @ (None | Some(b'/')) => {
                let segment = &bytes[segment_start..i];
                if (opts.merge_slashes && segment.is_empty() && end.is_some())
                    || (opts.normalize_path && (segment == b"." || segment == b".."))
                {
                    canonical = false;
                }
                segment_start = i + 1;
                i += 1;
            }
            Some(b';') => {
                match opts.path_parameters {
                    PathParameters::Reject => return Err(PathError::PathParameter),
                    PathParameters::Strip => canonical = false,
                    PathParameters::Keep => {}
                }
                i += 1;
            }
            Some(b'%') => {
                let decoded = escape_at(bytes, i)?;
                if matches!(decoded, b'/' | b'\\') && opts.escaped_slashes == EscapedSlashes::Reject
                {
                    return Err(PathError::EncodedSlash);
                }
                if decoded == b';' && opts.path_parameters != PathParameters::Keep {
                    return Err(PathError::PathParameter);
                }
                if opts.normalize_path
                    && (is_unreserved(decoded)
                        || bytes[i + 1].is_ascii_lowercase()
                        || bytes[i + 2].is_ascii_lowercase())
                {
                    canonical = false;
                }
                i += 3;
            }
            Some(_) => i += 1,
        }
    }
    Ok(canonical)
}

fn rewrite(path: &str, opts: PathOptions) -> Result<String, PathError> {
    let mut out = String::with_capacity(path.len());
    let mut segments = path[1..].split('/').peekable();
    while let Some(raw) = segments.next() {
        let last = segments.peek().is_none();
        // `..;x` is `..` to the upstreams that split parameters off: cut before the dot segments.
        let raw = match opts.path_parameters {
            PathParameters::Strip => raw.split_once(';').map_or(raw, |(segment, _)| segment),
            PathParameters::Reject | PathParameters::Keep => raw,
        };
        if raw.is_empty() && !last && opts.merge_slashes {
            continue;
        }
        let mark = out.len();
        out.push('/');
        push_segment(raw, opts, &mut out)?;
        if !opts.normalize_path {
            continue;
        }
        let up = match &out[mark + 1..] {
            "." => false,
            ".." => true,
            _ => continue,
        };
        out.truncate(mark);
        if up {
            match out.rfind('/') {
                Some(parent) => out.truncate(parent),
                None => return Err(PathError::AboveRoot),
            }
        }
        // `/a/b/..` is `/a/`: the last dot segment leaves a directory.
        if last {
            out.push('/');
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// Appends one segment with its escapes normalised.
fn push_segment(raw: &str, opts: PathOptions, out: &mut String) -> Result<(), PathError> {
    let bytes = raw.as_bytes();
    let mut copied = 0;
    while let Some(offset) = bytes[copied..].iter().position(|&b| b == b'%') {
        let at = copied + offset;
        out.push_str(&raw[copied..at]);
        let decoded = escape_at(bytes, at)?;
        if matches!(decoded, b'/' | b'\\') && opts.escaped_slashes == EscapedSlashes::Reject {
            return Err(PathError::EncodedSlash);
        }
        if decoded == b';' && opts.path_parameters != PathParameters::Keep {
            return Err(PathError::PathParameter);
        }
        if !opts.normalize_path {
            out.push_str(&raw[at..at + 3]);
        } else if is_unreserved(decoded) {
            out.push(char::from(decoded));
        } else {
            push_escape(decoded, out);
        }
        copied = at + 3;
    }
    out.push_str(&raw[copied..]);
    Ok(())
}

/// `%XX` with upper-case hex (RFC 3986 §6.2.2.1).
pub(crate) fn push_escape(byte: u8, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(byte >> 4)]));
    out.push(char::from(HEX[usize::from(byte & 15)]));
}

/// The byte that the escape at `bytes[at]` (a `%`) encodes.
pub(crate) fn escape_at(bytes: &[u8], at: usize) -> Result<u8, PathError> {
    match (
        bytes.get(at + 1).and_then(|&b| hex_value(b)),
        bytes.get(at + 2).and_then(|&b| hex_value(b)),
    ) {
        (Some(high), Some(low)) => Ok(high << 4 | low),
        _ => Err(PathError::BadPercent),
    }
}

pub(crate) fn hex_value(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).map(|d| d as u8)
}

/// RFC 3986 §2.3: `ALPHA / DIGIT / "-" / "." / "_" / "~"`.
pub(crate) fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}
