#!/usr/bin/env python3
"""kvq server's resident memory under waves of concurrent streamed requests (issue 16, docs/server.md).

Starts one kvq server per KV type on 127.0.0.1 (--parallel P, -c CTX, the other arguments from
--server-args), then sends W waves of P concurrent streamed greedy completions (distinct random
token-id prompts of --prompt-tokens tokens, --max-tokens generated tokens, ignore_eos) and reads the
server's /proc/PID/status (VmRSS, VmHWM, RssAnon, Threads) and /metrics (KV bytes, prefix-cache
bytes, pages in use) when it has started, and after each wave once its requests have all ended.
Memory that keeps growing wave after wave is a leak; memory that grows in the first wave and then
stays is retention (allocator arenas, buffers sized by the largest batch).

  python3 scripts/server_rss.py --kvq build/kvq --types f16,q4 --waves 5 --out /tmp/rss
  MALLOC_ARENA_MAX=2 python3 scripts/server_rss.py ...   (the environment reaches the server)

Standard library only; the streamed request and server handling come from bench_serving.py.
"""
import argparse
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import Server, free_port, request, stream_completion  # noqa: E402


def proc_status(pid, model):
    """VmRSS, VmHWM, RssAnon, RssFile in MiB and Threads of process pid (/proc/PID/status), and
    GgufRss: the resident MiB of its mappings of the model file (/proc/PID/smaps)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(val.split()[0]) / 1024.0  # kB -> MiB
            elif key == "Threads":
                out[key] = int(val)
    model = os.path.realpath(model)
    gguf_kb, in_model = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                in_model = len(fields) >= 6 and os.path.realpath(fields[5]) == model
            elif in_model and fields[0] == "Rss:":
                gguf_kb += int(fields[1])
    out["GgufRss"] = gguf_kb / 1024.0
    return out


def metrics(port):
    status, text = request(port, "GET", "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics: HTTP {status}")
    m = {}
    for line in text.splitlines():
        if line.startswith("kvq_"):
            name, val = line.split()
            m[name[4:]] = float(val)
    return m


def wave(port, prompts, max_tokens, timeout, stagger):
    """All prompts at once, one thread each, started `stagger` s apart (cpp-httplib listens with a
    backlog of 5: a burst of connects on a loaded host overflows it and connections wait for SYN
    retries or are reset); returns the errors."""
    results = [None] * len(prompts)

    def client(i):
        results[i] = stream_completion(port, prompts[i], max_tokens, timeout)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
        time.sleep(stagger)
    for th in threads:
        th.join()
    errors = [r["error"] for r in results if r["error"]]
    errors += [f"{r['n_tokens']} tokens, not {max_tokens}" for r in results
               if not r["error"] and r["n_tokens"] != max_tokens]
    return errors


def wait_idle(port, timeout=30):
    """Until the server holds no request (finish runs after the last chunk is read)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        m = metrics(port)
        if m["sequences_active"] == 0 and m["sequences_queued"] == 0:
            return m
        time.sleep(0.1)
    raise RuntimeError("the server still holds requests after the wave")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvq", required=True, help="kvq binary (build/kvq)")
    ap.add_argument("--model", default="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    ap.add_argument("--types", default="f16,q4", help="KV types, K and V alike, comma-separated (default f16,q4)")
    ap.add_argument("--parallel", type=int, default=32, help="--parallel and the clients of a wave (default 32)")
    ap.add_argument("--ctx", type=int, default=512, help="-c (default 512)")
    ap.add_argument("--threads", type=int, default=2, help="-t (default 2)")
    ap.add_argument("--waves", type=int, default=5, help="waves (default 5)")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="prompt length in token ids (default 16)")
    ap.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request (default 32)")
    ap.add_argument("--server-args", default="", help="more kvq server arguments (one string)")
    ap.add_argument("--out", required=True, help="folder for the server logs and rss.json")
    ap.add_argument("--first-request", action="store_true", help="one request of one token before the waves")
    ap.add_argument("--stagger", type=float, default=0.05, help="seconds between a wave's connections (default 0.05)")
    ap.add_argument("--request-timeout", type=float, default=300)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    rows = []
    for t in args.types.split(","):
        port = free_port()
        cmd = [args.kvq, "server", "-m", args.model, "--parallel", str(args.parallel), "-c", str(args.ctx),
               "-t", str(args.threads), "-ctk", t, "-ctv", t, "--port", str(port)] + args.server_args.split()
        srv = Server("kvq", f"kvq {t}", cmd, port, os.path.join(args.out, f"server-{t}.log"))
        srv.start()
        try:
            srv.wait_ready(300)
            pid = srv.proc.pid

            def record(label, m):
                row = {"type": t, "after": label, **proc_status(pid, args.model),
                       "kv_cache_bytes": m["kv_cache_bytes"], "prefix_cache_bytes": m["prefix_cache_bytes"],
                       "kv_pages_in_use": m["kv_pages_in_use"]}
                rows.append(row)
                print(f"{t:5s} {label:9s} VmRSS {row['VmRSS']:6.1f} MiB  VmHWM {row['VmHWM']:6.1f}  "
                      f"RssAnon {row['RssAnon']:6.1f}  RssFile {row['RssFile']:6.1f} (model file {row['GgufRss']:6.1f})  "
                      f"threads {row['Threads']:3d}  "
                      f"prefix {m['prefix_cache_bytes'] / 2**20:6.2f} MiB  pages in use {m['kv_pages_in_use']:.0f}",
                      flush=True)

            record("start", metrics(port))
            if args.first_request:  # one request of one token: the first forward pages the weights in
                errors = wave(port, [[1000, 2000]], 1, args.request_timeout, 0)
                if errors:
                    raise RuntimeError(f"the first request failed: {errors[0]}")
                record("1 request", wait_idle(port))
            for w in range(args.waves):
                rng = random.Random(1000 * w + 7)
                prompts = [[rng.randrange(200, 20000) for _ in range(args.prompt_tokens)] for _ in range(args.parallel)]
                t0 = time.monotonic()
                errors = wave(port, prompts, args.max_tokens, args.request_timeout, args.stagger)
                if errors:
                    raise RuntimeError(f"wave {w + 1}: {len(errors)} failed requests, first: {errors[0]}")
                m = wait_idle(port)
                time.sleep(0.5)
                record(f"wave {w + 1}", m)
                print(f"      ({time.monotonic() - t0:.1f} s)", flush=True)
        finally:
            srv.stop()
    with open(os.path.join(args.out, "rss.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
