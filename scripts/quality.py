#!/usr/bin/env python3
"""Perplexity / KL-divergence tables of every kvq KV-cache format beside llama.cpp's golden rows.

usage: scripts/quality.py --kvq build/kvq [--out docs/quality.md] [--formats q8,q4,...]
                          [--texts tinylit-heldout,...] [--chunks N] [--threads 2] [--data DIR]

For each text: ONE f16-cache base run writes its log-probs (`kvq perplexity --kl-base FILE`, into
a temporary folder), then each format is compared with it (`--kl-compare FILE`), so the base is
evaluated once, not once per format. Every run is `kvq perplexity ... --json`; its object is kept
in a results file (default: the --out path with .json) keyed by text and format, so a later run
with --formats/--texts re-measures only those rows and the tables are redrawn from all stored rows
(each table names the commits its rows come from).

The Markdown tables go into --out between the markers
    <!-- quality.py:begin -->  ...  <!-- quality.py:end -->
and the text around them is kept (a new file gets a title and the markers). Both files are written
atomically (temp file + rename). Protocol (golden/tinylit-hd64-gqa4/README.md): -c 512, 200 chunks
of the held-out novels, 100 of TinyStories and WikiText-2; stories260K on TinyStories at -c 512.
--chunks N overrides every chunk count (a quick draft; the tables say so). Standard library only.

--real: the real-model tables (Qwen2.5-Coder-0.5B, Gemma 3 270M; issue 14 point 4), in their own
marked region and results file: see scripts/quality_real.py. For example
    scripts/quality.py --real --kvq build/kvq --threads 1 --jobs 2 --base-dir /tmp/kvq_kld
    scripts/quality.py --real --kvq build/kvq --threads 1 --jobs 2 --greedy
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

BEGIN, END = "<!-- quality.py:begin -->", "<!-- quality.py:end -->"

# key, flags (after -m/-f). K and V the same type unless the flags say otherwise.
FORMATS = [
    ("f16", ["-ctk", "f16", "-ctv", "f16"]),
    ("bf16", ["-ctk", "bf16", "-ctv", "bf16"]),
    ("q8", ["-ctk", "q8", "-ctv", "q8"]),
    ("q8+hadamard", ["-ctk", "q8", "-ctv", "q8", "--kv-rot", "hadamard"]),
    ("q8a", ["-ctk", "q8a", "-ctv", "q8a"]),
    ("q4", ["-ctk", "q4", "-ctv", "q4"]),
    ("q4a", ["-ctk", "q4a", "-ctv", "q4a"]),
    ("q3", ["-ctk", "q3", "-ctv", "q3"]),
    ("q2", ["-ctk", "q2", "-ctv", "q2"]),
    ("kivi8", ["-ctk", "kivi8", "-ctv", "kivi8"]),
    ("kivi4", ["-ctk", "kivi4", "-ctv", "kivi4"]),
    ("kivi2", ["-ctk", "kivi2", "-ctv", "kivi2"]),
    ("K q8 / V q4", ["-ctk", "q8", "-ctv", "q4"]),
    ("K kivi4 g64 / V q4", ["-ctk", "kivi4", "-ctv", "q4", "--kv-kivi-group", "64"]),
    ("K kivi4 g64 / V q4 (srht)", ["-ctk", "kivi4", "-ctv", "q4", "--kv-kivi-group", "64", "--kv-rot", "srht"]),
    # option sets that matter on real models (Qwen2.5's K bias offset, docs/quality.md)
    ("q8 (K channel scale off)", ["-ctk", "q8", "-ctv", "q8", "--kv-k-channel-scale", "off"]),
    ("q8a (K channel scale off)", ["-ctk", "q8a", "-ctv", "q8a", "--kv-k-channel-scale", "off"]),
    ("q4 (K channel scale off)", ["-ctk", "q4", "-ctv", "q4", "--kv-k-channel-scale", "off"]),
    ("q4 rot none", ["-ctk", "q4", "-ctv", "q4", "--kv-rot", "none"]),
    ("q4 + channel scale", ["-ctk", "q4", "-ctv", "q4", "--kv-channel-scale"]),
    ("q4 sink 4 recent 32", ["-ctk", "q4", "-ctv", "q4", "--kv-sink", "4", "--kv-exact-recent", "32"]),
    ("K q4 / V q8", ["-ctk", "q4", "-ctv", "q8"]),
    ("K q4 / V f16", ["-ctk", "q4", "-ctv", "f16"]),
    ("K f16 / V q4", ["-ctk", "f16", "-ctv", "q4"]),
    ("K kivi4 g64 / V q3", ["-ctk", "kivi4", "-ctv", "q3", "--kv-kivi-group", "64"]),
    ("K q4 / V q3", ["-ctk", "q4", "-ctv", "q3"]),
    ("q3a", ["-ctk", "q3a", "-ctv", "q3a"]),
    ("q3 + channel scale", ["-ctk", "q3", "-ctv", "q3", "--kv-channel-scale"]),
]
BASE = "f16"

TINYLIT = "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf"
STORIES = "models/stories260K/stories260K.gguf"
HELDOUT = "data/tinylit-hd64-gqa4-heldout/heldout.txt"
TINYSTORIES = "data/tinystories-val-794k/tinystories_val.txt"
WIKITEXT = "data/wikitext-2-raw-test/wiki.test.raw"

# key, title, model, text, n_ctx, chunks, golden (kind, dataset)
TEXTS = [
    ("tinylit-heldout", "tinylit-hd64-gqa4, held-out novels (in-domain, primary)", TINYLIT, HELDOUT, 512, 200,
     ("tinylit", "heldout")),
    ("tinylit-tinystories", "tinylit-hd64-gqa4, TinyStories validation (off-domain)", TINYLIT, TINYSTORIES, 512, 100,
     ("tinylit", "tinystories")),
    ("tinylit-wikitext2", "tinylit-hd64-gqa4, WikiText-2 test (off-domain)", TINYLIT, WIKITEXT, 512, 100,
     ("tinylit", "wikitext2")),
    ("stories260K-tinystories", "stories260K (head_dim 8), TinyStories validation", STORIES, TINYSTORIES, 512, 100,
     ("stories260K", "tinystories")),
]

# llama.cpp KV types: bits per element (block of 32: q8_0 34 B, q5_1 24, q5_0 22, q4_1 20, q4_0/iq4_nl 18).
LLAMA_BITS = {"f16": 16.0, "bf16": 16.0, "f32": 32.0, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0,
              "q4_0": 4.5, "iq4_nl": 4.5}

# Issue 3 targets on the held-out text, at llama.cpp's bytes per token.
TARGETS = [("q4", 4.5, 0.0071, 95.0), ("K kivi4 g64 / V q4", 4.5, 0.0071, 95.0),
           ("K kivi4 g64 / V q4 (srht)", 4.5, 0.0071, 95.0), ("q8", 8.5, 6e-5, 99.5),
           ("q8+hadamard", 8.5, 6e-5, 99.5)]


def model_text(args):
    """The text entry of --model/--golden: the golden file names the text, n_ctx and chunk count
    (its meta and datasets); the key is the model file's name plus the dataset."""
    g = json.load(open(args.golden))
    ds = args.dataset or sorted(g["datasets"])[0]
    if ds not in g["datasets"]:
        sys.exit("quality.py: golden file %s has no dataset '%s' (has: %s)" % (args.golden, ds, ", ".join(g["datasets"])))
    stem = os.path.splitext(os.path.basename(args.model))[0]
    title = "%s, %s (golden: %s)" % (stem, ds, os.path.relpath(args.golden, data_path(args)).replace("../", "")
                                     if args.golden.startswith(data_path(args)) else os.path.basename(args.golden))
    return ("%s-%s" % (stem, ds), title, os.path.abspath(args.model), g["datasets"][ds]["text"],
            int(g["meta"].get("n_ctx", 512)), int(golden_chunks(g, ds)), ("file", (os.path.abspath(args.golden), ds)))


