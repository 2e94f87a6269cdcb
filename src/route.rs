//! Which route a request belongs to. Patterns are compiled once at config load into segments, and
//! matching is a pure function of the request head: no allocation, path parameters are returned as
//! byte ranges into the request's own path.
//!
//! The head is the canonical request ([`crate::normalize`]): its path is normalised and its host
//! is lower-case, so a prefix cannot be escaped with `..` and a host cannot be re-spelt. A `path`
//! pattern matches with or without one trailing slash, with the same parameters.

use http::{HeaderMap, HeaderName, HeaderValue, Method};

/// The most `{param}`s one path pattern may have.
pub const MAX_PARAMS: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(Box<str>),
    Param,
    CatchAll,
}

/// How a route selects requests. All given conditions must hold.
#[derive(Debug, Clone, Default)]
pub struct RouteMatch {
    path: PathMatch,
    methods: Option<Vec<Method>>,
    /// Lowercase, without port.
    host: Option<Box<str>>,
    headers: Vec<(HeaderName, HeaderValue)>,
}

#[derive(Debug, Clone, Default)]
enum PathMatch {
    #[default]
    Any,
    Prefix(Box<str>),
    Pattern(Vec<Segment>),
}

/// The path parameters of a matched request, as byte ranges into its path.
#[derive(Debug, Clone, Copy, Default)]
pub struct PathParams {
    ranges: [(u32, u32); MAX_PARAMS],
    len: u8,
}

impl PathParams {
    fn push(&mut self, start: usize, end: usize) {
        if (self.len as usize) < MAX_PARAMS {
            self.ranges[self.len as usize] = (start as u32, end as u32);
            self.len += 1;
        }
    }

    /// The value of the `index`-th parameter of the pattern, sliced from `path`.
    pub fn get<'p>(&self, path: &'p str, index: usize) -> Option<&'p str> {
        if index >= self.len as usize {
            return None;
        }
        let (start, end) = self.ranges[index];
        path.get(start as usize..end as usize)
    }
}

/// The parts of a request head that routing looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    pub method: &'a Method,
    pub host: Option<&'a str>,
    pub path: &'a str,
    pub headers: &'a HeaderMap,
}

impl RouteMatch {
    /// The names of the request fields this match compares.
    pub fn header_names(&self) -> impl Iterator<Item = &HeaderName> {
        self.headers.iter().map(|(name, _)| name)
    }

