"""Real-model KV-cache quality (issue 14 point 4): kvq's KV formats and option sets on the GGUF
files of scripts/fetch-models.sh, against an f16 cache of the same build, beside llama.cpp's KV
types from the golden files. Run through `scripts/quality.py --real`; standard library only.

Perplexity (per model): ONE f16 base run writes full-vocabulary log-probs (`kvq perplexity
--kl-base FILE --kl-top-k 0`, so the KLD is over the whole vocabulary like llama.cpp's), then
every format runs `--kl-compare FILE` on the same wikitext-2 chunks (`-c 512`, the first N chunks
of the golden's). With --base-dir the base file and its JSON (FILE.json) are kept and reused.

Greedy (--greedy): `kvq generate --temp 0 --ignore-eos -n 64` for every greedy format on each
golden prompt (generation.json; 4-11 tokens, so the exact windows hold the whole context) and on
long prompts (a wikitext-2 passage of >= 300 tokens followed by the same golden prompt, so the
quantized body is what the new tokens attend to). Per prompt: identical tokens before the first
divergence from the f16 cache's continuation (64 = identical).

Results go to a JSON store (default docs/quality_real.json) keyed by model and format, merged
under a file lock, so runs of other models or formats (also two processes at once) add to it;
the Markdown goes between `<!-- quality.py:real:begin -->` and `<!-- quality.py:real:end -->`.
"""
import concurrent.futures
import datetime
import fcntl
import json
import os
import tempfile
import threading
import time
import zlib

import quality as q

BEGIN, END = "<!-- quality.py:real:begin -->", "<!-- quality.py:real:end -->"
WIKITEXT = "data/wikitext-2-raw-test/wiki.test.raw"

