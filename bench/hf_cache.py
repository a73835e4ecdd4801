#!/usr/bin/env python3
"""Decode speed and peak memory of transformers KV caches on one model at long context (docs/perf.md,
"transformers caches"): DynamicCache (sdpa attention), transformers' QuantizedCache (optimum-quanto
backend, 4-bit, its defaults: per-channel groups of 64, 128 exact recent tokens) and kvq.hf.KVQCache
(attn_implementation="kvq": q8, and the recommended 4-bit kivi4 / q4a, sink 4).

    python3 bench/hf_cache.py [--gguf models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf] [--ctx 2048 8192]
                              [--new 24] [--threads 1] [--work /tmp/kvq_hf_bench]

Once (cached in --work): the GGUF file loaded by transformers (dequantized to float32) and saved as
safetensors, wikitext-2 test tokens (kvq's tokenizer), and one prefill of the longest context with
DynamicCache whose K / V (after RoPE, per layer) are saved; a shorter context is a prefix of it
(causal). Then each (cache, context) runs in its own process: load the float32 model, run one token
(so every weight is resident), reset the peak-RSS counter (/proc/self/clear_refs 5), fill the cache with the saved K / V of the context
(DynamicCache / QuantizedCache: update(); KVQCache: append_kv()), then decode --new tokens greedily
from the text's next token, one forward per token (as generate does). Reported: decode tokens/s
(1 / median step time), peak RSS (VmHWM) above the RSS after model load and one warm-up token (every weight resident), the cache's own bytes where
it reports them. Torch and kvq threads: --threads (1 keeps a shared machine usable).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

SOURCE = pathlib.Path(__file__).resolve().parents[1]
CACHES = ["dynamic", "quanto4", "kvq-q8", "kvq-4bit"]


def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def prepare(args, work):
    import numpy as np
    import torch
    import kvq
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    gguf = pathlib.Path(args.gguf).resolve()
    model_dir = work / "model-f32"
    if not (model_dir / "config.json").exists():
        t = time.time()
        m = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # the weights are plain float32 tensors now: save them as an ordinary model
        m.hf_quantizer = None
        if getattr(m.config, "quantization_config", None) is not None:
            del m.config.quantization_config
        m.save_pretrained(str(model_dir))
        print(f"[prepare] {gguf.name} -> {model_dir} (float32) in {time.time() - t:.0f} s", flush=True)
        del m
    n = max(args.ctx) + args.new + 1
    ids_file = work / "ids.json"
    if not ids_file.exists():
        text = pathlib.Path(args.text).read_text()
        ids = kvq.Model(str(gguf)).tokenize(text)[:n]
        if len(ids) < n:
            sys.exit(f"[prepare] {args.text}: {len(ids)} tokens, {n} needed")
        ids_file.write_text(json.dumps(ids))
    ids = json.loads(ids_file.read_text())
    kv_dir = work / f"kv-{max(args.ctx)}"
    if not (kv_dir / "done").exists():
        kv_dir.mkdir(exist_ok=True)
        m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
        cache = DynamicCache(config=m.config)
        t = time.time()
        x = torch.tensor([ids[:max(args.ctx)]])
        with torch.no_grad():
            for p in range(0, x.shape[1], 512):
                m(x[:, p:p + 512], past_key_values=cache, use_cache=True, logits_to_keep=1)
        for il, layer in enumerate(cache.layers):
            np.save(kv_dir / f"layer{il}.npy", torch.stack([layer.keys[0], layer.values[0]]).numpy())
        (kv_dir / "done").write_text("")
        print(f"[prepare] prefill of {x.shape[1]} tokens (DynamicCache, sdpa, {args.threads} threads) in "
              f"{time.time() - t:.0f} s", flush=True)
    return model_dir, kv_dir, ids


def run_one(args, work, name, ctx):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache

    torch.set_num_threads(args.threads)
    model_dir, kv_dir = work / "model-f32", work / f"kv-{max(args.ctx)}"
    ids = json.loads((work / "ids.json").read_text())
    attn = "kvq" if name.startswith("kvq") else "sdpa"
    if attn == "kvq":
        import kvq.hf  # noqa: F401  (registers attn_implementation="kvq")
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=attn).eval()
    with torch.no_grad():  # touches every weight (safetensors maps them lazily) before the baseline
        warm = (kvq.hf.KVQCache(m.config, max_cache_len=2, type_k="f32", type_v="f32") if attn == "kvq"
                else DynamicCache(config=m.config))
        m(torch.tensor([[ids[0]]]), past_key_values=warm, use_cache=True)
        del warm
    base = rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    n_ctx = ctx + args.new + 1
    if name == "dynamic":
        cache = DynamicCache(config=m.config)
    elif name == "quanto4":
        cache = QuantizedCache("quanto", m.config, nbits=4)
    elif name == "kvq-q8":
        cache = kvq.hf.KVQCache(m.config, max_cache_len=n_ctx, n_threads=args.threads, type_k="q8", type_v="q8")
    elif name == "kvq-4bit":
        cache = kvq.hf.KVQCache(m.config, max_cache_len=n_ctx, n_threads=args.threads, type_k="kivi4",
                                type_v="q4a", sink=4)
    else:
        sys.exit(f"unknown cache {name} (one of {', '.join(CACHES)})")
    t = time.time()
    for il in range(m.config.num_hidden_layers):
        kv = torch.from_numpy(np.load(kv_dir / f"layer{il}.npy")[:, :, :ctx].copy())
        k, v = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
        if name.startswith("kvq"):
            cache.append_kv(k, v, il)
        else:
            cache.update(k, v, il)
        del kv, k, v
    fill_s = time.time() - t
    tok = torch.tensor([[ids[ctx]]])
    steps, out = [], []
    with torch.no_grad():
        for _ in range(args.new):
            t = time.perf_counter()
            logits = m(tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            tok = logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - t)
            out.append(int(tok))
    assert cache.get_seq_length() == ctx + args.new, cache.get_seq_length()
    r = {"cache": name, "ctx": ctx, "new": args.new, "threads": args.threads,
         "decode_tok_s": 1.0 / statistics.median(steps), "step_s_median": statistics.median(steps),
         "step_s_min": min(steps), "peak_rss_above_model_mib": (rss_kib("VmHWM") - base) / 1024,
         "rss_after_load_mib": base / 1024, "fill_s": fill_s, "tokens": out}
    if name.startswith("kvq"):
        r["cache_bytes_mib"] = cache.bytes() / 2**20
        r["cache_bytes_used_mib"] = cache.bytes_used() / 2**20
        r["describe"] = cache.describe()
    print(json.dumps(r), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=str(SOURCE / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    data = pathlib.Path(os.environ.get("KVQ_DATA_DIR") or SOURCE.parent / "shared")
    ap.add_argument("--text", default=str(data / "data" / "wikitext-2-raw-test" / "wiki.test.raw"))
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--threads", "-t", type=int, default=1)
    ap.add_argument("--caches", nargs="+", default=CACHES)
    ap.add_argument("--work", default="/tmp/kvq_hf_bench")
    ap.add_argument("--one", nargs=2, metavar=("CACHE", "CTX"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.one:
        return run_one(args, work, args.one[0], int(args.one[1]))
    prepare(args, work)
    results = []
    for ctx in args.ctx:
        for name in args.caches:
            cmd = [sys.executable, __file__, "--one", name, str(ctx), *sys.argv[1:]]
            r = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode != 0 or not lines:
                print(f"{name} @ {ctx}: failed\n{r.stderr[-3000:]}", flush=True)
                continue
            results.append(json.loads(lines[-1]))
            x = results[-1]
            print(f"{name:9s} ctx {ctx:5d}: decode {x['decode_tok_s']:.2f} tok/s, peak RSS above model "
                  f"{x['peak_rss_above_model_mib']:.0f} MiB", flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| cache | context | decode tok/s | peak RSS above model (MiB) | kvq cache bytes (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for x in results:
        print(f"| {x['cache']} | {x['ctx']} | {x['decode_tok_s']:.2f} | {x['peak_rss_above_model_mib']:.0f} | "
              f"{x.get('cache_bytes_mib', float('nan')):.1f} |")


if __name__ == "__main__":
    main()
