#!/usr/bin/env python3
"""Sends scripts/decide.lua's packed batches to one Redis and prints what Redis spent on them.

Usage: script_load.py PORT SCRIPT [BATCH] [CALLS] [KEYS] [--text]

Each call is one EVALSHA of BATCH single-token-bucket decisions (the benchmark's never-tripping
policy: rate 1e9/s, burst 1e9, cost 1, Redis TIME) on KEYS distinct counters, CALLS calls
pipelined 64 deep on one connection. The packed arguments are written as src/limiter/redis/wire.rs
writes them (little-endian doubles); --text writes the space-separated words of the older text
form, for measuring a script from before it. Prints Redis's own figure from INFO commandstats:
microseconds per call and per decision.
"""
import socket
import struct
import sys


def encode(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Conn:
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")

    def send(self, data):
        self.sock.sendall(data)

    def read(self):
        line = self.file.readline()
        kind, rest = line[:1], line[1:].strip()
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self.read() for _ in range(int(rest))]
        if kind == b"-":
            raise SystemExit("redis error: " + rest.decode())
        return rest


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    text = "--text" in sys.argv
    port, script = int(args[0]), open(args[1], "rb").read()
    batch = int(args[2]) if len(args) > 2 else 15
    calls = int(args[3]) if len(args) > 3 else 4000
    nkeys = int(args[4]) if len(args) > 4 else 50
    conn = Conn(port)
    conn.send(encode("SCRIPT", "LOAD", script))
    sha = conn.read()
    conn.send(encode("CONFIG", "RESETSTAT"))
    conn.read()
    requests = []
    for c in range(calls):
        keys = [b"bench:{k%d}:tb" % ((c * batch + i) % nkeys) for i in range(batch)]
        if text:
            blob = " ".join("- 1 tb 1000000000 1000000000 0 1 0" for _ in keys) + " "
        else:
            blob = b"".join(struct.pack("<8d", -1, 1, 1, 1e9, 1e9, 0, 1, 0) for _ in keys)
        requests.append(encode("EVALSHA", sha, len(keys), *keys, "packed", blob))
    depth = 64
    for i in range(0, calls, depth):
        conn.send(b"".join(requests[i:i + depth]))
        for _ in requests[i:i + depth]:
            conn.read()
    conn.send(encode("INFO", "commandstats"))
    for line in conn.read().decode().splitlines():
        if line.startswith("cmdstat_evalsha:"):
            fields = dict(f.split("=") for f in line.split(":", 1)[1].split(","))
            per_call = float(fields["usec"]) / int(fields["calls"])
            print("evalsha: %d calls, %.2f us per call, %.2f us per decision"
                  % (int(fields["calls"]), per_call, per_call / batch))


if __name__ == "__main__":
    main()
