#!/usr/bin/env python3
"""How much of a measured inter-token latency is the load client's own (scripts/bench_serving.py).

Starts a stand-in streaming server in its own process (asyncio, 127.0.0.1): every open completion
stream gets one server-sent event per tick (--tick-ms, default 2: a GPU server's step), all streams
at once, as a continuous-batching server sends one token to each of its sequences per step. Each
event's text is its send time (time.monotonic, the system's CLOCK_MONOTONIC, the same clock in every
process). bench_serving.py's own client (stream_completion, run_level) then runs against it at each
client count, with the clients as threads and as processes, and this script reports per mode:

  lag   the receive time the client recorded minus the send time (p50 / p99, ms): the client's delay;
  ITL   the inter-token gaps the client measured, and the same gaps by the send times (p50 / p99).

A client whose ITL p99 exceeds the send-side p99 is adding its own delay to the benchmark's tails.

  python3 scripts/bench_client_check.py --clients 1,16 --tick-ms 2
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import free_port, pct, run_level  # noqa: E402


def serve(port, tick_s, n_tokens, ready):
    streams = set()

    async def handle(reader, writer):
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await reader.read(65536)
            if not chunk:
                writer.close()
                return
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(body) < length:
            body += await reader.read(65536)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        q = asyncio.Queue()
        streams.add(q)
        try:
            for _ in range(n_tokens):
                await q.get()
                ev = {"choices": [{"index": 0, "text": f"{time.monotonic():.7f},"}]}
                writer.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                await writer.drain()
            usage = {"choices": [], "usage": {"completion_tokens": n_tokens}}
            writer.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
            await writer.drain()
        finally:
            streams.discard(q)
            writer.close()

    async def ticker():
        t_next = time.monotonic()
        while True:
            t_next += tick_s
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            for q in list(streams):
                q.put_nowait(None)

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", port)
        asyncio.get_running_loop().create_task(ticker())
        ready.set()
        async with srv:
            await srv.serve_forever()

    asyncio.run(main())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,16", help="client counts (default 1,16)")
    ap.add_argument("--tick-ms", type=float, default=2.0, help="the stand-in server's step (default 2 ms)")
    ap.add_argument("--tokens", type=int, default=64, help="events per request (default 64)")
    ap.add_argument("--requests-per-client", type=int, default=4, help="requests each client sends (default 4)")
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",") if c]
    if not clients or min(clients) < 1 or a.tick_ms <= 0 or a.tokens < 2:
        raise SystemExit("error: --clients must be positive integers, --tick-ms > 0, --tokens >= 2")
    port = free_port()
    ctx = multiprocessing.get_context("spawn")  # the server in a fresh interpreter of its own
    ready = ctx.Event()
    server = ctx.Process(target=serve, args=(port, a.tick_ms / 1e3, a.tokens, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise SystemExit("error: the stand-in server did not start")
        print(f"stand-in server: one event per stream every {a.tick_ms} ms; host CPUs {os.cpu_count()}")
        print("| clients | client as | lag p50 / p99 ms | measured ITL p50 / p99 ms | send-side ITL p50 / p99 ms |")
        print("| --- | --- | --- | --- | --- |")
        for c in clients:
            for mode in ("threads", "processes"):
                prompts = [[1, 2, 3]] * (c * a.requests_per_client)
                results, _ = run_level(port, prompts, c, a.tokens, 60, mode)
                lag, itl, itl_send = [], [], []
                for r in results:
                    if r["error"]:
                        raise SystemExit(f"error: a request failed: {r['error']}")
                    sent = [float(x) for x in r["text"].split(",") if x]
                    if len(sent) != len(r["chunks"]):
                        raise SystemExit("error: events and receive times do not pair up")
                    lag += [(t - s) * 1e3 for s, t in zip(sent, r["chunks"])]
                    itl += [(b - x) * 1e3 for x, b in zip(r["chunks"], r["chunks"][1:])]
                    itl_send += [(b - x) * 1e3 for x, b in zip(sent, sent[1:])]
                print(f"| {c} | {mode} | {pct(lag, 50):.3f} / {pct(lag, 99):.3f} | {pct(itl, 50):.3f} / {pct(itl, 99):.3f} "
                      f"| {pct(itl_send, 50):.3f} / {pct(itl_send, 99):.3f} |", flush=True)
    finally:
        server.terminate()
        server.join(5)


if __name__ == "__main__":
    main()
