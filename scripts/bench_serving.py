#!/usr/bin/env python3
"""kvq server beside llama-server: serving throughput, latency and KV capacity (issue 16, docs/perf.md).

Starts one kvq server per kvq KV format and one llama-server per llama.cpp KV type, all on 127.0.0.1
with the same GGUF model, the same --parallel slots, the same per-sequence context and the same KV
budget in bytes, and drives each with the same streamed greedy completions at 1, 4 and 16 concurrent
clients. The servers all run for the whole benchmark but only one is under load at a time: rounds
are interleaved (round r: for each client count, every server in turn, the order rotated by r), so
that a noisy host falls on every server alike. Idle servers wait on their queues and take no CPU.

Per server and client count it reports the generated tokens per second (all requests' completion
tokens over the wall time from the first request sent to the last one finished), the time to first
token (TTFT: request sent to the first streamed text) and the inter-token latency (ITL: the gap
between consecutive streamed text chunks; both servers stream one chunk per token except where a
token ends inside a UTF-8 character or a stop-string candidate), p50 and p99 over every request of
every round; under the table, each server's ITL p99 at the most clients over its p99 at one client
(how much longer the worst gaps get under load). Also the largest number of concurrent 4K-token
sequences each format admits at the budget: kvq from /metrics (kvq_kv_budget_bytes / kvq_kv_pages_total = bytes per page, and a
sequence of 4096 tokens holds ceil(4096 / page) pages), llama-server from its KV size line (bytes per
cell from the GGUF shapes and ggml's type sizes; a llama-server slot of 4096 cells per sequence,
-c = slots x 4096).

The budget is llama-server f16's whole cache: --parallel x --ctx tokens at f16 (what the kvq f16
server allocates with no --kv-budget; read from its /metrics and passed to the other kvq servers as
--kv-budget). llama-server runs -np P -c P*ctx (one fixed slot of ctx cells per sequence), -fa on,
-ctk/-ctv its type. kvq runs --parallel P -c ctx --kv-budget B -ctk/-ctv its format (pages of
--kv-page 64 tokens; kvq's default K channel scale for the per-token formats).

Prompts are token ids (the same ids to both servers, no tokenizer difference), distinct for every
request of every round so that neither server's prompt cache helps; ignore_eos with a fixed
max_tokens makes every request generate exactly max_tokens tokens (checked against usage).

kvq on the GPU: --kvq-devices cuda (or cpu,cuda: each kvq format on each device, labelled
"kvq cuda q4" beside "kvq q4") starts kvq server --device cuda (--cuda-graphs adds that flag there);
the budget is then the first device's f16 pool (on the GPU: pages of 16 tokens, every slot at --ctx).
Without --llama-server (or with --llama-types "") only kvq servers run. --kvq-variant adds kvq
servers of another build or with other arguments to the same rounds (labelled "kvq cuda q4 [NAME]"):
before / after a change, or -b 32 beside the default, measured side by side.

--warmup-rounds N runs N unmeasured rounds of the same protocol first (their own prompts), so that
servers reach their steady state before the measured rounds (kvq --cuda-graphs captures a graph per
step shape as the shapes recur; cold, those captures fall inside the measured tails).

Standard library only (http.client, one process per client: --clients-as). Never builds llama.cpp: pass a built
llama-server binary.

  python3 scripts/bench_serving.py --kvq build/kvq --llama-server PATH/llama-server \
      --model models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --threads 14 --out bench-out
  python3 scripts/bench_serving.py --kvq build/kvq --kvq-devices cuda --kvq-types f16,q8,q4 \
      --model models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --threads 4 --out bench-gpu \
      --kvq-variant 'b32||f16,q4|-b 32' --kvq-variant 'before|/tmp/kvq_main|f16,q4|'
"""
import argparse
import http.client
import json
import math
import multiprocessing
import os
import random
import re
import signal
import socket
import statistics
import shlex
import subprocess
import sys
import threading
import time

