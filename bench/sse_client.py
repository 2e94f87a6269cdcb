#!/usr/bin/env python3
"""SSE pass-through measured on several targets in one run (bench/sse.sh).

    sse_client.py --target NAME=HOST:PORT ... [--rounds N] [--streams N] [--concurrency N]
                  [--events N] [--delay-ms N]

Each round runs every target once, in a rotated order: `streams` Chat Completions streams
(`stream_options.include_usage`) with `concurrency` in flight, each asking tests/llm/upstream.py
for `events` tokens `delay-ms` apart. Per stream it records the time to the first event (TTFB,
from the request's first byte), the gap between consecutive events as the client receives them,
and the events per second over the round (throughput). It prints p50 and p99 of each per target,
and per round the ratios of each target to the first one (direct), whose median is the paired
figure: the same machine, the same minute, the same upstream.
"""

import argparse
import asyncio
import json
import statistics
import time

BODY = json.dumps({"model": "bench", "stream": True, "stream_options": {"include_usage": True},
                   "messages": [{"role": "user", "content": "bench"}]}).encode()


async def one_stream(host, port, events, delay_ms):
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer bench\r\nContent-Type: application/json\r\n"
            f"x-test-output-tokens: {events}\r\nx-test-delay-ms: {delay_ms}\r\n"
            f"Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n").encode()
    start = time.perf_counter()
    writer.write(head + BODY)
    await writer.drain()
    seen, arrivals, buf = 0, [], b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        now = time.perf_counter()
        buf += chunk
        count = buf.count(b"data: ")
        for _ in range(count - seen):
            arrivals.append(now - start)
        seen = count
        if b"data: [DONE]" in buf:
            break
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    if not arrivals:
        raise RuntimeError(f"no events from {host}:{port}")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0], gaps, len(arrivals)


async def run_target(host, port, streams, concurrency, events, delay_ms):
    sem = asyncio.Semaphore(concurrency)
    results = []

    async def worker():
        async with sem:
            results.append(await one_stream(host, port, events, delay_ms))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    took = time.perf_counter() - start
    ttfb = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    total = sum(r[2] for r in results)
    return ttfb, gaps, total / took


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--events", type=int, default=50)
    ap.add_argument("--delay-ms", type=int, default=5)
    ap.add_argument("--pair", action="append", default=[],
                    help="A/B: also print A's paired per-round ratios to B")
    a = ap.parse_args()
    targets = []
    for t in a.target:
        name, addr = t.split("=", 1)
        host, port = addr.rsplit(":", 1)
        targets.append((name, host, int(port)))
    stats = {name: {"ttfb": [], "gap": [], "rate": []} for name, _, _ in targets}
    pairs = [tuple(p.split("/", 1)) for p in a.pair]
    ratios = {name: {"ttfb_p50": [], "gap_p99": [], "rate": []} for name, _, _ in targets[1:]}
    pair_ratios = {p: {"ttfb_p50": [], "gap_p99": [], "rate": []} for p in pairs}
    for r in range(a.rounds):
        order = targets[r % len(targets):] + targets[:r % len(targets)]
        round_stats = {}
        for name, host, port in order:
            ttfb, gaps, rate = asyncio.run(
                run_target(host, port, a.streams, a.concurrency, a.events, a.delay_ms))
            stats[name]["ttfb"] += ttfb
            stats[name]["gap"] += gaps
            stats[name]["rate"].append(rate)
            round_stats[name] = (pct(ttfb, 50), pct(gaps, 99) if gaps else 0.0, rate)
        def ratio(into, s, base):
            into["ttfb_p50"].append(s[0] / base[0])
            into["gap_p99"].append(s[1] / base[1] if base[1] else 0.0)
            into["rate"].append(s[2] / base[2])
        for name, _, _ in targets[1:]:
            ratio(ratios[name], round_stats[name], round_stats[targets[0][0]])
        for num, den in pairs:
            ratio(pair_ratios[(num, den)], round_stats[num], round_stats[den])
    print(f"{a.rounds} rounds x {a.streams} streams ({a.concurrency} at once) x {a.events} events "
          f"{a.delay_ms} ms apart")
    print(f"{'target':<16} {'TTFB p50':>10} {'TTFB p99':>10} {'gap p50':>9} {'gap p99':>9} {'events/s':>9}")
    for name, _, _ in targets:
        s = stats[name]
        print(f"{name:<16} {pct(s['ttfb'], 50) * 1e3:>8.2f}ms {pct(s['ttfb'], 99) * 1e3:>8.2f}ms "
              f"{pct(s['gap'], 50) * 1e3:>7.2f}ms {pct(s['gap'], 99) * 1e3:>7.2f}ms "
              f"{statistics.median(s['rate']):>9.0f}")
    base = targets[0][0]
    named = [(f"{name}/{base}", ratios[name]) for name in ratios]
    named += [(f"{num}/{den}", pair_ratios[(num, den)]) for num, den in pairs]
    for label, q in named:
        per_round = " ".join(f"{v:.2f}" for v in q["rate"])
        print(f"{label} paired medians: TTFB p50 x{statistics.median(q['ttfb_p50']):.3f}, "
              f"gap p99 x{statistics.median(q['gap_p99']):.3f}, "
              f"events/s x{statistics.median(q['rate']):.3f} (per round {per_round})")


if __name__ == "__main__":
    main()
