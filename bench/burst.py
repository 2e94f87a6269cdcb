"""The over-limit burst every limiter in bench/peers.sh is checked with before it is measured.

Sends REQUESTS GETs to URL from the source address SOURCE (a loopback address of its own, so the
limiter sees its own client), CONCURRENCY at a time over keep-alive connections, then one GET from
OTHER (a second client, which a per-client limit must still admit). Prints one line:
    admitted=N refused=N other=STATUS errors=N
`admitted` counts 2xx answers, `refused` 429s (and 503s: HAProxy's and Envoy's other refusals are
counted as errors, so a peer that refuses with another status shows up). Bounded: every request
has a 5 s timeout.
"""
import argparse
import http.client
import threading
import urllib.parse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--source", default="127.0.0.2")
    ap.add_argument("--other", default="127.0.0.3")
    args = ap.parse_args()
    url = urllib.parse.urlsplit(args.url)
    path = url.path or "/"
    counts = {"admitted": 0, "refused": 0, "errors": 0}
    lock = threading.Lock()
    todo = iter(range(args.requests))

    def get(conn):
        conn.request("GET", path, headers={"Host": url.netloc})
        resp = conn.getresponse()
        resp.read()
        return resp.status

    def worker():
        conn = None
        while True:
            with lock:
                if next(todo, None) is None:
                    break
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5,
                                                      source_address=(args.source, 0))
                status = get(conn)
                kind = "admitted" if 200 <= status < 300 else "refused" if status == 429 else "errors"
            except (OSError, http.client.HTTPException):
                kind, conn = "errors", None
            with lock:
                counts[kind] += 1

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5,
                                          source_address=(args.other, 0))
        other = get(conn)
    except (OSError, http.client.HTTPException):
        other = "error"
    print(f"admitted={counts['admitted']} refused={counts['refused']} other={other} "
          f"errors={counts['errors']}")


if __name__ == "__main__":
    main()
