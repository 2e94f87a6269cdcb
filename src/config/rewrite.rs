//! The path a route forwards: `strip_prefix: /api` or `rewrite: /v2/{*rest}`.
//!
//! Both are compiled at config load against the route's `match`, so a template that names a
//! capture the route does not have, or a prefix the route's paths do not all start with, is a
//! config error, never a surprise at request time. They act on the canonical path
//! ([`crate::normalize`]) after the decision: rate-limit keys still see the request's own path, and
//! the query string is kept as sent (RFC 3986 §3.4). Capture values are slices of the canonical
//! path, still percent-encoded, so substituting them cannot introduce a `?`, a `#` or a dot
//! segment that was not already escaped.

use http::uri::PathAndQuery;
use http::Uri;

use crate::route::PathParams;

/// A compiled `strip_prefix` or `rewrite`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathRewrite {
    /// Removes this prefix (without a trailing slash); what is left keeps its leading `/`.
    StripPrefix(Box<str>),
    /// Literal text and captures, in order.
    Template(Vec<Piece>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Literal(Box<str>),
    /// The index of a capture of the route's `match.path`.
    Capture(usize),
}

/// What a route's `match` offers a rewrite: the literal start every matching path has, and the
/// capture names in order.
#[derive(Debug, Clone, Copy)]
pub struct RouteShape<'a> {
    /// `match.prefix`, or `match.path` up to its first capture; `None` when the route matches any
    /// path.
    pub literal_start: Option<&'a str>,
    /// `true` when `literal_start` is a `match.path` pattern (whose literal segments end at `/`).
    pub pattern: bool,
    pub captures: &'a [String],
}

impl PathRewrite {
    /// `strip_prefix`: it must start with `/` and be a prefix of every path the route matches,
    /// ending at a segment boundary of a `match.path` pattern.
    pub fn strip_prefix(prefix: &str, shape: RouteShape<'_>) -> Result<Self, String> {
        if !prefix.starts_with('/') {
            return Err(format!("`{prefix}` must start with `/`"));
        }
        let Some(start) = shape.literal_start else {
            return Err(
                "needs `match.path` or `match.prefix` that starts with it: a route matching every \
                 path has no prefix to strip"
                    .to_string(),
            );
        };
        let trimmed = match prefix.strip_suffix('/') {
            Some(t) if !t.is_empty() => t,
            _ => prefix,
        };
        let boundary = start
            .strip_prefix(trimmed)
            .is_some_and(|rest| !shape.pattern || rest.is_empty() || rest.starts_with('/'));
        if !boundary {
            let what = if shape.pattern {
                "a whole-segment prefix of the route's `match.path`"
            } else {
                "a prefix of the route's `match.prefix`"
            };
            return Err(format!("`{prefix}` must be {what} (`{start}`)"));
        }
        Ok(PathRewrite::StripPrefix(trimmed.into()))
    }

    /// `rewrite`: a path starting with `/` in which `{name}` (or `{*name}`) stands for the route's
    /// capture `name`.
    pub fn template(template: &str, shape: RouteShape<'_>) -> Result<Self, String> {
        if !template.starts_with('/') {
            return Err(format!("`{template}` must start with `/`"));
        }
        let mut pieces = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(Piece::Literal(literal(template, &rest[..open])?.into()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(format!("`{template}`: `{{` without its `}}`"));
            };
            let inner = &rest[open + 1..open + close];
            let name = inner.strip_prefix('*').unwrap_or(inner);
            match shape.captures.iter().position(|c| c == name) {
                Some(index) => pieces.push(Piece::Capture(index)),
                None if shape.captures.is_empty() => {
                    return Err(format!(
                        "`{template}` uses `{{{inner}}}`, but the route's `match` has no captures \
                         (name them in `match.path`, e.g. `/users/{{id}}`)"
                    ))
                }
                None => {
                    return Err(format!(
                        "`{template}` uses `{{{inner}}}`, which the route's `match.path` does not \
                         capture (it captures: {})",
                        shape.captures.join(", ")
                    ))
                }
            }
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Literal(literal(template, rest)?.into()));
        }
        Ok(PathRewrite::Template(pieces))
    }

    /// The new request target: the rewritten path and the original query. `None` when the result
    /// is not a valid request target (it cannot be, given the checks at load, but a request path
    /// is never trusted to panic).
    pub fn apply(&self, uri: &Uri, params: &PathParams) -> Option<Uri> {
        let path = uri.path();
        let mut out = String::with_capacity(path.len() + 16);
        match self {
            PathRewrite::StripPrefix(prefix) => {
                let rest = path.strip_prefix(&**prefix).unwrap_or(path);
                if !rest.starts_with('/') {
                    out.push('/');
                }
                out.push_str(rest);
            }
            PathRewrite::Template(pieces) => {
                for piece in pieces {
                    match piece {
                        Piece::Literal(text) => out.push_str(text),
                        Piece::Capture(i) => out.push_str(params.get(path, *i).unwrap_or("")),
                    }
                }
            }
        }
        if let Some(query) = uri.query() {
            out.push('?');
            out.push_str(query);
        }
        let path_and_query = PathAndQuery::from_maybe_shared(out).ok()?;
        let mut parts = uri.clone().into_parts();
        parts.path_and_query = Some(path_and_query);
        Uri::from_parts(parts).ok()
    }
}