# ---- servers --------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process: kind 'kvq' or 'llama', a label, its command line and its log file."""

    def __init__(self, kind, label, cmd, port, log_path):
        self.kind, self.label, self.cmd, self.port, self.log_path = kind, label, cmd, port, log_path
        self.proc = None
        self.log = None

    def start(self):
        self.log = open(self.log_path, "w")
        self.log.write("$ " + " ".join(self.cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout):
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label}: the server exited with status {self.proc.returncode} "
                                   f"before it was ready; its log: {self.log_path}\n{tail(self.log_path)}")
            try:
                status, _ = request(self.port, "GET", "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.label}: not ready after {timeout} s; its log: {self.log_path}\n{tail(self.log_path)}")

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def tail(path, n=15):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def request(port, method, path, body=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def request_json(port, method, path, body=None):
    status, text = request(port, method, path, body)
    if status != 200:
        raise RuntimeError(f"{method} {path} on port {port}: HTTP {status}: {text[:300]}")
    return json.loads(text)


def parse_kv_type(spec):
    """'q4' -> (q4, q4, None); 'kivi4/q4a+sink4' -> (kivi4, q4a, 4) (kvq bench --types syntax)."""
    sink = None
    m = re.fullmatch(r"([^/+]+)(?:/([^/+]+))?(?:\+sink(\d+))?", spec)
    if not m:
        raise SystemExit(f"error: KV type '{spec}' is not K, K/V or K/V+sinkN")
    k, v, s = m.group(1), m.group(2) or m.group(1), m.group(3)
    if s is not None:
        sink = int(s)
    return k, v, sink


# ---- one streamed request ----------------------------------------------------------------------------


def stream_completion(port, prompt_ids, max_tokens, timeout):
    """Sends one streamed greedy completion; returns its timings (monotonic seconds) and counts."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "seed": 1, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    res = {"t_send": None, "chunks": [], "n_tokens": None, "text": "", "error": None}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body)
        res["t_send"] = time.monotonic()
        conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:300]!r}"
            return res
        while True:
            line = r.readline()
            if not line:
                break
            t = time.monotonic()
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            j = json.loads(payload)
            if "error" in j:
                res["error"] = str(j["error"])[:300]
                break
            if j.get("usage"):
                res["n_tokens"] = j["usage"].get("completion_tokens")
            for c in j.get("choices") or []:
                text = c.get("text") or ""
                if text:
                    res["chunks"].append(t)
                    res["text"] += text
    except (OSError, http.client.HTTPException, ValueError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    if res["error"] is None and res["n_tokens"] is None:
        res["n_tokens"] = len(res["chunks"])  # no usage chunk: one chunk per token
    return res


def run_level(port, prompts, n_clients, max_tokens, timeout, clients_as="processes"):
    """n_clients clients, each sending its share of `prompts` one after another; returns results, wall s.

    clients_as "processes" (the default): one process per client (fork), so that no client's timestamps
    wait on another's Python work: with threads, the 16 clients of a GPU server all receive a token
    every ~2 ms and parse it under one interpreter lock, which delays some timestamps by the others'
    parsing and widens the measured inter-token gaps (scripts/bench_client_check.py measures it).
    "threads": one thread per client in this process (the former client). time.monotonic is the
    system's CLOCK_MONOTONIC, the same clock in every process."""
    if clients_as == "threads":
        results = [None] * len(prompts)
        next_i = [0]
        lock = threading.Lock()

        def client():
            while True:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= len(prompts):
                    return
                results[i] = stream_completion(port, prompts[i], max_tokens, timeout)

        threads = [threading.Thread(target=client) for _ in range(n_clients)]
        t0 = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return results, time.monotonic() - t0
    if clients_as != "processes":
        raise ValueError(f"clients_as '{clients_as}' must be processes or threads")
    ctx = multiprocessing.get_context("fork")
    next_i = ctx.Value("i", 0)
    go = ctx.Event()
    out = ctx.Queue()

    def client():
        go.wait()
        while True:
            with next_i.get_lock():
                i = next_i.value
                next_i.value += 1
            if i >= len(prompts):
                out.put(None)
                return
            out.put((i, stream_completion(port, prompts[i], max_tokens, timeout)))

    procs = [ctx.Process(target=client, daemon=True) for _ in range(n_clients)]
    for pr in procs:
        pr.start()
    results = [None] * len(prompts)
    t0 = time.monotonic()
    go.set()
    done = 0
    while done < n_clients:
        item = out.get(timeout=timeout * (len(prompts) + 1))
        if item is None:
            done += 1
        else:
            results[item[0]] = item[1]
    wall = time.monotonic() - t0
    for pr in procs:
        pr.join()
    for i, r in enumerate(results):
        if r is None:  # a client process died without a result
            results[i] = {"t_send": None, "chunks": [], "n_tokens": None, "text": "", "error": "client process lost"}
    return results, wall


# ---- prompts ----------------------------------------------------------------------------------------

SENTENCES = [
    "The scheduler keeps a queue of requests and admits one when a slot and its pages are free.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n",
    "A paged cache hands out fixed-size pages from one pool shared by every sequence.",
    "Write a function that parses a CSV line with quoted fields and escaped quotes.",
    "for (int i = 0; i < n; ++i) sum += x[i] * y[i];",
    "The quick brown fox jumps over the lazy dog while the compiler inlines the loop.",
    "Explain why a binary heap gives O(log n) insertion and removal of the minimum.",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n",
    "Rotating keys before quantization spreads outlier channels over the whole vector.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3;",
    "Continuous batching lets new requests join between decode steps of running ones.",
    "Implement a thread-safe bounded queue with a condition variable in C++.",
]


def make_prompts(tok_port, n, n_tokens, round_i):
    """n distinct prompts of exactly n_tokens token ids (tokenized by the kvq server on tok_port)."""
    out = []
    for i in range(n):
        rng = random.Random(1000 * round_i + i)
        text = f"# task {round_i}-{i}\n"
        ids = []
        while len(ids) < n_tokens:
            text += rng.choice(SENTENCES) + "\n"
            ids = request_json(tok_port, "POST", "/tokenize", {"content": text})["tokens"]
        out.append(ids[:n_tokens])
    return out


# ---- statistics ---------------------------------------------------------------------------------------


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def metrics_kvq(port):
    status, text = request(port, "GET", "/metrics")
    if status != 200:
        raise RuntimeError(f"GET /metrics on port {port}: HTTP {status}")
    m = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition(" ")
            m[k] = float(v)
    return m


def gguf_scalars(path):
    """The scalar metadata of a GGUF file (ggml/docs/gguf.md; arrays skipped), key -> value."""
    import struct
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    out = {}
    with open(path, "rb") as f:
        data = f.read(64 << 20)  # the metadata is at the start
    if data[:4] != b"GGUF":
        raise SystemExit(f"error: --model '{path}' is not a GGUF file")
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    o = 24

    def string(o):
        n = struct.unpack_from("<Q", data, o)[0]
        return data[o + 8:o + 8 + n].decode("utf-8", "replace"), o + 8 + n

    def skip(t, o):
        if t == 8:
            return string(o)[1]
        if t == 9:
            et, n = struct.unpack_from("<IQ", data, o)
            o += 12
            if et in (8, 9):
                for _ in range(n):
                    o = skip(et, o)
                return o
            return o + n * struct.calcsize("<" + fmt[et])
        return o + struct.calcsize("<" + fmt[t])

    for _ in range(n_kv):
        key, o = string(o)
        t = struct.unpack_from("<I", data, o)[0]
        o += 4
        if t in fmt:
            out[key] = struct.unpack_from("<" + fmt[t], data, o)[0]
        elif t == 8:
            out[key] = string(o)[0]
        o = skip(t, o)
    return out


# bytes per element of llama.cpp's KV cache types (ggml type sizes / block sizes)
GGML_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32,
                   "q5_1": 24 / 32, "iq4_nl": 18 / 32}


