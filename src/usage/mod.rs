//! Token usage read from LLM responses (`docs/llm.md`): the counts a JSON body or one event of a
//! server-sent event stream reports, in the formats the providers publish, and the scanner that
//! finds them in a body as it streams by ([`scan`]).
//!
//! Pure functions over bytes and `serde_json` values: nothing here knows about HTTP bodies, the
//! engine or the config's YAML (the formats and weights are [`crate::config::usage`]).

pub mod request;
pub mod scan;

use serde_json::Value;

use crate::config::usage::{Usage, UsageFormat};

pub use scan::{Framing, Scanner};

/// What a response reported so far for one format: the counts (each the largest reported, since
/// a stream reports running totals) and whether the final report was seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reported {
    pub usage: Usage,
    /// A report that ends the response's accounting arrived: OpenAI's `usage` (the body's, the
    /// last chunk's, `response.completed`'s), Anthropic's body or `message_delta`, any pointer.
    pub complete: bool,
}

impl Reported {
    /// Merges what `value` (a body, or one event's data) reports in `format`.
    pub fn read(&mut self, format: &UsageFormat, value: &Value) {
        match format {
            UsageFormat::OpenAi => {
                for usage in [value.get("usage"), value.pointer("/response/usage")]
                    .into_iter()
                    .flatten()
                {
                    self.openai(usage);
                }
            }
            UsageFormat::Anthropic => {
                let kind = value.get("type").and_then(Value::as_str);
                if let Some(usage) = value.pointer("/message/usage") {
                    // message_start: the input, and an output count that only grows.
                    self.anthropic(usage, false);
                }
                if let Some(usage) = value.get("usage") {
                    // The body (type "message") or message_delta: the final counts.
                    self.anthropic(usage, kind != Some("message_start"));
                }
            }
            UsageFormat::Pointers(p) => {
                let mut found = false;
                for (pointer, field) in [
                    (&p.input, &mut self.usage.input),
                    (&p.output, &mut self.usage.output),
                    (&p.cached_input, &mut self.usage.cached_input),
                    (&p.reasoning, &mut self.usage.reasoning),
                ] {
                    let count = pointer
                        .as_deref()
                        .and_then(|ptr| value.pointer(ptr))
                        .and_then(count);
                    if let Some(n) = count {
                        *field = (*field).max(n);
                        found = true;
                    }
                }
                self.complete |= found;
            }
        }
    }

    /// OpenAI Chat Completions (`prompt_tokens`, `completion_tokens`, their `*_details`) or
    /// Responses (`input_tokens`, `output_tokens`, their `*_details`). `null` (a chunk before
    /// the last in a stream with `include_usage`) reports nothing.
    fn openai(&mut self, usage: &Value) {
        let field = |names: [&str; 2]| names.iter().find_map(|n| usage.pointer(n)).and_then(count);
        let input = field(["/prompt_tokens", "/input_tokens"]);
        let output = field(["/completion_tokens", "/output_tokens"]);
        if input.is_none() && output.is_none() {
            return;
        }
        let u = &mut self.usage;
        u.input = u.input.max(input.unwrap_or(0));
        u.output = u.output.max(output.unwrap_or(0));
        let cached = field([
            "/prompt_tokens_details/cached_tokens",
            "/input_tokens_details/cached_tokens",
        ]);
        let reasoning = field([
            "/completion_tokens_details/reasoning_tokens",
            "/output_tokens_details/reasoning_tokens",
        ]);
        u.cached_input = u.cached_input.max(cached.unwrap_or(0));
        u.reasoning = u.reasoning.max(reasoning.unwrap_or(0));
        self.complete = true;
    }

    /// Anthropic Messages: `input_tokens` excludes the cache, so the input is it plus
    /// `cache_creation_input_tokens` and `cache_read_input_tokens`; the reads are the cached part.
    fn anthropic(&mut self, usage: &Value, last: bool) {
        let field = |name: &str| usage.get(name).and_then(count);
        let (input, created, read) = (
            field("input_tokens"),
            field("cache_creation_input_tokens"),
            field("cache_read_input_tokens"),
        );
        let output = field("output_tokens");
        if input.is_none() && output.is_none() && created.is_none() && read.is_none() {
            return;
        }
        let u = &mut self.usage;
        let all_input = input
            .unwrap_or(0)
            .saturating_add(created.unwrap_or(0))
            .saturating_add(read.unwrap_or(0));
        u.input = u.input.max(all_input);
        u.cached_input = u.cached_input.max(read.unwrap_or(0));
        u.output = u.output.max(output.unwrap_or(0));
        self.complete |= last && output.is_some();
    }
}

/// A token count: a whole number, a fraction rounded up, 0 below zero, `u64::MAX` past it; not
/// a number: none.
fn count(value: &Value) -> Option<u64> {
    if let Some(n) = value.as_u64() {
        return Some(n);
    }
    let x = value.as_f64()?;
    // `as` saturates.
    Some(if x > 0.0 { x.ceil() as u64 } else { 0 })
}

#[cfg(test)]
mod tests;