    /// Compiles a `path` pattern (`/users/{id}`, `/files/{*rest}`). Returns the parameter names
    /// in order, for key parts to refer to by index.
    pub fn with_pattern(pattern: &str) -> Result<(Self, Vec<String>), String> {
        let Some(body) = pattern.strip_prefix('/') else {
            return Err(format!("`{pattern}` must start with `/`"));
        };
        // `/a/` and `/a` are one pattern: requests are matched without their trailing slash.
        let body = body.strip_suffix('/').unwrap_or(body);
        let mut segments = Vec::new();
        let mut names: Vec<String> = Vec::new();
        let parts: Vec<&str> = body.split('/').collect();
        for (i, part) in parts.iter().enumerate() {
            let segment = if let Some(inner) =
                part.strip_prefix('{').and_then(|p| p.strip_suffix('}'))
            {
                let (name, segment) = match inner.strip_prefix('*') {
                    Some(name) if i + 1 == parts.len() => (name, Segment::CatchAll),
                    Some(_) => {
                        return Err(format!("`{pattern}`: `{{*name}}` must be the last segment"))
                    }
                    None => (inner, Segment::Param),
                };
                if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(format!(
                        "`{pattern}`: parameter names are letters, digits and `_`"
                    ));
                }
                if names.iter().any(|n| n == name) {
                    return Err(format!("`{pattern}`: parameter `{name}` appears twice"));
                }
                names.push(name.to_string());
                segment
            } else if part.contains(['{', '}']) {
                return Err(format!(
                    "`{pattern}`: a segment is either literal or one whole `{{name}}`"
                ));
            } else {
                Segment::Literal((*part).into())
            };
            segments.push(segment);
        }
        if names.len() > MAX_PARAMS {
            return Err(format!("`{pattern}` has more than {MAX_PARAMS} parameters"));
        }
        let matcher = RouteMatch {
            path: PathMatch::Pattern(segments),
            ..RouteMatch::default()
        };
        Ok((matcher, names))
    }

    pub fn with_prefix(prefix: &str) -> Result<Self, String> {
        if !prefix.starts_with('/') {
            return Err(format!("`{prefix}` must start with `/`"));
        }
        Ok(RouteMatch {
            path: PathMatch::Prefix(prefix.into()),
            ..RouteMatch::default()
        })
    }

    pub fn set_methods(&mut self, methods: Vec<Method>) {
        self.methods = Some(methods);
    }

    /// The host as requests spell it canonically: lower-case, without a trailing dot.
    pub fn set_host(&mut self, host: &str) {
        let host = host.strip_suffix('.').unwrap_or(host);
        self.host = Some(host.to_ascii_lowercase().into());
    }

    pub fn add_header(&mut self, name: HeaderName, value: HeaderValue) {
        self.headers.push((name, value));
    }

    /// The path parameters when `head` matches, `None` otherwise.
    pub fn matches(&self, head: &RequestHead<'_>) -> Option<PathParams> {
        if let Some(methods) = &self.methods {
            if !methods.contains(head.method) {
                return None;
            }
        }
        self.matches_except_method(head)
    }

    /// The methods this route is limited to (`None`: every method).
    pub fn methods(&self) -> Option<&[Method]> {
        self.methods.as_deref()
    }

    /// Whether `head` matches every condition but the method: a 405 rather than a 404 when no
    /// route takes its method (RFC 9110 §15.5.6).
    pub fn matches_except_method(&self, head: &RequestHead<'_>) -> Option<PathParams> {
        if let Some(want) = &self.host {
            let host = head.host?;
            let host = host.rsplit_once(':').map_or(host, |(h, port)| {
                if port.bytes().all(|b| b.is_ascii_digit()) {
                    h
                } else {
                    host
                }
            });
            if !host.eq_ignore_ascii_case(want) {
                return None;
            }
        }
        for (name, value) in &self.headers {
            if !head.headers.get_all(name).iter().any(|v| v == value) {
                return None;
            }
        }
        let mut params = PathParams::default();
        let ok = match &self.path {
            PathMatch::Any => true,
            PathMatch::Prefix(prefix) => head.path.starts_with(&**prefix),
            PathMatch::Pattern(segments) => {
                let path = match head.path.strip_suffix('/') {
                    Some(trimmed) if !trimmed.is_empty() => trimmed,
                    _ => head.path,
                };
                match_segments(segments, path, &mut params)
            }
        };
        ok.then_some(params)
    }
}

fn match_segments(segments: &[Segment], path: &str, params: &mut PathParams) -> bool {
    let Some(mut rest) = path.strip_prefix('/') else {
        return false;
    };
    let mut offset = 1;
    for (i, segment) in segments.iter().enumerate() {
        if *segment == Segment::CatchAll {
            params.push(offset, path.len());
            return true;
        }
        let (part, next) = match rest.find('/') {
            Some(slash) => (&rest[..slash], Some(&rest[slash + 1..])),
            None => (rest, None),
        };
        match segment {
            Segment::Literal(literal) if **literal == *part => {}
            Segment::Param if !part.is_empty() => params.push(offset, offset + part.len()),
            _ => return false,
        }
        let last = i + 1 == segments.len();
        match (next, last) {
            (None, true) => return true,
            (Some(next), false) => {
                offset += part.len() + 1;
                rest = next;
            }
            // A trailing `{*rest}` also matches when nothing follows the last slash-less segment.
            (None, false) => {
                return segments[i + 1] == Segment::CatchAll && i + 2 == segments.len() && {
                    params.push(path.len(), path.len());
                    true
                }
            }
            (Some(_), true) => return false,
        }
    }
    false
}

#[cfg(test)]
#[path = "route_tests.rs"]
mod tests;