def llama_bytes_per_cell(model, type_k, type_v):
    """Bytes of one KV cell of llama.cpp's cache for this model (every layer, K and V)."""
    m = gguf_scalars(model)
    arch = m["general.architecture"]
    n_layer, n_head = m[arch + ".block_count"], m[arch + ".attention.head_count"]
    n_kv = m.get(arch + ".attention.head_count_kv", n_head)
    k_len = m.get(arch + ".attention.key_length", m[arch + ".embedding_length"] // n_head)
    v_len = m.get(arch + ".attention.value_length", k_len)
    if type_k not in GGML_TYPE_BYTES or type_v not in GGML_TYPE_BYTES:
        raise SystemExit(f"error: llama.cpp KV type '{type_k}' / '{type_v}' not in {sorted(GGML_TYPE_BYTES)}")
    return n_layer * n_kv * (k_len * GGML_TYPE_BYTES[type_k] + v_len * GGML_TYPE_BYTES[type_v])


# ---- main -------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvq", required=True, help="kvq binary (build/kvq)")
    ap.add_argument("--llama-server", default="", help="llama-server binary (built outside this repository; none: kvq only)")
    ap.add_argument("--model", default="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                    help="GGUF model every server loads (default: the real-models issue's Qwen2.5-Coder-0.5B)")
    ap.add_argument("--threads", type=int, required=True, help="compute threads of every server (-t)")
    ap.add_argument("--out", required=True, help="folder for results.md, results.json and the server logs")
    ap.add_argument("--parallel", type=int, default=16, help="sequence slots of every server (default 16)")
    ap.add_argument("--ctx", type=int, default=4096, help="context of one sequence slot in tokens (default 4096)")
    ap.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated (default 1,4,16)")
    ap.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends in a level (default 2; at least 3 for one client)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default 128)")
    ap.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (default 64, ignore_eos)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="unmeasured rounds of the same protocol before the measured ones, with their own prompts "
                         "(default 0): servers reach their steady state first, e.g. kvq --cuda-graphs with its step "
                         "shapes captured")
    ap.add_argument("--time-limit", type=float, default=420, help="start no round that would end after this many seconds of measuring (default 420; the first round always runs)")
    ap.add_argument("--kvq-types", default="f16,q8,q4,kivi4/q4a+sink4", help="kvq formats: K, K/V, K/V+sinkN (default f16,q8,q4,kivi4/q4a+sink4: the README's recommended -ctk kivi4 -ctv q4a --kv-sink 4)")
    ap.add_argument("--llama-types", default="f16,q4_0", help="llama-server KV types, K and V alike (default f16,q4_0)")
    ap.add_argument("--kv-page", type=int, default=64, help="kvq --kv-page (default 64; the GPU's pages are 16 tokens)")
    ap.add_argument("--kvq-devices", default="cpu", help="kvq server --device of each kvq server, comma-separated: cpu, cuda (default cpu)")
    ap.add_argument("--cuda-graphs", action="store_true", help="kvq server --device cuda --cuda-graphs")
    ap.add_argument("--kvq-variant", action="append", default=[], metavar="'NAME|BINARY|TYPES|ARGS'",
                    help="more kvq servers in the same interleaved rounds, on the first --kvq-devices device: label "
                         "suffix NAME, BINARY (another kvq build; empty: --kvq), TYPES (comma-separated --kvq-types "
                         "entries), ARGS (more server arguments, e.g. '-b 64'); repeatable. For before / after builds "
                         "and server settings side by side in one run")
    ap.add_argument("--capacity-ctx", type=int, default=4096, help="sequence length of the capacity column (default 4096)")
    ap.add_argument("--clients-as", choices=("processes", "threads"), default="processes",
                    help="one process per client (default: no client's timestamps wait on another's parsing) or one "
                         "thread per client in this process (the former client; scripts/bench_client_check.py "
                         "measures the difference)")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--startup-timeout", type=float, default=300)
    a = ap.parse_args()

    if not a.llama_server:
        a.llama_types = ""
    for path, what in ((a.kvq, "--kvq"), (a.llama_server, "--llama-server")):
        if path == a.llama_server and not a.llama_types:
            continue
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise SystemExit(f"error: {what} '{path}' is not an executable file")
    if not os.path.isfile(a.model):
        raise SystemExit(f"error: --model '{a.model}' not found (scripts/fetch-models.sh)")
    clients = [int(c) for c in a.clients.split(",") if c]
    if a.warmup_rounds < 0:
        raise SystemExit(f"error: --warmup-rounds {a.warmup_rounds} must be >= 0")
    if not clients or min(clients) < 1 or max(clients) > a.parallel:
        raise SystemExit(f"error: --clients '{a.clients}' must be integers in [1, --parallel {a.parallel}]")
    if a.prompt_tokens + a.max_tokens > a.ctx:
        raise SystemExit(f"error: --prompt-tokens + --max-tokens ({a.prompt_tokens + a.max_tokens}) exceed --ctx {a.ctx}")
    kvq_types = [t for t in a.kvq_types.split(",") if t]
    llama_types = [t for t in a.llama_types.split(",") if t]
    if "f16" not in kvq_types:
        raise SystemExit("error: --kvq-types must include f16 (the budget is the f16 server's)")
    devices = [d for d in a.kvq_devices.split(",") if d]
    if not devices or any(d not in ("cpu", "cuda") for d in devices):
        raise SystemExit(f"error: --kvq-devices '{a.kvq_devices}' must list cpu and / or cuda")
    variants = []
    for v in a.kvq_variant:
        parts = v.split("|")
        if len(parts) != 4 or not parts[0] or not parts[2]:
            raise SystemExit(f"error: --kvq-variant '{v}' must be 'NAME|BINARY|TYPES|ARGS' (NAME and TYPES not empty)")
        binary = parts[1] or a.kvq
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            raise SystemExit(f"error: --kvq-variant '{v}': '{binary}' is not an executable file")
        variants.append({"name": parts[0], "binary": binary, "types": [t for t in parts[2].split(",") if t],
                         "args": shlex.split(parts[3])})
    os.makedirs(a.out, exist_ok=True)
    t_start = time.monotonic()

    def kvq_server(spec, budget_gib, device="cpu", binary=None, extra=(), tag=""):
        k, v, sink = parse_kv_type(spec)
        cmd = [binary or a.kvq, "server", "-m", a.model, "-c", str(a.ctx), "--parallel", str(a.parallel), "-t", str(a.threads),
               "--host", "127.0.0.1", "--port", str(free_port()), "--kv-page", str(a.kv_page), "-ctk", k, "-ctv", v]
        if budget_gib is not None:
            cmd += ["--kv-budget", f"{budget_gib:.12f}"]
        if sink is not None:
            cmd += ["--kv-sink", str(sink)]
        if device == "cuda":
            cmd += ["--device", "cuda"] + (["--cuda-graphs"] if a.cuda_graphs else [])
        cmd += list(extra)
        label = "kvq " + ("" if device == "cpu" else device + " ") + spec + (f" [{tag}]" if tag else "")
        name = ("kvq_" + ("" if device == "cpu" else device + "_") + spec.replace("/", "_").replace("+", "_") +
                ("_" + re.sub(r"[^A-Za-z0-9_.-]", "_", tag) if tag else ""))
        return Server("kvq", label, cmd, int(cmd[cmd.index("--port") + 1]), os.path.join(a.out, name + ".log"))

    def llama_server(t):
        port = free_port()
        cmd = [a.llama_server, "-m", a.model, "-c", str(a.parallel * a.ctx), "-np", str(a.parallel), "-t", str(a.threads),
               "-fa", "on", "-ctk", t, "-ctv", t, "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
        return Server("llama", "llama-server " + t, cmd, port, os.path.join(a.out, "llama_" + t + ".log"))

    servers = []
    try:
        # kvq f16 first, without a budget: its pool (every slot at -c) is the budget of all the others
        ref = kvq_server("f16", None, devices[0])
        servers.append(ref)
        ref.start()
        ref.wait_ready(a.startup_timeout)
        m = metrics_kvq(ref.port)
        budget_bytes = int(m["kvq_kv_budget_bytes"])
        # 1 KiB above the f16 pool, so that the GiB figure read back as bytes never loses a page
        budget_gib = (budget_bytes + 1024) / 2**30
        for dev in devices:
            for spec in kvq_types:
                if spec != "f16" or dev != devices[0]:
                    servers.append(kvq_server(spec, budget_gib, dev))
        for var in variants:
            for spec in var["types"]:
                servers.append(kvq_server(spec, budget_gib, devices[0], var["binary"], var["args"], var["name"]))
        for t in llama_types:
            servers.append(llama_server(t))
        for s in servers[1:]:
            s.start()
        for s in servers[1:]:
            s.wait_ready(a.startup_timeout)
        print(f"[bench] {len(servers)} servers ready in {time.monotonic() - t_start:.1f} s; KV budget {budget_bytes} bytes "
              f"({budget_bytes / 2**30:.3f} GiB)", flush=True)

        # capacity at the budget, and what each server holds
        info = {}
        for s in servers:
            d = {"label": s.label, "kind": s.kind, "cmd": s.cmd}
            if s.kind == "kvq":
                mm = metrics_kvq(s.port)
                page_tokens, pages = int(mm["kvq_kv_page_tokens"]), int(mm["kvq_kv_pages_total"])
                page_bytes = mm["kvq_kv_budget_bytes"] / pages
                per_seq = math.ceil(a.capacity_ctx / page_tokens) * page_bytes
                d.update(page_tokens=page_tokens, pages_total=pages, page_bytes=page_bytes,
                         bytes_per_token=page_bytes / page_tokens, pool_bytes=int(mm["kvq_kv_budget_bytes"]),
                         capacity=int(budget_bytes // per_seq), prefix_reuse=None)
            else:
                t = s.label.split()[-1]
                bpc = llama_bytes_per_cell(a.model, t, t)
                cells = a.parallel * a.ctx
                props = request_json(s.port, "GET", "/props")
                d.update(bytes_per_token=bpc, cells=cells, pool_bytes=int(round(bpc * cells)), total_slots=props.get("total_slots"),
                         slot_ctx=(props.get("default_generation_settings") or {}).get("n_ctx"),
                         capacity=int(budget_bytes // (a.capacity_ctx * bpc)))
            info[s.label] = d

        # warm-up: one short request each (page faults, first-touch of the weights and the cache)
        warm = make_prompts(ref.port, 1, a.prompt_tokens, 999)
        for s in servers:
            r = stream_completion(s.port, warm[0], 8, a.request_timeout)
            if r["error"]:
                raise RuntimeError(f"{s.label}: warm-up request failed: {r['error']}\n{tail(s.log_path)}")

        # interleaved rounds
        runs = []  # one entry per (round, clients, server)
        round_s = []
        for rnd in range(-a.warmup_rounds, a.rounds):
            warmup = rnd < 0
            if rnd > 0 and time.monotonic() - t_start + max(round_s) > a.time_limit:
                print(f"[bench] stopping after {rnd} rounds (--time-limit {a.time_limit:.0f} s)", flush=True)
                break
            t_round = time.monotonic()
            for c in clients:
                n_req = c * max(a.requests_per_client, 3 if c == 1 else 1)
                prompts = make_prompts(ref.port, n_req, a.prompt_tokens, (rnd + 1000 if warmup else rnd) * 100 + c)
                order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
                for s in order:
                    results, wall = run_level(s.port, prompts, c, a.max_tokens, a.request_timeout, a.clients_as)
                    errors = [r["error"] for r in results if r["error"]]
                    n_tok = sum(r["n_tokens"] or 0 for r in results if not r["error"])
                    ttft = [r["chunks"][0] - r["t_send"] for r in results if not r["error"] and r["chunks"]]
                    itl = [b - a_ for r in results if not r["error"] for a_, b in zip(r["chunks"], r["chunks"][1:])]
                    short = [r["n_tokens"] for r in results if not r["error"] and r["n_tokens"] != a.max_tokens]
                    run = {"round": rnd, "clients": c, "server": s.label, "requests": n_req, "errors": errors,
                           "generated_tokens": n_tok, "wall_s": wall, "tok_per_s": n_tok / wall, "ttft_s": ttft, "itl_s": itl,
                           "chunks": sum(len(r["chunks"]) for r in results if not r["error"]),
                           "not_max_tokens": short, "first_text": results[0]["text"] if results and results[0] else ""}
                    if warmup:
                        if errors:
                            raise RuntimeError(f"{s.label}: warm-up round failed: {errors[0]}\n{tail(s.log_path)}")
                        print(f"[bench] warm-up round {rnd + a.warmup_rounds} clients {c:2d} {s.label}: "
                              f"{n_tok / wall:8.1f} tok/s (not counted)", flush=True)
                        continue
                    runs.append(run)
                    print(f"[bench] round {rnd} clients {c:2d} {s.label:28s} {n_tok / wall:8.1f} tok/s  "
                          f"TTFT p50 {pct(ttft, 50) * 1e3:7.1f} ms  ITL p50 {pct(itl, 50) * 1e3:6.1f} p99 {pct(itl, 99) * 1e3:7.1f} ms"
                          + (f"  {len(errors)} errors: {errors[0]}" if errors else ""), flush=True)
            if not warmup:
                round_s.append(time.monotonic() - t_round)

        for s in servers:
            if s.kind == "kvq":
                mm = metrics_kvq(s.port)
                info[s.label]["pages_in_use_after"] = int(mm["kvq_kv_pages_in_use"])
                info[s.label]["prefix_cache_hits"] = int(mm.get("kvq_prefix_cache_hits_total", 0))
    finally:
        for s in servers:
            s.stop()

    # ---- summary ----
    summary = []
    for c in clients:
        for s in servers:
            rs = [r for r in runs if r["clients"] == c and r["server"] == s.label]
            if not rs:
                continue
            ttft = [x for r in rs for x in r["ttft_s"]]
            itl = [x for r in rs for x in r["itl_s"]]
            tps = [r["tok_per_s"] for r in rs]
            summary.append({"clients": c, "server": s.label, "rounds": len(rs), "tok_per_s_median": statistics.median(tps),
                            "tok_per_s": tps, "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
                            "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
                            "tokens_per_chunk": sum(r["generated_tokens"] for r in rs) / max(1, sum(r["chunks"] for r in rs)),
                            "errors": sum(len(r["errors"]) for r in rs),
                            "requests_not_max_tokens": sum(len(r["not_max_tokens"]) for r in rs)})

    config = {k: v for k, v in vars(a).items()}
    config.update(budget_bytes=budget_bytes, rounds_done=len(round_s), round_s=round_s,
                  elapsed_s=time.monotonic() - t_start, host_cpus=os.cpu_count(), load_avg=os.getloadavg())
    try:
        with open("/proc/cpuinfo") as f:
            config["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    except OSError:
        config["cpu"] = "?"
    try:
        config["kvq_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        pass
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"config": config, "servers": info, "summary": summary, "runs": runs}, f, indent=1)

    md = []
    md.append(f"Model {os.path.basename(a.model)}, --parallel {a.parallel}, {a.ctx} tokens per slot, -t {a.threads}, "
              f"prompts of {a.prompt_tokens} tokens, {a.max_tokens} generated (greedy, ignore_eos, streamed), "
              f"{len(round_s)} interleaved rounds"
              + (f" after {a.warmup_rounds} unmeasured warm-up rounds" if a.warmup_rounds else "") + f", KV budget {budget_bytes / 2**30:.3f} GiB "
              f"({a.parallel} x {a.ctx} tokens at f16); {config['cpu']}, {os.cpu_count()} CPUs, load average at the end "
              f"{config['load_avg'][0]:.2f}, kvq {config.get('kvq_commit', '?')}.")
    md.append("")
    md.append("| clients | server | tok/s (median of rounds) | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |")
    md.append("| --- | --- | --- | --- | --- | --- |")
    for r in summary:
        md.append(f"| {r['clients']} | {r['server']} | {r['tok_per_s_median']:.1f} ({', '.join(f'{x:.1f}' for x in r['tok_per_s'])}) | "
                  f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['errors']} |")
    md.append("")
    # ratios at the largest client count: kvq formats against llama-server's best
    cmax = max(clients)
    best = max((r for r in summary if r["clients"] == cmax and r["server"].startswith("llama")),
               key=lambda r: r["tok_per_s_median"], default=None)
    if best:
        md.append(f"At {cmax} clients, kvq throughput / {best['server']} (the faster llama-server): " + ", ".join(
            f"{r['server'][4:]} {r['tok_per_s_median'] / best['tok_per_s_median']:.2f}x" for r in summary
            if r["clients"] == cmax and r["server"].startswith("kvq")) + ".")
    one = {r["server"]: r for r in summary if r["clients"] == min(clients)}
    if cmax != min(clients):
        md.append(f"ITL p99 at {cmax} clients / at {min(clients)}: " + ", ".join(
            f"{r['server']} {r['itl_p99_ms'] / one[r['server']]['itl_p99_ms']:.2f}" for r in summary
            if r["clients"] == cmax and r["server"] in one) + ".")
    md.append("")
    md.append(f"| server | KV bytes / token | concurrent {a.capacity_ctx}-token sequences at {budget_bytes / 2**30:.3f} GiB | x f16 |")
    md.append("| --- | --- | --- | --- |")
    def group(d):  # llama, kvq (CPU) or kvq cuda
        return d["kind"] + (" cuda" if d["label"].startswith("kvq cuda ") else "")
    base = {group(d): d["capacity"] for d in info.values() if d["label"].endswith(" f16")}
    for d in info.values():
        b = base.get(group(d)) or 1
        md.append(f"| {d['label']} | {d['bytes_per_token']:.0f} | {d['capacity']} | {d['capacity'] / b:.2f} |")
    md.append("")
    md.append("kvq: budget / (ceil(" + str(a.capacity_ctx) + " / page) x page bytes), page bytes from /metrics "
              "(the pool holds at most --parallel x -c; --capacity-ctx sets the sequence length): page arithmetic only. The "
              "slots' rows outside the pages (exact sink / recent and KIVI residual rows, channel statistics) and the "
              "q8 / q4 staging pages come out of the same budget (docs/server.md, \"KV pages\"), so a server admits somewhat "
              "fewer (docs/perf.md's capacity table). "
              "llama-server: budget / (" + str(a.capacity_ctx) + " x bytes per cell: GGUF shapes x ggml type sizes), "
              "one slot of " + str(a.capacity_ctx) + " cells per sequence.")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"[bench] {time.monotonic() - t_start:.0f} s; wrote {a.out}/results.md and results.json", flush=True)
    bad = sum(r["errors"] for r in summary)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