def golden_chunks(g, ds):
    """Chunk count of a golden file: its meta's, else its f16 base row's."""
    return g["meta"].get("chunks") or next(
        (r.get("n_chunks") for r in g["datasets"][ds]["results"] if r["config"] == "f16_fa-on"), None)


def stored_texts(results):
    """Text entries run earlier with --model/--golden (their spec is kept in the results file)."""
    out = []
    for key, t in sorted(results.get("texts", {}).items()):
        sp = t.get("spec")
        if sp:
            out.append((key, sp["title"], sp["model"], sp["text"], sp["n_ctx"], sp["chunks"],
                        ("file", tuple(sp["golden"]))))
    return out


def log(msg):
    print("[quality] " + msg, file=sys.stderr, flush=True)


def write_atomic(path, text):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def git(repo, *args):
    try:
        return subprocess.run(["git", "-C", repo] + list(args), capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def build_state(repo):
    """Commit (KVQ_COMMIT overrides it, for a copy without .git), and the uncommitted changes that
    can reach the binary (sources, headers, CMake)."""
    commit = os.environ.get("KVQ_COMMIT") or git(repo, "rev-parse", "--short", "HEAD") or "unknown"
    dirty = []
    for line in git(repo, "status", "--porcelain").splitlines():
        path = line[3:]
        if path.startswith(("src/", "include/", "tools/", "CMakeLists")) and not path.startswith("src/cuda/"):
            dirty.append(path)
    return commit, dirty


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return "%s, %d CPUs visible (%s)" % (cpu, os.cpu_count() or 0, platform.system())


def run_json(cmd):
    """Runs a kvq command that prints --json: (result, None, seconds), or (None, its last stderr line, seconds)."""
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.time() - t0
    if p.returncode != 0:
        lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
        return None, (lines[-1] if lines else "exit %d" % p.returncode), dt
    return json.loads(p.stdout), None, dt


def run_kvq(kvq, args, threads):
    return run_json([kvq, "perplexity"] + args + ["-t", str(threads), "--json", "--no-progress"])


# ---------------------------------------------------------------- golden rows (llama.cpp)

def golden_rows(data, kind, dataset, n_chunks):
    """llama.cpp rows as dicts: config, bits, ppl, ppl_err, dppl_pct, kld, p99, top1, chunks, note.
    kind "file": dataset is (path of a golden perplexity.json, dataset key), as --golden gives."""
    rows = []
    if kind == "file":
        path, ds = dataset
        path = path if os.path.isabs(path) else os.path.join(data, path)
        if not os.path.exists(path):
            return rows, None
        g = json.load(open(path))
        res = g["datasets"][ds]["results"]
        mc = golden_chunks(g, ds)
        base = next(r for r in res if r["config"] == "f16_fa-on" and (r.get("n_chunks") or mc) == mc)
        for r in res:
            if (r.get("n_chunks") or mc) != mc:
                continue  # rows of another chunk count (a draft run in the same file)
            rows.append(golden_row(r, base, mc))
        return rows, base
    if kind == "tinylit":
        path = os.path.join(data, "golden/tinylit-hd64-gqa4/perplexity.json")
        if not os.path.exists(path):
            return rows, None
        g = json.load(open(path))
        res = g["datasets"][dataset]["results"]
        base = next(r for r in res if r["config"] == "f16_fa-on")
        for r in res:
            rows.append(golden_row(r, base, r.get("n_chunks") or g["meta"]["chunks"]))
        return rows, base
    if kind == "stories260K":
        path = os.path.join(data, "golden/stories260K/perplexity_%s.json" % dataset)
        if not os.path.exists(path):
            return rows, None
        g = json.load(open(path))
        res = [r for r in g["results"] if r["n_ctx"] == 512 and r["config"] in
               ("f16_fa-on", "f16_fa-on-self-kld", "bf16_fa-on")]
        base = next(r for r in res if r["config"] == "f16_fa-on")
        for r in res:
            rows.append(golden_row(r, base, r.get("n_chunks")))
        # llama.cpp's running PPL after the same number of chunks as kvq (full base log).
        logp = os.path.join(data, "golden/stories260K/logs/perplexity_%s" % dataset, base.get("log", ""))
        if os.path.isfile(logp) and n_chunks:
            s = open(logp, errors="replace").read()
            key = "[%d]" % n_chunks
            at = s.find(key)
            if at >= 0:
                v = float(s[at + len(key):].split(",", 1)[0])
                rows.append({"config": "f16_fa-on, running PPL after %d chunks (base log)" % n_chunks,
                             "type": "f16", "bits": 16.0, "ppl": v, "ppl_err": None, "dppl_pct": None, "kld": None,
                             "p99": None, "top1": None, "chunks": n_chunks, "base": True})
        return rows, base
    return rows, None


def golden_row(r, base, chunks):
    cfg = r["config"]
    typ = cfg.split("_fa")[0]
    is_base = cfg == "f16_fa-on"
    bits = LLAMA_BITS.get(typ)
    if bits is None and r.get("type_k") in LLAMA_BITS and r.get("type_v") in LLAMA_BITS:  # K and V differ
        bits = (LLAMA_BITS[r["type_k"]] + LLAMA_BITS[r["type_v"]]) / 2.0
    return {"config": cfg + (" (base)" if is_base else ""), "type": typ, "bits": bits,
            "ppl": r.get("ppl"), "ppl_err": r.get("ppl_err"),
            "dppl_pct": None if is_base else 100.0 * (r["ppl"] / base["ppl"] - 1.0),
            "kld": r.get("kld_mean"), "kld_err": r.get("kld_mean_err"), "p99": r.get("kld_p99"),
            "top1": r.get("same_top_p_pct"), "chunks": chunks or r.get("n_chunks"), "base": is_base}


# ---------------------------------------------------------------- formatting

def f_num(v, fmt):
    return "—" if v is None else fmt % v


def f_kld(v):
    if v is None:
        return "—"
    if v == 0:
        return "0"
    return "%.2e" % v if abs(v) < 1e-3 else "%.5f" % v


def kvq_bits(j):
    elems = j["kv_bytes_per_token_f16"] / 2.0  # f16: 2 bytes per element
    return 8.0 * j["kv_bytes_per_token"] / elems, elems


def render_text(tkey, title, n_ctx, chunks, rows, golden, elems, fmt_flags):
    out = ["### %s" % title, ""]
    base = rows.get(BASE)
    bj = base["result"] if base and base.get("result") else None
    gbase = next((g for g in golden if g.get("base") and g["chunks"] == chunks), None) or \
        next((g for g in golden if g.get("base")), None)
    if bj:
        line = ("`-c %d --chunks %d`: %d chunks, %d scored tokens of %d. kvq f16 PPL %.4f ± %.4f"
                % (n_ctx, chunks, bj["n_chunk"], bj["n_scored"], bj["n_tokens"], bj["ppl"], bj["ppl_err"]))
        if gbase and gbase["chunks"] == bj["n_chunk"]:
            line += ", llama.cpp %.4f (%+.3f %%)" % (gbase["ppl"], 100 * (bj["ppl"] / gbase["ppl"] - 1))
        out += [line + ".", ""]
    tops = {r["result"]["kld"].get("top_k", 0) for r in rows.values() if r.get("result") and r["result"].get("kld")}
    if any(tops):
        out += ["kvq's KLD on this text is over the base's top-%s tokens plus one bucket for the rest of the "
                "vocabulary (`--kl-top-k`, a lower bound of the full KL); llama.cpp's is over the full vocabulary."
                % "/".join(str(t) for t in sorted(tops) if t), ""]
    commits = sorted({r.get("commit", "?") for r in rows.values()})
    out += ["kvq rows from commit %s." % ", ".join("`%s`" % c for c in commits), ""]

    table = []
    for key, _ in FORMATS:
        r = rows.get(key)
        if not r:
            continue
        if r.get("error"):
            table.append((99, 0, ["kvq", key, "—", "—", "refused: `%s`" % r["error"].replace("|", "/"),
                                  "", "", "", ""]))
            continue
        j = r["result"]
        bits, _ = kvq_bits(j)
        k = j.get("kld")
        if key == BASE:
            cells = ["kvq", "**f16 (base)**", "%.2f" % bits, "%.0f" % j["kv_bytes_per_token"],
                     "%.4f ± %.4f" % (j["ppl"], j["ppl_err"]), "—", "—", "—", "—"]
            kld_sort = -1
        else:
            cells = ["kvq", "**%s**" % key, "%.2f" % bits, "%.0f" % j["kv_bytes_per_token"],
                     "%.4f ± %.4f" % (j["ppl"], j["ppl_err"]),
                     "%+.3f ± %.3f" % (k["dppl_pct"], k["dppl_err"]) if k else "—",
                     "%s ± %s" % (f_kld(k["mean"]), f_kld(k["mean_err"])) if k else "—",
                     f_kld(k["p99"]) if k else "—",
                     "%.3f" % k["same_top1_pct"] if k else "—"]
            kld_sort = k["mean"] if k else 1e9
        table.append((-bits, kld_sort, cells))
    for g in golden:
        if g["bits"] is None:
            continue
        same = g["chunks"] == chunks
        note = "" if same else " (%s chunks)" % g["chunks"]
        cells = ["llama.cpp", g["config"] + note, "%.2f" % g["bits"],
                 "%.0f" % (g["bits"] * elems / 8.0) if elems else "—",
                 ("%.4f ± %.4f" % (g["ppl"], g["ppl_err"])) if g.get("ppl_err") else f_num(g["ppl"], "%.4f"),
                 f_num(g["dppl_pct"], "%+.3f"), f_kld(g["kld"]), f_kld(g["p99"]), f_num(g["top1"], "%.3f")]
        table.append((-g["bits"], -1 if g.get("base") else (g["kld"] if g["kld"] is not None else 1e9), cells))
    table.sort(key=lambda t: (t[0], t[1]))
    out += ["| engine | KV config | bits/elem | KV bytes/token | PPL ± err | ΔPPL % | mean KLD | p99 KLD | same top-1 % |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += ["| " + " | ".join(c) + " |" for _, _, c in table]
    out.append("")

    # Equal bytes: for each quantized llama.cpp type, the best kvq format at no more bytes.
    eq = []
    for g in golden:
        if g["kld"] is None or g.get("base") or g["bits"] is None or g["bits"] >= 16 or "norot" in g["config"]:
            continue
        best = None
        for key, _ in FORMATS:
            r = rows.get(key)
            if key == BASE or not r or not r.get("result") or not r["result"].get("kld"):
                continue
            bits, _ = kvq_bits(r["result"])
            if bits <= g["bits"] + 1e-9:
                k = r["result"]["kld"]
                if best is None or k["mean"] < best[2]["mean"]:
                    best = (key, bits, k)
        if best:
            key, bits, k = best
            eq.append("| %s | %.2f | %s | %.3f | **%s** | %.2f | %s | %.3f | %.2fx |" % (
                g["config"], g["bits"], f_kld(g["kld"]), g["top1"], key, bits, f_kld(k["mean"]),
                k["same_top1_pct"], g["kld"] / k["mean"] if k["mean"] > 0 else float("inf")))
    if eq:
        out += ["Equal bytes: for each llama.cpp type, the kvq format with the lowest mean KLD at no more bits per "
                "element.", "",
                "| llama.cpp | bits | mean KLD | top-1 % | best kvq at <= bits | bits | mean KLD | top-1 % | "
                "KLD llama.cpp / kvq |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + eq + [""]
    return out


def render(results, args, data, chunk_override):
    commit, dirty = build_state(args.repo)
    out = [BEGIN, ""]
    meta = results.get("meta", {})
    out += ["Generated by `scripts/quality.py` (%s). Machine: %s. Last run: commit `%s`%s, command `%s`."
            % (meta.get("date", "?"), meta.get("machine", "?"), meta.get("commit", "?"),
               (" plus uncommitted changes in " + ", ".join("`%s`" % d for d in meta.get("dirty", [])))
               if meta.get("dirty") else "", meta.get("command", "?")), ""]
    if any(t.get("chunks_override") for t in results.get("texts", {}).values()):
        out += ["**Draft: some texts were run with fewer chunks than the protocol (`--chunks`).**", ""]
    out += ["bits/elem = KV bytes per token x 8 / (2 x n_layer x n_kv_head x head_dim); llama.cpp's bytes are its "
            "block sizes (q8_0 8.5 bits, q5_1 6, q5_0 5.5, q4_1 5, q4_0 and iq4_nl 4.5). KLD in nats, KL(f16 base || "
            "format) per scored token; kvq ΔPPL is paired (per-token NLL difference), llama.cpp's is the ratio of "
            "its two PPLs. llama.cpp quantized rows include its Hadamard rotation unless marked `_norot`; its KLD "
            "comes from a uint16 file (resolution ~5e-5 nats), kvq's is exact (full 512-token vocabulary).", ""]
    # Legend: what each format key ran, as the kvq cache describes itself on the primary text
    # (tinylit, head_dim 64: groups of 32; stories260K's head_dim 8 gives groups of 8).
    legend = {}
    texts = results.get("texts", {})
    for t in sorted(texts.values(), key=lambda t: 0 if t is texts.get("tinylit-heldout") else 1):
        for key, r in t.get("rows", {}).items():
            if r.get("result") and key not in legend:
                legend[key] = (r["flags"], r["result"]["kv_cache"])
    if legend:
        out += ["| format | flags | kvq cache (as it describes itself) |", "| --- | --- | --- |"]
        for key, _ in FORMATS:
            if key in legend:
                out.append("| %s | `%s` | %s |" % (key, " ".join(legend[key][0]), legend[key][1]))
        out.append("")

    for tkey, title, model, text, n_ctx, chunks, (gkind, gset) in TEXTS + stored_texts(results):
        t = results.get("texts", {}).get(tkey)
        if not t:
            continue
        ch = t.get("chunks", chunks)
        golden, _ = golden_rows(data, gkind, gset, ch)
        elems = None
        for r in t["rows"].values():
            if r.get("result"):
                elems = kvq_bits(r["result"])[1]
                break
        out += render_text(tkey, title, n_ctx, ch, t["rows"], golden, elems, None)

    # Issue 3 targets (held-out text).
    t = results.get("texts", {}).get("tinylit-heldout")
    if t:
        out += ["### Quality targets of the compressed cache (held-out text, at llama.cpp's bytes per token)", "",
                "| kvq format | bits | target | mean KLD | same top-1 % | met |", "| --- | --- | --- | --- | --- | --- |"]
        for key, bits, kmax, tmin in TARGETS:
            r = t["rows"].get(key)
            if not r or not r.get("result") or not r["result"].get("kld"):
                continue
            k = r["result"]["kld"]
            b, _ = kvq_bits(r["result"])
            ok_k, ok_t = k["mean"] <= kmax, k["same_top1_pct"] >= tmin
            met = "yes" if ok_k and ok_t else "no (%s)" % ", ".join(
                x for x, bad in (("KLD", not ok_k), ("top-1", not ok_t)) if bad)
            out.append("| %s | %.2f | KLD <= %s, top-1 >= %.1f %% | %s | %.3f | %s |" % (
                key, b, f_kld(kmax), tmin, f_kld(k["mean"]), k["same_top1_pct"], met))
        if t.get("chunks_override"):
            out.append("")
            out.append("(draft chunk count: not the protocol's 200 chunks)")
        out.append("")
    out.append(END)
    return "\n".join(out) + "\n"


def splice(path, block):
    if os.path.exists(path):
        s = open(path).read()
        if BEGIN in s and END in s:
            return s[:s.index(BEGIN)] + block.rstrip("\n") + s[s.index(END) + len(END):]
        return s.rstrip("\n") + "\n\n" + block
    return "# KV-cache quality: perplexity and KL divergence\n\n" + block


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvq", required=True, help="path of the kvq binary")
    ap.add_argument("--out", default=os.path.join(repo, "docs", "quality.md"), help="Markdown file to update")
    ap.add_argument("--results", help="JSON results store (default: --out with .json)")
    ap.add_argument("--formats", help="comma-separated subset of: " + ", ".join(k for k, _ in FORMATS))
    ap.add_argument("--texts", help="comma-separated subset of: " + ", ".join(t[0] for t in TEXTS))
    ap.add_argument("--chunks", type=int, help="override every text's chunk count (draft)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=os.environ.get("KVQ_DATA_DIR") or os.path.join(repo, "..", "shared"))
    ap.add_argument("--render-only", action="store_true", help="redraw the tables from the results file")
    ap.add_argument("--model", help="a GGUF model to measure instead of the built-in texts (with --golden)")
    ap.add_argument("--golden", help="llama.cpp golden perplexity.json of --model: gives the text, -c, the "
                    "chunk count and llama.cpp's rows")
    ap.add_argument("--dataset", help="dataset key of --golden (default: its first)")
    ap.add_argument("--base-dir", help="keep the f16 base log-prob files here and reuse one that exists "
                    "(its stored base row must have the same chunk count) instead of re-running the base")
    ap.add_argument("--real", action="store_true", help="the real-model tables instead (scripts/quality_real.py): "
                    "Qwen2.5-Coder-0.5B and Gemma 3 270M from --models-dir, results in docs/quality_real.json; "
                    "--formats then takes keys separated by ';'")
    ap.add_argument("--models", help="--real: comma-separated subset of the real models")
    ap.add_argument("--models-dir", default=os.path.join(repo, "models"), help="--real: folder of the GGUF files "
                    "(scripts/fetch-models.sh)")
    ap.add_argument("--greedy", action="store_true", help="--real: greedy 64-token agreement with the f16 cache "
                    "instead of perplexity")
    ap.add_argument("--jobs", type=int, default=1, help="--real: kvq runs at a time (each with --threads)")
    args = ap.parse_args()
    args.repo = repo
    if args.real:
        import quality_real
        quality_real.main(args)
        return
    if bool(args.model) != bool(args.golden):
        sys.exit("quality.py: --model and --golden go together")
    if args.model and not os.path.exists(args.model):
        sys.exit("quality.py: model '%s' not found (scripts/fetch-models.sh)" % args.model)
    kvq = os.path.abspath(args.kvq)
    if not args.render_only and not os.access(kvq, os.X_OK):
        sys.exit("quality.py: kvq binary '%s' not found or not executable" % args.kvq)
    results_path = args.results or os.path.splitext(args.out)[0] + ".json"
    results = json.load(open(results_path)) if os.path.exists(results_path) else {"texts": {}}

    fmt_keys = [k for k, _ in FORMATS]
    want_f = fmt_keys if not args.formats else [x.strip() for x in args.formats.split(",") if x.strip()]
    bad = [f for f in want_f if f not in fmt_keys]
    if bad:
        sys.exit("quality.py: unknown format(s) %s; known: %s" % (bad, ", ".join(fmt_keys)))
    texts = TEXTS + stored_texts(results)
    if args.model:
        mt = model_text(args)
        texts = [t for t in texts if t[0] != mt[0]] + [mt]
    text_keys = [t[0] for t in texts]
    want_t = text_keys if not args.texts else [x.strip() for x in args.texts.split(",") if x.strip()]
    if args.model:
        want_t = [mt[0]]
    bad = [t for t in want_t if t not in text_keys]
    if bad:
        sys.exit("quality.py: unknown text(s) %s; known: %s" % (bad, ", ".join(text_keys)))

    if not args.render_only:
        commit, dirty = build_state(repo)
        flags_of = dict(FORMATS)
        t_all = time.time()
        with tempfile.TemporaryDirectory(prefix="kvq_quality_") as tmp:
            for tkey, title, model, text, n_ctx, chunks, gold in texts:
                if tkey not in want_t:
                    continue
                mp, tp = os.path.join(data_path(args), model), os.path.join(data_path(args), text)
                if not (os.path.exists(mp) and os.path.exists(tp)):
                    log("%s: skipped, missing %s or %s" % (tkey, mp, tp))
                    continue
                ch = args.chunks or chunks
                common = ["-m", mp, "-f", tp, "-c", str(n_ctx), "--chunks", str(ch)]
                base_file = os.path.join(args.base_dir or tmp, tkey + ".kld")
                tstore = results.setdefault("texts", {}).get(tkey)
                if not tstore or tstore.get("chunks") != ch:
                    tstore = {"rows": {}}  # another chunk count: old rows no longer compare
                tstore.update({"chunks": ch, "n_ctx": n_ctx, "chunks_override": ch != chunks})
                if gold[0] == "file":  # a --model/--golden text: keep its spec for later renders
                    tstore["spec"] = {"title": title, "model": model, "text": text, "n_ctx": n_ctx,
                                      "chunks": chunks, "golden": list(gold[1])}
                results["texts"][tkey] = tstore
                if args.base_dir and os.path.exists(base_file) and tstore["rows"].get(BASE, {}).get("result"):
                    j, err, dt = tstore["rows"][BASE]["result"], None, tstore["rows"][BASE].get("seconds", 0)
                    log("%s: base f16 reused from %s" % (tkey, base_file))
                else:
                    j, err, dt = run_kvq(kvq, common + flags_of[BASE] + ["--kl-base", base_file], args.threads)
                    log("%s: base f16 %.1f s%s" % (tkey, dt, " FAILED: " + err if err else ", PPL %.4f" % j["ppl"]))
                if err:
                    tstore["rows"][BASE] = {"flags": flags_of[BASE], "error": err, "commit": commit}
                    continue
                tstore["rows"][BASE] = {"flags": flags_of[BASE], "result": j, "commit": commit, "seconds": dt}
                for key in want_f:
                    if key == BASE:
                        continue
                    j, err, dt = run_kvq(kvq, common + flags_of[key] + ["--kl-compare", base_file], args.threads)
                    if err:
                        log("%s: %s refused: %s" % (tkey, key, err))
                        tstore["rows"][key] = {"flags": flags_of[key], "error": err, "commit": commit}
                    else:
                        k = j["kld"]
                        log("%s: %-20s %.1f s  PPL %.4f  KLD %.3g  top-1 %.2f %%" % (
                            tkey, key, dt, j["ppl"], k["mean"], k["same_top1_pct"]))
                        tstore["rows"][key] = {"flags": flags_of[key], "result": j, "commit": commit, "seconds": dt}
                # keep the store in canonical order
                tstore["rows"] = {k: tstore["rows"][k] for k in fmt_keys if k in tstore["rows"]}
                write_atomic(results_path, json.dumps(results, indent=1, sort_keys=True) + "\n")
        cmd = "scripts/quality.py --kvq %s" % os.path.relpath(kvq, repo) + \
            ("" if not args.formats else " --formats '%s'" % args.formats) + \
            ("" if not args.texts else " --texts %s" % args.texts) + \
            ("" if not args.chunks else " --chunks %d" % args.chunks) + \
            ("" if args.threads == 2 else " --threads %d" % args.threads)
        results["meta"] = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                           "commit": commit, "dirty": dirty, "command": cmd,
                           "seconds": round(time.time() - t_all, 1), "threads": args.threads}
        write_atomic(results_path, json.dumps(results, indent=1, sort_keys=True) + "\n")
        log("all runs: %.0f s" % (time.time() - t_all))
    write_atomic(args.out, splice(args.out, render(results, args, data_path(args), args.chunks)))
    log("wrote %s" % args.out + ("" if args.render_only else " and %s" % results_path))


def data_path(args):
    return os.path.abspath(args.data)


if __name__ == "__main__":
    main()
