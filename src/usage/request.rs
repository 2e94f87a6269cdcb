//! The JSON request body of an LLM API call, read before admission on the routes that need it:
//! for `body:` key parts, and for the most a reserving request can cost (`docs/llm.md`,
//! "Reserve, then settle").

use crate::config::ResponseCost;
use crate::keys::JsonBody;

/// Content types whose tokens a request's bytes do not bound: an image URL of a hundred bytes
/// can cost a thousand tokens.
const OPAQUE: [&[u8]; 6] = [
    b"\"image_url\"",
    b"\"input_image\"",
    b"\"image\"",
    b"\"input_audio\"",
    b"\"file\"",
    b"\"document\"",
];

/// `bytes` as a JSON body (any JSON value); `None` when it is not JSON.
pub fn parse(bytes: &[u8]) -> Option<JsonBody> {
    let value = serde_json::from_slice(bytes).ok()?;
    let opaque = OPAQUE
        .iter()
        .any(|needle| bytes.windows(needle.len()).any(|w| w == *needle));
    Some(JsonBody {
        value,
        bytes: bytes.len() as u64,
        opaque,
    })
}

/// What admission reserves for a `reserve: true` cost: `max_cost`, or less when the body bounds
/// the request: its `max_tokens` (`max_completion_tokens`, `max_output_tokens`) at the largest
/// output weight, plus its length in bytes at the largest input weight (a text token is at
/// least one byte of the JSON that carries it). A body naming images, audio or files, or none,
/// reserves `max_cost`.
pub fn reservation(rc: &ResponseCost, body: Option<&JsonBody>) -> u64 {
    let most = rc.max_cost;
    let (Some(usage), Some(body)) = (rc.usage(), body) else {
        return most;
    };
    if body.opaque {
        return most;
    }
    let output = [
        "/max_tokens",
        "/max_completion_tokens",
        "/max_output_tokens",
    ]
    .iter()
    .find_map(|p| body.value.pointer(p).and_then(serde_json::Value::as_u64));
    let Some(output) = output else {
        return most;
    };
    let w = usage.weights;
    let bound =
        w.input.max(w.cached_input) * body.bytes as f64 + w.output.max(w.reasoning) * output as f64;
    // `as` saturates.
    let bound = if bound > 0.0 { bound.ceil() as u64 } else { 0 };
    bound.clamp(rc.min_cost.max(1), most.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::usage::{UsageCost, UsageFormat, Weights};
    use crate::config::CostSource;

    fn cost(weights: Weights) -> ResponseCost {
        ResponseCost {
            source: CostSource::Usage(UsageCost {
                format: UsageFormat::OpenAi,
                weights,
                max_body: 1 << 20,
            }),
            fallback: 1000,
            min_cost: 1,
            max_cost: 1000,
            reserve: true,
        }
    }

    #[test]
    fn the_body_bounds_the_reservation() {
        let body = br#"{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#;
        let parsed = parse(body).expect("JSON");
        let len = body.len() as u64;
        assert_eq!(
            reservation(&cost(Weights::default()), Some(&parsed)),
            len + 100
        );
        let w = Weights {
            output: 4.0,
            cached_input: 0.1,
            ..Weights::default()
        };
        assert_eq!(reservation(&cost(w), Some(&parsed)), len + 400);
        // No max_tokens, no body, an image, a bound past max_cost: max_cost.
        let open = parse(br#"{"model":"m","messages":[]}"#).expect("JSON");
        assert_eq!(reservation(&cost(w), Some(&open)), 1000);
        assert_eq!(reservation(&cost(w), None), 1000);
        let image = parse(
            br#"{"max_tokens":5,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}"#,
        )
        .expect("JSON");
        assert_eq!(reservation(&cost(w), Some(&image)), 1000);
        let big = parse(br#"{"max_tokens":100000}"#).expect("JSON");
        assert_eq!(reservation(&cost(w), Some(&big)), 1000);
        assert!(parse(b"{not json").is_none());
    }
}
