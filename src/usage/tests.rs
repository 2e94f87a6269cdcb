//! The formats as the providers' API references print them, fed whole and a byte at a time.

use serde_json::Value;

use super::{Framing, Reported, Scanner};
use crate::config::usage::{Usage, UsageFormat, UsagePointers};

/// What `body` reports in `format`, fed in chunks of `chunk` bytes.
fn read(format: &UsageFormat, framing: Framing, body: &str, chunk: usize, max: usize) -> Reported {
    let mut reported = Reported::default();
    let mut scanner = Scanner::new(framing, max, None);
    let mut found = |v: &Value| reported.read(format, v);
    for part in body.as_bytes().chunks(chunk.max(1)) {
        scanner.feed(part, &mut found);
    }
    scanner.finish(&mut found);
    reported
}

fn every_split(format: &UsageFormat, framing: Framing, body: &str) -> Reported {
    let whole = read(format, framing, body, body.len(), 1 << 20);
    for chunk in 1..8 {
        assert_eq!(
            read(format, framing, body, chunk, 1 << 20),
            whole,
            "chunks of {chunk}"
        );
    }
    whole
}

const CHAT_BODY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,
"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":19,
"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":4},
"completion_tokens_details":{"reasoning_tokens":3}}}"#;

#[test]
fn openai_chat_body_and_stream_with_include_usage() {
    let r = every_split(&UsageFormat::OpenAi, Framing::Json, CHAT_BODY);
    let want = Usage {
        input: 19,
        output: 10,
        cached_input: 4,
        reasoning: 3,
    };
    assert_eq!((r.usage, r.complete), (want, true));
    let stream = "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
                  data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":19,\"completion_tokens\":10,\
                  \"total_tokens\":29}}\r\n\r\n\
                  data: [DONE]\n\n";
    let r = every_split(&UsageFormat::OpenAi, Framing::EventStream, stream);
    assert_eq!(r.usage.input, 19);
    assert_eq!(r.usage.output, 10);
    assert!(r.complete);
    // Without include_usage no chunk reports any.
    let bare =
        "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n\n";
    let r = every_split(&UsageFormat::OpenAi, Framing::EventStream, bare);
    assert!(!r.complete);
}

#[test]
fn openai_responses_completed_event() {
    let stream = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n\
                  event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n\
                  event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\
                  \"usage\":{\"input_tokens\":36,\"input_tokens_details\":{\"cached_tokens\":6},\
                  \"output_tokens\":87,\"output_tokens_details\":{\"reasoning_tokens\":20},\"total_tokens\":123}}}\n\n";
    let r = every_split(&UsageFormat::OpenAi, Framing::EventStream, stream);
    let want = Usage {
        input: 36,
        output: 87,
        cached_input: 6,
        reasoning: 20,
    };
    assert_eq!((r.usage, r.complete), (want, true));
}

#[test]
fn anthropic_message_start_and_delta_with_cache_tokens() {
    let stream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\
                  \"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":100,\
                  \"cache_read_input_tokens\":50,\"output_tokens\":1}}}\n\n\
                  event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hi\"}}\n\n\
                  event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\
                  \"usage\":{\"output_tokens\":15}}\n\n\
                  event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    let r = every_split(&UsageFormat::Anthropic, Framing::EventStream, stream);
    let want = Usage {
        input: 175,
        output: 15,
        cached_input: 50,
        reasoning: 0,
    };
    assert_eq!((r.usage, r.complete), (want, true));
    // Cut after message_start: the input is known, the report is not complete.
    let cut = &stream[..stream.find("event: content_block_delta").unwrap_or(0)];
    let r = every_split(&UsageFormat::Anthropic, Framing::EventStream, cut);
    assert_eq!(r.usage.input, 175);
    assert!(!r.complete);
    let body = r#"{"id":"m","type":"message","role":"assistant","content":[],"usage":{"input_tokens":10,"output_tokens":4}}"#;
    let r = every_split(&UsageFormat::Anthropic, Framing::Json, body);
    assert_eq!((r.usage.input, r.usage.output, r.complete), (10, 4, true));
}

#[test]
fn pointers_read_any_shape() {
    let format = UsageFormat::Pointers(std::sync::Arc::new(UsagePointers {
        input: Some("/meta/tokens/in".into()),
        output: Some("/meta/tokens/out".into()),
        ..UsagePointers::default()
    }));
    let r = every_split(
        &format,
        Framing::Json,
        r#"{"meta":{"tokens":{"in":7,"out":2.5}}}"#,
    );
    assert_eq!((r.usage.input, r.usage.output, r.complete), (7, 3, true));
    let r = every_split(&format, Framing::Json, r#"{"meta":{}}"#);
    assert!(!r.complete);
}

#[test]
fn malformed_absurd_and_oversized_bodies_report_nothing_or_saturate() {
    let f = UsageFormat::OpenAi;
    let r = every_split(&f, Framing::Json, r#"{"usage":{"prompt_tokens":1"#);
    assert!(!r.complete, "truncated JSON");
    let r = every_split(&f, Framing::Json, r#"{"usage":{"prompt_tokens":"many"}}"#);
    assert!(!r.complete, "a count that is not a number");
    let r = every_split(
        &f,
        Framing::Json,
        r#"{"usage":{"prompt_tokens":-5,"completion_tokens":1e300}}"#,
    );
    assert_eq!((r.usage.input, r.usage.output), (0, u64::MAX));
    // Past `max`: nothing kept, nothing reported.
    let r = read(&f, Framing::Json, CHAT_BODY, 16, 64);
    assert!(!r.complete);
    // An oversized event is skipped; the next one still counts.
    let big = format!(
        "data: {{\"pad\":\"{}\"}}\n\ndata: {{\"usage\":{{\"prompt_tokens\":2,\"completion_tokens\":3}}}}\n\n",
        "x".repeat(500)
    );
    let r = read(&f, Framing::EventStream, &big, 7, 128);
    assert_eq!((r.usage.output, r.complete), (3, true));
    // An event with no blank line after it (a cut stream) is not read.
    let r = read(
        &f,
        Framing::EventStream,
        "data: {\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3}}\n",
        4,
        1024,
    );
    assert!(!r.complete);
}

#[test]
fn framing_is_the_content_type() {
    assert_eq!(
        Framing::of(Some(b"text/event-stream; charset=utf-8")),
        Framing::EventStream
    );
    assert_eq!(
        Framing::of(Some(b"Text/Event-Stream")),
        Framing::EventStream
    );
    assert_eq!(Framing::of(Some(b"application/json")), Framing::Json);
    assert_eq!(Framing::of(None), Framing::Json);
}
