//! The refusal a route answers when a policy limits a request (`limited_response`): a status, a
//! body template and its content type, compiled once at config load. The default is the
//! gateway's JSON 429.
//!
//! A template is text with the placeholders `{retry_after}` (seconds, as in `Retry-After`),
//! `{policy}` (the governing policy), `{route}` and `{request_id}` (the request's id, empty when
//! ids are off). Any other braces are text, so a JSON body can be written as it is; a `{word}`
//! made only of lower-case letters and `_` that is not one of the four is a config error, since it
//! is almost certainly a misspelt placeholder.

use std::fmt::Write as _;

use http::{HeaderValue, StatusCode};

/// One piece of a compiled template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(Box<str>),
    RetryAfter,
    Policy,
    Route,
    RequestId,
}

/// A compiled body template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pieces: Vec<Piece>,
    /// The text's length, to size the rendered body at once.
    text_len: usize,
}

impl Template {
    pub fn compile(text: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut text_len = 0;
        let mut literal = String::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            let after = &rest[open + 1..];
            let word = after.find('}').map(|close| &after[..close]).filter(|w| {
                !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
            });
            let piece = match word {
                Some("retry_after") => Piece::RetryAfter,
                Some("policy") => Piece::Policy,
                Some("route") => Piece::Route,
                Some("request_id") => Piece::RequestId,
                Some(other) => {
                    return Err(format!(
                        "`{{{other}}}` is not a placeholder; use {{retry_after}}, {{policy}}, \
                         {{route}} or {{request_id}}"
                    ))
                }
                None => {
                    literal.push_str(&rest[..=open]);
                    rest = after;
                    continue;
                }
            };
            literal.push_str(&rest[..open]);
            if !literal.is_empty() {
                text_len += literal.len();
                pieces.push(Piece::Text(std::mem::take(&mut literal).into_boxed_str()));
            }
            pieces.push(piece);
            rest = &after[word.map_or(0, str::len) + 1..];
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            text_len += literal.len();
            pieces.push(Piece::Text(literal.into_boxed_str()));
        }
        Ok(Template { pieces, text_len })
    }

    pub fn render(&self, retry_after: u64, policy: &str, route: &str) -> String {
        self.render_for(retry_after, policy, route, "")
    }

    /// [`Template::render`] for the request named `request_id`.
    pub fn render_for(
        &self,
        retry_after: u64,
        policy: &str,
        route: &str,
        request_id: &str,
    ) -> String {
        let mut out = String::with_capacity(
            self.text_len + policy.len() + route.len() + request_id.len() + 20,
        );
        for piece in &self.pieces {
            match piece {
                Piece::Text(text) => out.push_str(text),
                Piece::RetryAfter => {
                    let _ = write!(out, "{retry_after}");
                }
                Piece::Policy => out.push_str(policy),
                Piece::Route => out.push_str(route),
                Piece::RequestId => out.push_str(request_id),
            }
        }
        out
    }
}

/// A route's refusal for a rate-limited request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitedResponse {
    pub status: StatusCode,
    /// `None`: the gateway's JSON body (`{"error": "rate_limited", ...}`).
    pub body: Option<(Template, HeaderValue)>,
}

impl Default for LimitedResponse {
    fn default() -> Self {
        LimitedResponse {
            status: StatusCode::TOO_MANY_REQUESTS,
            body: None,
        }
    }
}

/// Why a `limited_response` does not compile: the sub-field (`status`, `body`, `content_type`)
/// and the message.
pub type FieldProblem = (&'static str, String);

impl LimitedResponse {
    /// `status` must be a 4xx or 5xx: a refusal that a client (or a proxy) took for success
    /// would let the limited request look served. `content_type` needs a `body`.
    pub fn compile(
        status: Option<u16>,
        body: Option<&str>,
        content_type: Option<&str>,
    ) -> Result<Self, Vec<FieldProblem>> {
        let mut problems = Vec::new();
        let status = match status.map(StatusCode::from_u16) {
            None => Some(StatusCode::TOO_MANY_REQUESTS),
            Some(Ok(s)) if s.is_client_error() || s.is_server_error() => Some(s),
            Some(_) => {
                problems.push((
                    "status",
                    format!(
                        "`{}` is not a refusal: use a 4xx or 5xx status (default 429)",
                        status.unwrap_or_default()
                    ),
                ));
                None
            }
        };
        let body = match (body, content_type) {
            (None, None) => None,
            (None, Some(_)) => {
                problems.push((
                    "content_type",
                    "needs a `body` (without one the body is the gateway's JSON)".to_string(),
                ));
                None
            }
            (Some(body), content_type) => {
                let template = Template::compile(body).map_err(|m| problems.push(("body", m)));
                let content_type =
                    HeaderValue::from_str(content_type.unwrap_or("text/plain; charset=utf-8"))
                        .map_err(|_| {
                            problems.push(("content_type", "not a valid header value".to_string()))
                        });
                template.ok().zip(content_type.ok())
            }
        };
        match status {
            Some(status) if problems.is_empty() => Ok(LimitedResponse { status, body }),
            _ => Err(problems),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_substituted_and_other_braces_kept() {
        let t = Template::compile(
            r#"{"error":"slow down","wait":{retry_after},"policy":"{policy}","at":"{route}"} {} {A}"#,
        )
        .unwrap();
        assert_eq!(
            t.render(7, "per_user", "api"),
            r#"{"error":"slow down","wait":7,"policy":"per_user","at":"api"} {} {A}"#
        );
        assert_eq!(Template::compile("").unwrap().render(1, "p", "r"), "");
        assert_eq!(
            Template::compile("id={request_id}")
                .unwrap()
                .render_for(1, "p", "r", "0190-ab"),
            "id=0190-ab"
        );
        assert_eq!(
            Template::compile("{retry_after}{retry_after}")
                .unwrap()
                .render(12, "p", "r"),
            "1212"
        );
        assert_eq!(Template::compile("a{").unwrap().render(1, "p", "r"), "a{");
    }

    #[test]
    fn a_misspelt_placeholder_is_an_error() {
        let err = Template::compile("wait {retry_afer}s").unwrap_err();
        assert!(err.contains("`{retry_afer}` is not a placeholder"), "{err}");
    }

    #[test]
    fn status_must_refuse_and_content_type_needs_a_body() {
        for ok in [400, 429, 503, 599] {
            assert!(
                LimitedResponse::compile(Some(ok), None, None).is_ok(),
                "{ok}"
            );
        }
        for bad in [200, 302, 100, 1000] {
            let problems = LimitedResponse::compile(Some(bad), None, None).unwrap_err();
            assert_eq!(problems[0].0, "status", "{bad}");
        }
        let problems = LimitedResponse::compile(None, None, Some("text/html")).unwrap_err();
        assert_eq!(problems[0].0, "content_type");
        let r = LimitedResponse::compile(None, Some("x"), None).unwrap();
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.body.unwrap().1, "text/plain; charset=utf-8");
    }
}
