#!/usr/bin/env python3
"""An OpenAI- and Anthropic-compatible test upstream (no model: the words it "generates" are
numbered), written from the providers' published API references:

- OpenAI Chat Completions, POST /v1/chat/completions: a `chat.completion` body with `usage`
  {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens,
  completion_tokens_details.reasoning_tokens}; with "stream": true, `chat.completion.chunk` events
  as `data:` lines, the usage chunk (empty `choices`) last before `data: [DONE]` only when
  "stream_options": {"include_usage": true}, and then every other chunk with "usage": null.
- OpenAI Responses, POST /v1/responses: a `response` object with `usage` {input_tokens,
  output_tokens, total_tokens, input_tokens_details, output_tokens_details}; streamed as typed
  events (`event: response.created`, `response.output_text.delta`, ..., `response.completed`
  whose `response.usage` is the usage).
- Anthropic Messages, POST /v1/messages: a `message` body with `usage` {input_tokens,
  output_tokens, cache_creation_input_tokens, cache_read_input_tokens}; streamed as
  `message_start` (input usage), `content_block_*`, `message_delta` (output usage), `message_stop`.

Token counts: the input is one token per whitespace-separated word of the request's text plus 3
per message (always fewer than the request's bytes); the output is `x-test-output-tokens`
(default 20), never more than the request's max_tokens / max_completion_tokens /
max_output_tokens. Test switches, as request headers:

- x-test-mode: cut       the stream (or body) stops before its usage and the connection closes
- x-test-mode: error     500 with the provider's error body
- x-test-mode: malformed a 200 JSON body that is not JSON
- x-test-pad: N          N bytes of padding in the body (a huge body)
- x-test-delay-ms: N     a pause before each streamed event
- x-test-cached: N       N of the input tokens read from the prompt cache
- x-test-report-output: N  report N output tokens (an absurd usage), whatever was generated

GET /_stats answers {"requests", "reported", "cut", "by_key", "last_body"}: `reported` is the sum of input +
output tokens of every usage the server sent, `by_key` the same per Authorization (or x-api-key)
value. The first line on stdout is the port it listens on.
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATS = {"requests": 0, "reported": 0, "cut": 0, "by_key": {}}


def count_input(body):
    words, messages = 0, 0
    def text(v):
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            return " ".join(text(x.get("text", "") if isinstance(x, dict) else x) for x in v)
        return ""
    for m in body.get("messages", []) or []:
        messages += 1
        words += len(text(m.get("content", "")).split())
    if "input" in body:
        inp = body["input"]
        if isinstance(inp, str):
            messages += 1
            words += len(inp.split())
        else:
            for m in inp:
                messages += 1
                words += len(text(m.get("content", "")).split())
    if isinstance(body.get("system"), str):
        words += len(body["system"].split())
    return words + 3 * messages


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_json(self, status, obj, raw=None):
        data = raw if raw is not None else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/_stats":
            with LOCK:
                self.send_json(200, json.loads(json.dumps(STATS)))
        else:
            self.send_json(404, {"error": "not found"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        with LOCK:
            STATS["requests"] += 1
            STATS["last_body"] = raw.decode("utf-8", "replace")
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            self.send_json(400, {"error": {"message": "invalid JSON", "type": "invalid_request_error"}})
            return
        mode = self.headers.get("x-test-mode", "")
        self.pad = int(self.headers.get("x-test-pad", "0"))
        self.delay = int(self.headers.get("x-test-delay-ms", "0")) / 1000.0
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens")
        out = int(self.headers.get("x-test-output-tokens", "20"))
        if limit is not None:
            out = min(out, int(limit))
        inp = count_input(body)
        self.key = self.headers.get("authorization") or self.headers.get("x-api-key") or ""
        self.report_output = self.headers.get("x-test-report-output")
        cached = min(int(self.headers.get("x-test-cached", "0")), inp)
        if mode == "error":
            self.send_json(500, {"error": {"message": "upstream failed", "type": "server_error"}})
            return
        if mode == "malformed":
            self.send_json(200, None, raw=b'{"id": "x", "usage": {"prompt_tokens": 3,')
            return
        if self.path == "/v1/chat/completions":
            self.chat(body, inp, out, cached, mode)
        elif self.path == "/v1/responses":
            self.responses_api(body, inp, out, cached, mode)
        elif self.path == "/v1/messages":
            self.messages(body, inp, out, cached, mode)
        else:
            self.send_json(404, {"error": {"message": "no such route"}})

    def reported(self, inp, out):
        with LOCK:
            STATS["reported"] += inp + out
            STATS["by_key"][self.key] = STATS["by_key"].get(self.key, 0) + inp + out

    def out_count(self, out):
        return int(self.report_output) if self.report_output else out

    def words(self, n):
        return ["w%d " % i for i in range(n)]

    # --- streaming -------------------------------------------------------------------------------
    def start_stream(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data):
        if self.delay:
            time.sleep(self.delay)
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def event(self, obj, name=None):
        text = ("event: %s\n" % name if name else "") + "data: " + json.dumps(obj) + "\n\n"
        self.chunk(text.encode())

    def end_stream(self):
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def cut(self):
        with LOCK:
            STATS["cut"] += 1
        self.wfile.flush()
        self.close_connection = True
        # An unfinished chunked body: the connection closes mid-stream.

    # --- OpenAI Chat Completions -----------------------------------------------------------------
    def chat_usage(self, inp, out, cached):
        out = self.out_count(out)
        return {"prompt_tokens": inp, "completion_tokens": out, "total_tokens": inp + out,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": 0}}

    def chat(self, body, inp, out, cached, mode):
        model = body.get("model", "test-model")
        base = {"id": "chatcmpl-test", "created": int(time.time()), "model": model}
        if not body.get("stream"):
            if mode == "cut":
                return self.cut_body()
            msg = dict(base, object="chat.completion",
                       choices=[{"index": 0, "message": {"role": "assistant", "content": "".join(self.words(out)), "refusal": None},
                                 "logprobs": None, "finish_reason": "length" if out else "stop"}],
                       usage=self.chat_usage(inp, out, cached))
            if self.pad:
                msg["padding"] = "x" * self.pad
            self.reported(inp, out)
            return self.send_json(200, msg)
        include = (body.get("stream_options") or {}).get("include_usage")
        self.start_stream()
        chunk = dict(base, object="chat.completion.chunk")
        if include:
            # With include_usage every chunk but the last carries "usage": null.
            chunk["usage"] = None
        self.event(dict(chunk, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
        for w in self.words(out):
            self.event(dict(chunk, choices=[{"index": 0, "delta": {"content": w}, "finish_reason": None}]))
        if mode == "cut":
            return self.cut()
        self.event(dict(chunk, choices=[{"index": 0, "delta": {}, "finish_reason": "length"}]))
        if include:
            self.event(dict(chunk, choices=[], usage=self.chat_usage(inp, out, cached)))
            self.reported(inp, out)
        self.chunk(b"data: [DONE]\n\n")
        self.end_stream()

    def cut_body(self):
        with LOCK:
            STATS["cut"] += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'{"id": "cut", "choices": [')
        self.wfile.flush()
        self.close_connection = True

    # --- OpenAI Responses --------------------------------------------------------------------------
    def responses_api(self, body, inp, out, cached, mode):
        usage = {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": self.out_count(out), "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": inp + out}
        text = "".join(self.words(out))
        item = {"id": "msg_test", "type": "message", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}
        resp = {"id": "resp_test", "object": "response", "created_at": int(time.time()),
                "status": "completed", "model": body.get("model", "test-model"), "output": [item],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": usage}
        if not body.get("stream"):
            if mode == "cut":
                return self.cut_body()
            self.reported(inp, out)
            return self.send_json(200, resp)
        self.start_stream()
        seq = 0
        def ev(obj):
            nonlocal seq
            obj["sequence_number"] = seq
            seq += 1
            self.event(obj, obj["type"])
        pending = dict(resp, status="in_progress", output=[], usage=None)
        ev({"type": "response.created", "response": pending})
        ev({"type": "response.in_progress", "response": pending})
        ev({"type": "response.output_item.added", "output_index": 0,
            "item": dict(item, status="in_progress", content=[])})
        ev({"type": "response.content_part.added", "item_id": "msg_test", "output_index": 0,
            "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        for w in self.words(out):
            ev({"type": "response.output_text.delta", "item_id": "msg_test", "output_index": 0,
                "content_index": 0, "delta": w, "logprobs": []})
        if mode == "cut":
            return self.cut()
        ev({"type": "response.output_text.done", "item_id": "msg_test", "output_index": 0,
            "content_index": 0, "text": text, "logprobs": []})
        ev({"type": "response.content_part.done", "item_id": "msg_test", "output_index": 0,
            "content_index": 0, "part": item["content"][0]})
        ev({"type": "response.output_item.done", "output_index": 0, "item": item})
        ev({"type": "response.completed", "response": resp})
        self.reported(inp, out)
        self.end_stream()

    # --- Anthropic Messages ------------------------------------------------------------------------
    def messages(self, body, inp, out, cached, mode):
        # Anthropic's input_tokens excludes the cache: the cached part is reported beside it.
        usage = {"input_tokens": inp - cached, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached, "output_tokens": self.out_count(out)}
        text = "".join(self.words(out))
        msg = {"id": "msg_test", "type": "message", "role": "assistant",
               "model": body.get("model", "test-model"),
               "content": [{"type": "text", "text": text}],
               "stop_reason": "max_tokens", "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            if mode == "cut":
                return self.cut_body()
            self.reported(inp, out)
            return self.send_json(200, msg)
        self.start_stream()
        start = dict(msg, content=[], stop_reason=None, usage=dict(usage, output_tokens=1))
        self.event({"type": "message_start", "message": start}, "message_start")
        self.event({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}, "content_block_start")
        self.event({"type": "ping"}, "ping")
        for w in self.words(out):
            self.event({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": w}}, "content_block_delta")
        if mode == "cut":
            return self.cut()
        self.event({"type": "content_block_stop", "index": 0}, "content_block_stop")
        self.event({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                    "usage": {"output_tokens": self.out_count(out)}}, "message_delta")
        self.event({"type": "message_stop"}, "message_stop")
        self.reported(inp, out)
        self.end_stream()


class Server(ThreadingHTTPServer):
    # Many concurrent streams connect at once: the default backlog of 5 would drop some.
    request_queue_size = 256


def main():
    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
