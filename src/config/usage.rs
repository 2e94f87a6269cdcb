//! Token usage as a cost (`cost: {usage: ...}`, `docs/llm.md`): which format the response body
//! reports usage in, what each kind of token weighs, and the weighted sum, as plain data.
//!
//! Reading the body is the runtime's (`crate::usage`); this is what it is configured with.

use super::raw::{RawUsage, RawWeights};

/// The most of a JSON (not streamed) response body kept to read its usage, by default.
pub const DEFAULT_MAX_BODY: usize = 1 << 20;

/// The most `max_body` may be: a body kept whole is memory per request in flight.
pub const MAX_MAX_BODY: u64 = 64 << 20;

/// A cost read from token usage in the response body.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageCost {
    pub format: UsageFormat,
    pub weights: Weights,
    /// The most of a JSON body kept to find its `usage`; a larger body reports none.
    pub max_body: usize,
}

/// Where in a body (or in each event of a stream) the counts are.
#[derive(Debug, Clone, PartialEq)]
pub enum UsageFormat {
    /// OpenAI Chat Completions (`usage.prompt_tokens`, ...) and Responses (`usage.input_tokens`,
    /// `response.completed`'s `response.usage`).
    OpenAi,
    /// Anthropic Messages (`usage`, `message_start`'s `message.usage`, `message_delta`'s
    /// `usage`), cache tokens included.
    Anthropic,
    /// JSON pointers (RFC 6901) to each count, for other APIs.
    Pointers(std::sync::Arc<UsagePointers>),
}

/// A JSON pointer to each kind of count; a kind without one counts 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsagePointers {
    pub input: Option<String>,
    pub output: Option<String>,
    pub cached_input: Option<String>,
    pub reasoning: Option<String>,
}

/// Units per token of each kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// Input tokens not read from a cache.
    pub input: f64,
    /// Output tokens that are not reasoning.
    pub output: f64,
    /// Input tokens read from the provider's prompt cache.
    pub cached_input: f64,
    /// Output tokens spent on reasoning.
    pub reasoning: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            input: 1.0,
            output: 1.0,
            cached_input: 1.0,
            reasoning: 1.0,
        }
    }
}

/// Token counts as a response reports them, in one shape for every format: `input` includes
/// `cached_input` and `output` includes `reasoning` (as OpenAI counts them; Anthropic's cache
/// reads and writes are added to its `input_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
    pub cached_input: u64,
    pub reasoning: u64,
}

impl Weights {
    /// The units `usage` costs: each kind's tokens times its weight, summed, rounded up to a
    /// whole unit (saturating at `u64::MAX`; the caller clamps to `max_cost`).
    pub fn cost(&self, usage: &Usage) -> u64 {
        let cached = usage.cached_input.min(usage.input);
        let reasoning = usage.reasoning.min(usage.output);
        let units = self.input * (usage.input - cached) as f64
            + self.cached_input * cached as f64
            + self.output * (usage.output - reasoning) as f64
            + self.reasoning * reasoning as f64;
        // `as` saturates; NaN (impossible with finite weights) would be 0.
        if units > 0.0 {
            units.ceil() as u64
        } else {
            0
        }
    }
}

/// `usage:` as a format.
pub fn format(raw: &RawUsage) -> Result<UsageFormat, String> {
    match raw {
        RawUsage::Format(name) => match name.as_str() {
            "openai" => Ok(UsageFormat::OpenAi),
            "anthropic" => Ok(UsageFormat::Anthropic),
            other => Err(format!(
                "`{other}`: give `openai`, `anthropic`, or JSON pointers \
                 {{input, output, cached_input, reasoning}}"
            )),
        },
        RawUsage::Pointers(p) => {
            let pointers = UsagePointers {
                input: p.input.clone(),
                output: p.output.clone(),
                cached_input: p.cached_input.clone(),
                reasoning: p.reasoning.clone(),
            };
            let all = [
                &pointers.input,
                &pointers.output,
                &pointers.cached_input,
                &pointers.reasoning,
            ];
            if all.iter().all(|p| p.is_none()) {
                return Err("give at least one pointer".to_string());
            }
            if let Some(bad) = all
                .iter()
                .filter_map(|p| p.as_deref())
                .find(|p| !p.starts_with('/'))
            {
                return Err(format!(
                    "`{bad}` is not a JSON pointer (RFC 6901: it starts with `/`)"
                ));
            }
            Ok(UsageFormat::Pointers(std::sync::Arc::new(pointers)))
        }
    }
}

/// `weights:`, each finite and at least 0; `cached_input` defaults to `input`'s weight and
/// `reasoning` to `output`'s.
pub fn weights(raw: Option<&RawWeights>) -> Result<Weights, String> {
    let Some(raw) = raw else {
        return Ok(Weights::default());
    };
    let input = raw.input.unwrap_or(1.0);
    let output = raw.output.unwrap_or(1.0);
    let w = Weights {
        input,
        output,
        cached_input: raw.cached_input.unwrap_or(input),
        reasoning: raw.reasoning.unwrap_or(output),
    };
    let all = [
        ("input", w.input),
        ("output", w.output),
        ("cached_input", w.cached_input),
        ("reasoning", w.reasoning),
    ];
    if let Some((name, value)) = all.iter().find(|(_, v)| !v.is_finite() || *v < 0.0) {
        return Err(format!("{name}: `{value}` must be a number at least 0"));
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_cost_each_kind_once_and_round_up() {
        let w = Weights {
            input: 1.0,
            output: 4.0,
            cached_input: 0.25,
            reasoning: 8.0,
        };
        let usage = Usage {
            input: 100,
            output: 10,
            cached_input: 40,
            reasoning: 3,
        };
        // 60 uncached + 40 * 0.25 + 7 * 4 + 3 * 8
        assert_eq!(w.cost(&usage), 60 + 10 + 28 + 24);
        let odd = Usage {
            input: 1,
            cached_input: 1,
            ..Usage::default()
        };
        assert_eq!(w.cost(&odd), 1, "a quarter unit is rounded up");
        // A cached count above the input (a confused upstream) is the input at most.
        let over = Usage {
            input: 2,
            cached_input: 9,
            ..Usage::default()
        };
        assert_eq!(w.cost(&over), 1);
        let huge = Usage {
            output: u64::MAX,
            ..Usage::default()
        };
        assert_eq!(w.cost(&huge), u64::MAX);
    }
}