/// Literal template text: path characters only (RFC 3986 §3.3), no query or fragment.
fn literal<'t>(template: &str, text: &'t str) -> Result<&'t str, String> {
    if text.contains(['}', '?', '#']) || PathAndQuery::try_from(text).is_err() {
        return Err(format!(
            "`{template}`: `{text}` is not path text (a query or fragment cannot be rewritten)"
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::{RequestHead, RouteMatch};

    fn shape<'a>(start: &'a str, captures: &'a [String]) -> RouteShape<'a> {
        RouteShape {
            literal_start: Some(start),
            pattern: true,
            captures,
        }
    }

    fn rewrite(pattern: &str, template: &str, uri: &str) -> String {
        let (matcher, names) = RouteMatch::with_pattern(pattern).unwrap();
        let start = pattern.split('{').next().unwrap();
        let rw = PathRewrite::template(template, shape(start, &names)).unwrap();
        let uri: Uri = uri.parse().unwrap();
        let head = RequestHead {
            method: &http::Method::GET,
            host: None,
            path: uri.path(),
            headers: &http::HeaderMap::new(),
        };
        let params = matcher.matches(&head).unwrap();
        rw.apply(&uri, &params).unwrap().to_string()
    }

    #[test]
    fn template_uses_captures_and_keeps_the_query() {
        assert_eq!(
            rewrite("/api/{*rest}", "/v2/{*rest}", "/api/a/b?x=1&y"),
            "/v2/a/b?x=1&y"
        );
        assert_eq!(
            rewrite(
                "/users/{id}/posts/{post}",
                "/p/{post}/by/{id}",
                "/users/7/posts/9"
            ),
            "/p/9/by/7"
        );
        assert_eq!(rewrite("/api/{*rest}", "/v2/{rest}", "/api"), "/v2/");
    }

    #[test]
    fn template_naming_an_absent_capture_is_refused() {
        let names = vec!["id".to_string()];
        let err = PathRewrite::template("/v2/{*rest}", shape("/users/", &names)).unwrap_err();
        assert!(err.contains("captures: id"), "{err}");
        let err = PathRewrite::template("/v2/{id}", shape("/users", &[])).unwrap_err();
        assert!(err.contains("no captures"), "{err}");
        assert!(PathRewrite::template("v2", shape("/", &names)).is_err());
        assert!(PathRewrite::template("/v2?x=1", shape("/", &names)).is_err());
        assert!(PathRewrite::template("/v2/{id", shape("/", &names)).is_err());
    }

    #[test]
    fn strip_prefix_must_be_a_prefix_of_the_route() {
        let prefix = |p: &str, start: &str, pattern: bool| {
            PathRewrite::strip_prefix(
                p,
                RouteShape {
                    literal_start: Some(start),
                    pattern,
                    captures: &[],
                },
            )
        };
        assert_eq!(
            prefix("/api/", "/api/users/", true),
            Ok(PathRewrite::StripPrefix("/api".into()))
        );
        assert!(prefix("/ap", "/api/users/", true).is_err());
        assert!(prefix("/v1", "/api", false).is_err());
        assert!(prefix("/ap", "/api", false).is_ok());
        assert!(PathRewrite::strip_prefix(
            "/api",
            RouteShape {
                literal_start: None,
                pattern: false,
                captures: &[]
            }
        )
        .is_err());
    }

    #[test]
    fn strip_prefix_keeps_a_leading_slash_and_the_query() {
        let rw = PathRewrite::StripPrefix("/api".into());
        let apply = |u: &str| {
            rw.apply(&u.parse().unwrap(), &PathParams::default())
                .unwrap()
                .to_string()
        };
        assert_eq!(apply("/api/users?id=1"), "/users?id=1");
        assert_eq!(apply("/api"), "/");
        assert_eq!(apply("/apix"), "/x");
    }
}
