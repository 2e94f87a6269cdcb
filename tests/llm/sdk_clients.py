#!/usr/bin/env python3
"""The official `openai` and `anthropic` Python SDKs through Turnstile (tests/llm/main.rs).

    sdk_clients.py SCENARIO BASE_URL

Prints one JSON object: what the SDKs saw (the usage each call returned, statuses of refusals).

- formats: one call of each kind, streamed and not: Chat Completions (a stream with
  stream_options.include_usage), Responses (stream via responses.stream), Anthropic Messages
  (stream via messages.stream). "usage" lists input + output tokens per call, in order.
- refused: one chat completion that the gateway refuses: the status, Retry-After and the
  rate-limit fields the SDK's APIStatusError carries.
"""

import json
import sys

import anthropic
import openai


def main():
    scenario, base = sys.argv[1], sys.argv[2].rstrip("/")
    oa = openai.OpenAI(base_url=base + "/v1", api_key="sk-test-1", max_retries=0, timeout=30)
    an = anthropic.Anthropic(base_url=base, api_key="sk-test-1", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "count to twenty please"}]
    out = {}
    if scenario == "formats":
        usage = []
        r = oa.chat.completions.create(model="gpt-test", messages=messages, max_tokens=10)
        usage.append(("chat", r.usage.prompt_tokens + r.usage.completion_tokens))
        stream = oa.chat.completions.create(model="gpt-test", messages=messages, max_tokens=12,
                                            stream=True, stream_options={"include_usage": True})
        text, last = "", None
        for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
            if chunk.usage:
                last = chunk.usage
        usage.append(("chat_stream", last.prompt_tokens + last.completion_tokens))
        out["chat_stream_words"] = len(text.split())
        r = oa.responses.create(model="gpt-test", input="hello there", max_output_tokens=8)
        usage.append(("responses", r.usage.input_tokens + r.usage.output_tokens))
        with oa.responses.stream(model="gpt-test", input="hello there", max_output_tokens=9) as s:
            for _ in s:
                pass
            u = s.get_final_response().usage
        usage.append(("responses_stream", u.input_tokens + u.output_tokens))
        m = an.messages.create(model="claude-test", max_tokens=7, messages=messages)
        usage.append(("messages", m.usage.input_tokens + m.usage.output_tokens))
        with an.messages.stream(model="claude-test", max_tokens=11, messages=messages) as s:
            for _ in s.text_stream:
                pass
            u = s.get_final_message().usage
        usage.append(("messages_stream", u.input_tokens + u.output_tokens))
        out["usage"] = usage
    elif scenario == "refused":
        try:
            oa.chat.completions.create(model="gpt-test", messages=messages, max_tokens=10)
            out["status"] = 200
        except openai.APIStatusError as e:
            out["status"] = e.status_code
            out["retry_after"] = e.response.headers.get("retry-after")
            out["remaining"] = e.response.headers.get("x-ratelimit-remaining")
            out["limit"] = e.response.headers.get("x-ratelimit-limit")
        try:
            with an.messages.stream(model="claude-test", max_tokens=11, messages=messages) as s:
                for _ in s.text_stream:
                    pass
            out["anthropic_status"] = 200
        except anthropic.APIStatusError as e:
            out["anthropic_status"] = e.status_code
    else:
        raise SystemExit("unknown scenario " + scenario)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