# key: title, model file (under --models-dir), golden folder (under --data), default chunk count.
MODELS = {
    "qwen2.5-coder-0.5b": ("Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, 24 layers, 2 kv heads, head_dim 64)",
                           "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "golden/qwen2.5-coder-0.5b-instruct-q4_k_m", 4),
    "gemma-3-270m": ("Gemma 3 270M Q4_K_M (gemma3, 18 layers, 1 kv head, head_dim 256, sliding window 512)",
                     "gemma-3-270m-q4_k_m.gguf", "golden/gemma-3-270m-q4_k_m", 4),
}

NOTES = {"gemma-3-270m": "KV bytes/token counts the 3 global layers of 18: the 15 sliding-window layers hold a "
                         "fixed 512-token ring (`kvq info` gives both), so bits/elem is that of every layer."}

S4 = ["--kv-sink", "4"]
# key, what it varies, flags. The first block is every kvq KV type with K = V and default options.
FORMATS = [
    ("f16", "base", ["-ctk", "f16", "-ctv", "f16"]),
    ("bf16", "type", ["-ctk", "bf16", "-ctv", "bf16"]),
    ("q8", "type", ["-ctk", "q8", "-ctv", "q8"]),
    ("q8a", "type", ["-ctk", "q8a", "-ctv", "q8a"]),
    ("kivi8", "type", ["-ctk", "kivi8", "-ctv", "kivi8"]),
    ("q4", "type", ["-ctk", "q4", "-ctv", "q4"]),
    ("q4a", "type", ["-ctk", "q4a", "-ctv", "q4a"]),
    ("kivi4", "type", ["-ctk", "kivi4", "-ctv", "kivi4"]),
    ("q3", "type", ["-ctk", "q3", "-ctv", "q3"]),
    ("q3a", "type", ["-ctk", "q3a", "-ctv", "q3a"]),
    ("kivi2", "type", ["-ctk", "kivi2", "-ctv", "kivi2"]),
    ("q2", "type", ["-ctk", "q2", "-ctv", "q2"]),
    ("q2a", "type", ["-ctk", "q2a", "-ctv", "q2a"]),
    # the README's recommendation and its neighbours
    ("kivi4 / q4a sink 4 (recommended)", "K/V", ["-ctk", "kivi4", "-ctv", "q4a"] + S4),
    ("kivi4 / q4 sink 4", "K/V", ["-ctk", "kivi4", "-ctv", "q4"] + S4),
    ("kivi4 / q4", "K/V", ["-ctk", "kivi4", "-ctv", "q4"]),
    # K and V at different bits
    ("q8 / q4", "K/V", ["-ctk", "q8", "-ctv", "q4"]),
    ("q4 / q8", "K/V", ["-ctk", "q4", "-ctv", "q8"]),
    ("f16 / q4", "K/V", ["-ctk", "f16", "-ctv", "q4"]),
    ("q4 / f16", "K/V", ["-ctk", "q4", "-ctv", "f16"]),
    # rotation (default for per-token types: hadamard)
    ("q4 rot none", "rotation", ["-ctk", "q4", "-ctv", "q4", "--kv-rot", "none"]),
    ("q4 rot srht", "rotation", ["-ctk", "q4", "-ctv", "q4", "--kv-rot", "srht"]),
    ("q4 rot srft", "rotation", ["-ctk", "q4", "-ctv", "q4", "--kv-rot", "srft"]),
    # group size along head_dim (default 32)
    ("q4 group 64", "group", ["-ctk", "q4", "-ctv", "q4", "--kv-group", "64"]),
    ("q4 group 16", "group", ["-ctk", "q4", "-ctv", "q4", "--kv-group", "16"]),
    # KIVI group (tokens per K channel group, default 32) and exact residual (default 32)
    ("kivi4 g64 / q4 sink 4", "KIVI", ["-ctk", "kivi4", "-ctv", "q4", "--kv-kivi-group", "64"] + S4),
    ("kivi4 / q4 sink 4 residual 128", "KIVI", ["-ctk", "kivi4", "-ctv", "q4", "--kv-residual", "128"] + S4),
    # channel scale: K (auto on for per-token K) and K + V
    ("q8 K channel scale off", "channel scale", ["-ctk", "q8", "-ctv", "q8", "--kv-k-channel-scale", "off"]),
    ("q4 K channel scale off", "channel scale", ["-ctk", "q4", "-ctv", "q4", "--kv-k-channel-scale", "off"]),
    ("q4 + V channel scale", "channel scale", ["-ctk", "q4", "-ctv", "q4", "--kv-channel-scale"]),
    # exact windows: first tokens (sink) and last tokens
    ("q4 sink 4", "windows", ["-ctk", "q4", "-ctv", "q4"] + S4),
    ("q4 sink 4 recent 32", "windows", ["-ctk", "q4", "-ctv", "q4", "--kv-exact-recent", "32"] + S4),
    # 3-bit candidates (<= 3.5 bits/elem; the screen of docs/quality.md)
    ("q3 sink 4", "3-bit", ["-ctk", "q3", "-ctv", "q3"] + S4),
    ("q3 sink 4 srht", "3-bit", ["-ctk", "q3", "-ctv", "q3", "--kv-rot", "srht"] + S4),
    ("q3 sink 16", "3-bit", ["-ctk", "q3", "-ctv", "q3", "--kv-sink", "16"]),
    ("kivi4 g64 / q2 sink 4", "3-bit", ["-ctk", "kivi4", "-ctv", "q2", "--kv-kivi-group", "64"] + S4),
    ("q4 / q2 sink 4", "3-bit", ["-ctk", "q4", "-ctv", "q2"] + S4),
    ("kivi2 / q3 sink 4", "3-bit", ["-ctk", "kivi2", "-ctv", "q3"] + S4),
    ("q3a / q2 sink 4", "3-bit", ["-ctk", "q3a", "-ctv", "q2"] + S4),
    ("f16 / q3 sink 4", "K/V", ["-ctk", "f16", "-ctv", "q3"] + S4),
    # the defaults since the auto windows (kv_auto_windows: sink 4 + exact recent 32 for per-token types)
    ("q4 default", "windows", ["-ctk", "q4", "-ctv", "q4"]),
    ("q8 default", "windows", ["-ctk", "q8", "-ctv", "q8"]),
    ("q3 default", "windows", ["-ctk", "q3", "-ctv", "q3"]),
    # non-uniform levels (q4nl / q3nl / q2nl, docs/formats.md), default windows; the 3-bit target's row
    ("q3nl default", "3-bit", ["-ctk", "q3nl", "-ctv", "q3nl"]),
    ("q4nl / q2nl default", "3-bit", ["-ctk", "q4nl", "-ctv", "q2nl"]),
    ("q4nl / q2nl + V channel scale", "3-bit", ["-ctk", "q4nl", "-ctv", "q2nl", "--kv-channel-scale"]),
    # per-channel 4-bit K (T 64) beside q2nl V: 3.5 bits/elem, the 3-bit target's row since 4829e15
    ("kivi4 g64 / q2nl + V channel scale", "3-bit", ["-ctk", "kivi4", "--kv-kivi-group", "64", "-ctv", "q2nl",
                                                     "--kv-channel-scale", "--kv-sink", "4", "--kv-exact-recent", "32"]),
]
PER_TOKEN = {"q8", "q4", "q3", "q2", "q8a", "q4a", "q3a", "q2a"}


def pin_windows(flags):
    """The rows above the defaults were measured before --kv-sink / --kv-exact-recent defaulted to
    auto (4 / 32 for per-token types): they name the windows they had (0 unless given), so they keep
    measuring the per-token body alone."""
    types = {flags[i + 1] for i, f in enumerate(flags) if f in ("-ctk", "-ctv")}
    if not types & PER_TOKEN or any(t.startswith("kivi") for t in types):
        return flags
    extra = [] if "--kv-sink" in flags else ["--kv-sink", "0"]
    return flags + extra + ([] if "--kv-exact-recent" in flags else ["--kv-exact-recent", "0"])


FORMATS = [(k, w, f if k.endswith("default") or "nl" in k else pin_windows(f)) for k, w, f in FORMATS]
BASE = "f16"
FLAGS = {k: f for k, _, f in FORMATS}

# Greedy: every type once, the recommended configuration, and the 4-bit variants that matter.
GREEDY = ["q8", "q8a", "kivi8", "q4", "q4a", "kivi4", "q3a", "q3", "kivi2", "q2", "q2a", "bf16",
          "kivi4 / q4a sink 4 (recommended)", "kivi4 / q4 sink 4", "kivi4 / q4", "q4 sink 4", "q8 / q4",
          "q3 sink 4", "q4 default"]
LONG_MIN_TOKENS = 300
LONG_CHARS = 1800  # characters of wikitext-2 per long prompt (>= 300 tokens on both vocabularies)

# Issue 14 targets, as multiples of llama.cpp q8_0's mean KLD on the same model.
TARGETS = [("default 4-bit configuration (README)", ["kivi4 / q4a sink 4 (recommended)"], 1.0, None),
           ("`-ctk q4 -ctv q4` (default windows: sink 4, recent 32)", ["q4 default"], 1.0, None),
           ("`-ctk q4 -ctv q4 --kv-sink 0 --kv-exact-recent 0`", ["q4"], 1.0, None),
           ("kvq q8", ["q8 default", "q8"], 0.5, None),
           ("best configuration at <= 3.5 bits/elem", None, 2.0, 3.5)]

_lock = threading.Lock()


def results_path(args):
    return args.results or os.path.join(args.repo, "docs", "quality_real.json")


def load(path):
    return json.load(open(path)) if os.path.exists(path) else {"models": {}}


def update(path, fn):
    """Read-modify-write of the results file under a thread lock and an flock (two processes may
    run other models or formats at once)."""
    with _lock:
        lock = os.path.join(tempfile.gettempdir(), "kvq_quality_real_%x.lock" % zlib.crc32(os.path.abspath(path).encode()))
        with open(lock, "w") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            r = load(path)
            fn(r)
            q.write_atomic(path, json.dumps(r, indent=1, sort_keys=True) + "\n")
            return r


def bits_of(j):
    return q.kvq_bits(j)[0]


# ---------------------------------------------------------------- perplexity / KLD

def run_ppl(args, kvq, mkey, want, commit, path):
    title, mfile, gdir, chunks = MODELS[mkey]
    ch = args.chunks or chunks
    mp = os.path.join(args.models_dir, mfile)
    tp = os.path.join(q.data_path(args), WIKITEXT)
    if not (os.path.exists(mp) and os.path.exists(tp)):
        q.log("%s: skipped, missing %s or %s" % (mkey, mp, tp))
        return
    common = ["-m", mp, "-f", tp, "-c", "512", "--chunks", str(ch), "-t", str(args.threads), "--json",
              "--no-progress"]
    base_dir = args.base_dir or os.path.join("/tmp", "kvq_quality_real")
    os.makedirs(base_dir, exist_ok=True)
    base_file = os.path.join(base_dir, "%s-%dch-full.kld" % (mkey, ch))

    def reset(r):
        m = r["models"].get(mkey)
        if not m or m.get("chunks") != ch:
            r["models"][mkey] = {"chunks": ch, "rows": {}, "greedy": (m or {}).get("greedy", {})}
    update(path, reset)

    bigger = find_base(base_dir, mkey, ch)
    if bigger and bigger != base_file:
        # A base of more chunks serves as well (--kl-compare reads its first chunks); the f16 row is
        # then filled in from the first compared row (its ppl_base: f16 over these chunks).
        base_file, j, err, dt = bigger, None, None, 0.0
        q.log("%s: f16 base of more chunks reused from %s" % (mkey, base_file))
    elif os.path.exists(base_file) and os.path.exists(base_file + ".json"):
        j, err, dt = json.load(open(base_file + ".json")), None, 0.0
        q.log("%s: f16 base reused from %s" % (mkey, base_file))
    else:
        j, err, dt = q.run_json([kvq, "perplexity"] + common + FLAGS[BASE] + ["--kl-base", base_file, "--kl-top-k", "0"])
        if not err:
            q.write_atomic(base_file + ".json", json.dumps(j) + "\n")
        q.log("%s: f16 base %.0f s%s" % (mkey, dt, " FAILED: " + err if err else ", PPL %.4f" % j["ppl"]))
    if j or err:
        row = {"flags": FLAGS[BASE], "commit": commit, "seconds": round(dt, 1)}
        row.update({"error": err} if err else {"result": j})
        update(path, lambda r: r["models"][mkey]["rows"].__setitem__(BASE, row))
    if err:
        return

    def base_from(j):  # the f16 row from a compared row's view of the base
        k = j["kld"]
        b = {"ppl": k["ppl_base"], "ppl_err": k["ppl_base_err"], "n_scored": k["n"], "n_chunk": j["n_chunk"],
             "kv_bytes_per_token": j["kv_bytes_per_token_f16"], "kv_bytes_per_token_f16": j["kv_bytes_per_token_f16"],
             "kv_cache": "K f16 / V f16 (dense)", "from_base_file": os.path.basename(base_file)}
        return {"flags": FLAGS[BASE], "commit": commit, "seconds": 0.0, "result": b}

    def one(key):
        j, err, dt = q.run_json([kvq, "perplexity"] + common + FLAGS[key] + ["--kl-compare", base_file])
        row = {"flags": FLAGS[key], "commit": commit, "seconds": round(dt, 1)}
        row.update({"error": err} if err else {"result": j})
        def put(r):
            rows = r["models"][mkey]["rows"]
            rows[key] = row
            if not err and BASE not in rows:
                rows[BASE] = base_from(j)
        update(path, put)
        if err:
            q.log("%s: %s refused: %s" % (mkey, key, err))
        else:
            k = j["kld"]
            q.log("%s: %-34s %4.0f s  bits %.2f  KLD %.4g  top-1 %.2f %%  dPPL %+.2f %%" % (
                mkey, key, dt, bits_of(j), k["mean"], k["same_top1_pct"], k["dppl_pct"]))

    keys = [k for k in want if k != BASE]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as ex:
        list(ex.map(one, keys))


def find_base(base_dir, mkey, ch):
    """A full-vocabulary base file of mkey with >= ch chunks in base_dir (the fewest such), or None."""
    best = None
    for f in os.listdir(base_dir):
        pre, suf = mkey + "-", "ch-full.kld"
        if f.startswith(pre) and f.endswith(suf) and f[len(pre):-len(suf)].isdigit():
            n = int(f[len(pre):-len(suf)])
            if n >= ch and (best is None or n < best[0]):
                best = (n, os.path.join(base_dir, f))
    return best[1] if best else None


# ---------------------------------------------------------------- greedy

def long_prompts(args, golden_prompts):
    """Long prompt i: LONG_CHARS characters of wikitext-2 from the i-th article (cut after a
    sentence end), a blank line, then golden prompt i."""
    text = open(os.path.join(q.data_path(args), WIKITEXT), encoding="utf-8").read()
    starts, at = [], 0
    while len(starts) < len(golden_prompts):
        i = text.find("\n = ", at)  # an article title line " = Title = " (sections are " = = ")
        if i < 0:
            break
        if not text.startswith("\n = = ", i):
            starts.append(i + 1)
        at = i + 4
    out = []
    for s, gp in zip(starts, golden_prompts):
        body = text[s:s + LONG_CHARS]
        cut = body.rfind(" . ")
        body = body[:cut + 2] if cut > 0 else body
        out.append(body.strip() + "\n\n" + gp)
    return out


def run_greedy(args, kvq, mkey, want, commit, path):
    title, mfile, gdir, _ = MODELS[mkey]
    mp = os.path.join(args.models_dir, mfile)
    gpath = os.path.join(q.data_path(args), gdir, "generation.json")
    if not (os.path.exists(mp) and os.path.exists(gpath)):
        q.log("%s greedy: skipped, missing %s or %s" % (mkey, mp, gpath))
        return
    g = json.load(open(gpath))
    f16_runs = [r for r in g["runs"] if r["id"].endswith("_f16_fa-on")]
    golden_prompts = [r["prompt"] for r in f16_runs]
    prompts = [("golden %d" % (i + 1), p, f16_runs[i]) for i, p in enumerate(golden_prompts)] + \
        [("long %d" % (i + 1), p, None) for i, p in enumerate(long_prompts(args, golden_prompts))]

    def gen(key, prompt):
        return q.run_json([kvq, "generate", "-m", mp, "-p", prompt, "-n", "64", "--temp", "0", "--ignore-eos",
                         "-c", "1024", "-t", str(args.threads), "--json"] + FLAGS[key])

    old = load(path).get("models", {}).get(mkey, {}).get("greedy") or {}
    base = {}
    if old.get("commit") == commit and [(n, e["prompt"]) for n, e in old.get("base", {}).items()] == \
            [(n, p) for n, p, _ in prompts]:
        base = old["base"]  # same build, same prompts: the f16 continuations are already stored
        q.log("%s greedy: f16 continuations reused (commit %s)" % (mkey, commit))
    for name, prompt, gold in prompts:
        if name in base:
            continue
        j, err, dt = gen(BASE, prompt)
        if err:
            q.log("%s greedy f16 %s FAILED: %s" % (mkey, name, err))
            return
        if name.startswith("long") and j["n_prompt"] < LONG_MIN_TOKENS:
            q.log("%s greedy: %s has only %d tokens (< %d)" % (mkey, name, j["n_prompt"], LONG_MIN_TOKENS))
        ent = {"prompt": prompt, "n_prompt": j["n_prompt"], "ids": j["ids"], "text": j["text"]}
        if gold:  # kvq's f16 continuation against llama.cpp's (the golden's f16 cache)
            ent["same_as_llama_cpp"] = common_prefix(j["ids"], gold["generated_token_ids"])
        base[name] = ent
        q.log("%s greedy f16 %-8s %3d prompt tokens, %.0f s" % (mkey, name, j["n_prompt"], dt))
    def set_base(r):
        m = r["models"].setdefault(mkey, {"rows": {}})
        old = m.get("greedy") or {}
        same = {n: e["ids"] for n, e in (old.get("base") or {}).items()} == {n: e["ids"] for n, e in base.items()}
        m["greedy"] = {"commit": commit, "base": base, "rows": old.get("rows", {}) if same else {}}
    update(path, set_base)

    def one(key):
        row = {"flags": FLAGS[key], "commit": commit, "prompts": {}}
        for name, prompt, _ in prompts:
            j, err, dt = gen(key, prompt)
            if err:
                row["error"] = err
                break
            row["bits"] = bits_of(j)
            row["prompts"][name] = {"same": common_prefix(j["ids"], base[name]["ids"]), "text": j["text"]}
        update(path, lambda r: r["models"][mkey]["greedy"]["rows"].__setitem__(key, row))
        q.log("%s greedy %-34s %s" % (mkey, key, row.get("error") or
                                        " ".join("%d" % p["same"] for p in row["prompts"].values())))

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as ex:
        list(ex.map(one, [k for k in want if k != BASE]))


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- rendering

def golden_rows(args, mkey):
    _, _, gdir, _ = MODELS[mkey]
    path = os.path.join(q.data_path(args), gdir, "perplexity.json")
    if not os.path.exists(path):
        return [], None, None
    g = json.load(open(path))
    res = g["datasets"]["wikitext2"]["results"]
    base = next(r for r in res if r["config"] == "f16_fa-on")
    return [q.golden_row(r, base, r.get("n_chunks")) for r in res], base, g


def f_kld(v, err=None):
    s = q.f_kld(v)
    return s if err is None else "%s ± %s" % (s, q.f_kld(err))


def render_model(args, mkey, m):
    title, mfile, gdir, _ = MODELS[mkey]
    rows = m.get("rows", {})
    ch = m.get("chunks")
    out = ["### %s" % title, ""] + ([NOTES[mkey], ""] if mkey in NOTES else [])
    golden, gbase, g = golden_rows(args, mkey)
    b = rows.get(BASE, {}).get("result")
    elems = b["kv_bytes_per_token_f16"] / 2.0 if b else None
    if b:
        line = ("wikitext-2, `-c 512 --chunks %d`: %d scored tokens; kvq f16 PPL %.4f ± %.4f"
                % (ch, b["n_scored"], b["ppl"], b["ppl_err"]))
        run = (gbase or {}).get("ppl_running_per_chunk")
        if run and len(run) >= ch:
            line += ", llama.cpp's running PPL after the same %d chunks %.4f (%+.2f %%)" % (
                ch, run[ch - 1], 100 * (b["ppl"] / run[ch - 1] - 1))
        elif gbase:
            line += " (llama.cpp's f16 base: %.4f over %d chunks)" % (gbase["ppl"], gbase["n_chunks"])
        out += [line + ".", ""]
    commits = sorted({r.get("commit", "?") for r in rows.values()})
    out += ["kvq rows from commit %s; llama.cpp rows from the golden `%s/perplexity.json` (%s chunks, "
            "full-vocabulary KLD, commit `%s`)." % (", ".join("`%s`" % c for c in commits), gdir,
                                                   gbase["n_chunks"] if gbase else "?",
                                                   (g or {}).get("meta", {}).get("llama_cpp_commit", "?")[:7]), ""]
    table = []
    for key, what, _ in FORMATS:
        r = rows.get(key)
        if not r:
            continue
        if r.get("error"):
            table.append((99, 0, ["kvq", key, what, "`%s`" % " ".join(r["flags"]), "—", "—",
                                  "refused: %s" % r["error"].replace("|", "/"), "", "", "", ""]))
            continue
        j = r["result"]
        k = j.get("kld")
        bits = bits_of(j)
        if key == BASE:
            cells = ["kvq", "**f16 (base)**", what, "`%s`" % " ".join(r["flags"]), "%.2f" % bits,
                     "%.0f" % j["kv_bytes_per_token"], "—", "—", "—", "—", "%.4f" % j["ppl"]]
            kld = -1
        else:
            cells = ["kvq", "**%s**" % key, what, "`%s`" % " ".join(r["flags"]), "%.2f" % bits,
                     "%.0f" % j["kv_bytes_per_token"], f_kld(k["mean"], k["mean_err"]), f_kld(k["p99"]),
                     "%.2f" % k["same_top1_pct"], "%+.2f ± %.2f" % (k["dppl_pct"], k["dppl_err"]), "%.4f" % j["ppl"]]
            kld = k["mean"]
        table.append((-bits, kld, cells))
    for gr in golden:
        if gr["bits"] is None or gr["config"].startswith("f16_fa-on-self"):
            continue
        cfg = gr["config"].replace("_fa-on", "").replace("K-", "K ").replace("_V-", " / V ")
        cells = ["llama.cpp", cfg, "golden", "—", "%.2f" % gr["bits"],
                 "%.0f" % (gr["bits"] * elems / 8.0) if elems else "—",
                 "—" if gr["kld"] is None else f_kld(gr["kld"], gr.get("kld_err")), f_kld(gr["p99"]),
                 q.f_num(gr["top1"], "%.2f"), q.f_num(gr["dppl_pct"], "%+.2f"), "%.4f" % gr["ppl"]]
        table.append((-gr["bits"], -1 if gr.get("base") else (gr["kld"] if gr["kld"] is not None else 1e9), cells))
    table.sort(key=lambda t: (t[0], t[1]))
    out += ["| engine | KV config | varies | flags | bits/elem | KV bytes/token | mean KLD ± err | p99 KLD | "
            "same top-1 % | ΔPPL % | PPL |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += ["| " + " | ".join(c) + " |" for _, _, c in table]
    out.append("")

    # Equal bytes and targets against llama.cpp.
    def kvq_rows():
        for key, _, _ in FORMATS:
            r = rows.get(key)
            if key != BASE and r and r.get("result") and r["result"].get("kld"):
                yield key, bits_of(r["result"]), r["result"]["kld"]
    eq = []
    for gr in golden:
        if gr["kld"] is None or gr.get("base") or gr["bits"] is None or gr["config"].startswith(("f16_fa-on-self", "K-")) \
                or "norot" in gr["config"]:
            continue  # same type for K and V, with llama.cpp's default rotation
        cand = [(k["mean"], key, bits, k) for key, bits, k in kvq_rows() if bits <= gr["bits"] + 1e-9]
        if cand:
            _, key, bits, k = min(cand, key=lambda c: c[0])
            eq.append("| %s | %.2f | %s | %.2f | **%s** | %.2f | %s | %.2f | %.2fx |" % (
                gr["config"].replace("_fa-on", ""), gr["bits"], f_kld(gr["kld"]), gr["top1"], key, bits, f_kld(k["mean"]),
                k["same_top1_pct"], gr["kld"] / k["mean"]))
    if eq:
        out += ["Equal bytes: for each llama.cpp type, the kvq row with the lowest mean KLD at no more bits per "
                "element.", "", "| llama.cpp | bits | mean KLD | top-1 % | best kvq at <= bits | bits | mean KLD | "
                "top-1 % | KLD llama.cpp / kvq |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + eq + [""]
    q8 = next((gr for gr in golden if gr["config"] == "q8_0_fa-on"), None)
    if q8 and q8["kld"]:
        tl = []
        for name, keys, mult, max_bits in TARGETS:
            cand = [(k["mean"], key, bits, k) for key, bits, k in kvq_rows()
                    if (keys is None or key in keys) and (max_bits is None or bits <= max_bits + 1e-9)]
            if not cand:
                continue
            v, key, bits, k = min(cand, key=lambda c: c[0])
            lim = mult * q8["kld"]
            tl.append("| %s | **%s** | %.2f | <= %s (%gx q8_0) | %s | %.2fx | %s |" % (
                name, key, bits, f_kld(lim), mult, f_kld(v, k["mean_err"]), v / q8["kld"],
                "yes" if v <= lim else "no"))
        if tl:
            out += ["Issue 14 targets, against llama.cpp q8_0's mean KLD %s on this model. It is the mean over %d "
                    "chunks, kvq's over the first %d of them: not a paired comparison, and the chunks differ in "
                    "difficulty (see the reading above the tables)." % (f_kld(q8["kld"]), q8["chunks"], ch), "",
                "| target | kvq row | bits | bound | mean KLD ± err | / q8_0 | met |",
                "| --- | --- | --- | --- | --- | --- | --- |"] + tl + [""]
    out += render_greedy(m.get("greedy"))
    return out


def render_greedy(gr):
    if not gr or not gr.get("rows"):
        return []
    base = gr["base"]
    names = list(base)
    out = ["Greedy, 64 tokens (`kvq generate --temp 0 --ignore-eos -n 64 -c 1024`): identical tokens before the "
           "first divergence from the f16 cache's continuation (64: identical). Prompt tokens: %s. Long prompts: "
           "%d characters of a wikitext-2 article (from its title line, cut after a sentence), a blank line, then "
           "the golden prompt of the same number. kvq's f16 continuation equals llama.cpp's golden f16 one for "
           "%s tokens on the golden prompts. Commit `%s`." % (
               ", ".join("%s %d" % (n, base[n]["n_prompt"]) for n in names), LONG_CHARS,
               " / ".join(str(base[n]["same_as_llama_cpp"]) for n in names if "same_as_llama_cpp" in base[n]),
               gr.get("commit", "?")), "",
           "| KV config | bits/elem | " + " | ".join(names) + " |", "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    rows = sorted(gr["rows"].items(), key=lambda kv: (-kv[1].get("bits", 0), GREEDY.index(kv[0])
                                                         if kv[0] in GREEDY else 99))
    odd = []
    for key, r in rows:
        if r.get("error"):
            out.append("| %s | — | refused: %s |" % (key, r["error"].replace("|", "/")))
            continue
        out.append("| %s | %.2f | %s |" % (key, r["bits"], " | ".join(
            str(r["prompts"][n]["same"]) if n in r["prompts"] else "—" for n in names)))
        for n in names:
            p = r["prompts"].get(n)
            if p and p["same"] < 16 and r["bits"] >= 4:
                odd.append((key, n, p))
    out.append("")
    if odd:
        out += ["Continuations of the >= 4-bit rows that leave f16's before token 16 (first 120 characters; "
                "f16's below each):", ""]
        for key, n, p in odd:
            out.append("- %s, %s: `%s`  \n  f16: `%s`" % (key, n, clip(p["text"]), clip(base[n]["text"])))
        out.append("")
    return out


def clip(s):
    return s[:120].replace("`", "'").replace("\n", "\\n").replace("|", "/")


def render(args, res):
    meta = res.get("meta", {})
    out = [BEGIN, "", "Generated by `scripts/quality.py --real` (%s). Machine: %s. Last command: `%s`." % (
        meta.get("date", "?"), meta.get("machine", "?"), meta.get("command", "?")), "",
        "bits/elem = KV bytes per token x 8 / (2 x n_layer x n_kv_head x head_dim), the compressed body only "
        "(exact sink tokens are a fixed cost, KIVI's exact residual is not counted); llama.cpp's from its block "
        "sizes (q8_0 8.5, q5_1 6, q5_0 5.5, q4_1 5, q4_0 / iq4_nl 4.5). Mean KLD: KL(f16 base || config) in nats "
        "per scored token **over the full vocabulary** (kvq `--kl-top-k 0`, as llama.cpp), ± its standard error; "
        "ΔPPL: kvq's paired (per-token NLL difference), llama.cpp's the ratio of its PPLs. llama.cpp's rows are "
        "over more chunks than kvq's (the golden's first 40 / 20 chunks; kvq's are the first N of the same): "
        "compare them as rates, not paired. Its quantized types apply its 64-point Hadamard rotation.", ""]
    for mkey in MODELS:
        m = res.get("models", {}).get(mkey)
        if m:
            out += render_model(args, mkey, m)
    out.append(END)
    return "\n".join(out) + "\n"


def splice(path, block):
    s = open(path).read() if os.path.exists(path) else ""
    if BEGIN in s and END in s:
        return s[:s.index(BEGIN)] + block.rstrip("\n") + s[s.index(END) + len(END):]
    return s.rstrip("\n") + "\n\n## Real models\n\n" + block


def main(args):
    kvq = os.path.abspath(args.kvq)
    path = results_path(args)
    fkeys = [k for k, _, _ in FORMATS]
    want = fkeys if not args.formats else [x.strip() for x in args.formats.split(";") if x.strip()]
    bad = [f for f in want if f not in FLAGS]
    if bad:
        raise SystemExit("quality.py --real: unknown format(s) %s; known (separate with ';'): %s"
                         % (bad, "; ".join(fkeys)))
    models = list(MODELS) if not args.models else [x.strip() for x in args.models.split(",")]
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise SystemExit("quality.py --real: unknown model(s) %s; known: %s" % (bad, ", ".join(MODELS)))
    if not args.render_only:
        if not os.access(kvq, os.X_OK):
            raise SystemExit("quality.py: kvq binary '%s' not found or not executable" % args.kvq)
        commit, dirty = q.build_state(args.repo)
        # the last commit that changed what the binary is built from (a script-only commit after it
        # changes no number)
        commit = os.environ.get("KVQ_COMMIT") or q.git(args.repo, "log", "-1", "--format=%h", "--", "src", "include",
                                                        "tools", "CMakeLists.txt", "cmake") or commit
        commit += "+dirty" if dirty else ""
        t0 = time.time()
        for mkey in models:
            if args.greedy:
                run_greedy(args, kvq, mkey, [k for k in (want if args.formats else GREEDY)], commit, path)
            else:
                run_ppl(args, kvq, mkey, want, commit, path)
        cmd = "scripts/quality.py --real --kvq %s --models %s%s%s%s --threads %d --jobs %d" % (
            os.path.relpath(kvq, args.repo), ",".join(models), " --greedy" if args.greedy else "",
            " --formats '%s'" % args.formats if args.formats else "", " --chunks %d" % args.chunks if args.chunks else "",
            args.threads, args.jobs)
        update(path, lambda r: r.__setitem__("meta", {
            "date": datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"), "machine": q.machine(),
            "command": cmd, "seconds": round(time.time() - t0, 1)}))
    res = load(path)
    q.write_atomic(args.out, splice(args.out, render(args, res)))
    q.log("wrote %s (results %s)" % (args.out, path))
