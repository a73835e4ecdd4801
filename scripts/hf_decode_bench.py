#!/usr/bin/env python3
"""PyTorch + transformers on issue 19's model shapes, beside `kvq bench --device cuda` (docs/perf.md,
"transformers beside kvq on the GPU"). scripts/cuda_model_bench.sh runs both in one device call.

A transformers Llama / Qwen2 model is built from a config of the published shape (no download) with
random bf16 weights (transformers' own initialisation, on the device; the speed does not depend on
the values), attn_implementation="sdpa".

- Decode: for each BATCHxDEPTH, a DynamicCache is pre-filled with random bf16 K / V of DEPTH
  positions per layer (`cache.update(k, v, layer)` with [batch, n_kv_head, depth, head_dim] tensors,
  so no forward pass), then greedy steps: one token per sequence through `model(ids,
  past_key_values=cache, logits_to_keep=1)`, argmax, ids copied to the host. Host clock around each
  step (after torch.cuda.synchronize), median of --steps after --warmup untimed ones: kvq bench's
  protocol (`model_runner::decode`, greedy ids back to the host).
- Prefill: one sequence, a prompt of PROMPT random ids into a fresh DynamicCache, (a) as one
  forward() and (b) as forward() calls of --prefill-chunk tokens (kvq bench's protocol), last logits
  only; one untimed 512-token forward first, then the median of --prefill-reps timings.
- QuantizedCache: transformers' needs optimum-quanto or hqq; the script reports which is importable
  and runs `QuantizedCache("quanto", nbits=4)` at the decode shapes only with --quantized (see the
  docstring of quantized_rows).

    python3 scripts/hf_decode_bench.py [--shape llama3.1-8b qwen2.5-1.5b] [--decode 1x4096 16x32768 4x131072]
        [--prefill 4096 32768] [--steps 10] [--json OUT] [--kvq-json KVQ.json ...] [--device cpu --tiny]

--kvq-json: `kvq bench --device cuda --json` outputs of the same run; prints kvq / transformers
ratios (decode ms per step, transformers over kvq; prefill tok/s, kvq over transformers).
--tiny shrinks every shape (2 layers, 2 kv heads of 32, vocab 1024) to test the script on a CPU.
"""
import argparse
import json
import statistics
import sys
import time

import torch

# issue 19's shapes (the published configs' sizes; kvq's shape_hparams use the same)
SHAPES = {
    "llama3.1-8b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, head_dim=128,
                        n_ff=14336, vocab=128256, tied=False, rope_theta=500000.0),
    "qwen2.5-1.5b": dict(arch="qwen2", n_layer=28, n_embd=1536, n_head=12, n_kv_head=2, head_dim=128,
                         n_ff=8960, vocab=151936, tied=True, rope_theta=1000000.0),
}


def tiny(s):
    """The shape's architecture and GQA group at 2 layers, 2 kv heads of 32, vocab 1024 (CPU test)."""
    group = s["n_head"] // s["n_kv_head"]
    return dict(s, n_layer=2, n_kv_head=2, n_head=2 * group, head_dim=32, n_embd=2 * group * 32, n_ff=512,
                vocab=1024)


def build_model(s, max_pos, dev, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=s["vocab"], hidden_size=s["n_embd"], intermediate_size=s["n_ff"],
                  num_hidden_layers=s["n_layer"], num_attention_heads=s["n_head"],
                  num_key_value_heads=s["n_kv_head"], max_position_embeddings=max_pos,
                  tie_word_embeddings=s["tied"], rms_norm_eps=1e-5)
    if s["arch"] == "llama":
        cfg = LlamaConfig(head_dim=s["head_dim"], rope_theta=s["rope_theta"], **common)
        cls = LlamaForCausalLM
    else:
        cfg = Qwen2Config(rope_theta=s["rope_theta"], use_sliding_window=False, **common)
        cls = Qwen2ForCausalLM
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            m = cls(cfg)  # transformers' random initialisation, on the device
    finally:
        torch.set_default_dtype(prev)
    m = m.to(dtype).eval()
    if m.config._attn_implementation != "sdpa":
        sys.exit(f"attention implementation is {m.config._attn_implementation}, not sdpa")
    return m


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def free(dev):
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def prefilled_cache(m, s, batch, depth, dev, dtype, gen, kind="dynamic"):
    """A cache holding `depth` random positions of every layer (no forward pass)."""
    from transformers import DynamicCache

    if kind == "dynamic":
        cache = DynamicCache(config=m.config)
    else:
        from transformers import QuantizedCache

        cache = QuantizedCache("quanto", m.config, nbits=4)
    shape = (batch, s["n_kv_head"], depth, s["head_dim"])
    for il in range(s["n_layer"]):
        k = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        v = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        cache.update(k, v, il)
        del k, v
    assert cache.get_seq_length() == depth, (cache.get_seq_length(), depth)
    return cache


def decode_row(m, s, batch, depth, args, dev, dtype, kind="dynamic"):
    gen = torch.Generator(device=dev).manual_seed(1234 + batch * 7 + depth)
    t = time.perf_counter()
    cache = prefilled_cache(m, s, batch, depth, dev, dtype, gen, kind)
    sync(dev)
    fill_s = time.perf_counter() - t
    ids = torch.randint(0, s["vocab"], (batch, 1), generator=gen, device=dev)
    steps = []
    with torch.inference_mode():
        for i in range(args.warmup + args.steps):
            sync(dev)
            t = time.perf_counter()
            logits = m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            host = ids.cpu()  # greedy ids back to the host, as kvq bench
            sync(dev)
            if i >= args.warmup:
                steps.append(time.perf_counter() - t)
    assert host.shape == (batch, 1)
    assert cache.get_seq_length() == depth + args.warmup + args.steps
    # bytes of the bf16 K / V at the depth (DynamicCache holds them; QuantizedCache holds less)
    kv_bytes = 2 * s["n_layer"] * batch * s["n_kv_head"] * depth * s["head_dim"] * torch.finfo(dtype).bits // 8
    del cache, logits
    free(dev)
    ms = 1e3 * statistics.median(steps)
    return {"kind": "decode", "cache": kind, "batch": batch, "depth": depth, "step_ms_median": ms,
            "step_ms_min": 1e3 * min(steps), "step_ms_max": 1e3 * max(steps), "tokens_per_s": batch / ms * 1e3,
            "steps": len(steps), "fill_s": fill_s, "kv_bytes": kv_bytes}


def prefill_row(m, s, prompt, chunk, args, dev):
    from transformers import DynamicCache

    gen = torch.Generator(device=dev).manual_seed(99 + prompt)
    ids = torch.randint(0, s["vocab"], (1, prompt), generator=gen, device=dev)

    def run(c):
        cache = DynamicCache(config=m.config)
        with torch.inference_mode():
            for p in range(0, prompt, c):
                logits = m(input_ids=ids[:, p:p + c], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        logits.float().cpu()
        assert cache.get_seq_length() == prompt
        del cache

    with torch.inference_mode():
        m(input_ids=ids[:, :min(512, prompt)], use_cache=False, logits_to_keep=1).logits.cpu()  # untimed
    out = {"kind": "prefill", "prompt": prompt}
    for name, c in (("whole", prompt), ("chunked", chunk)):
        ts = []
        for _ in range(args.prefill_reps):
            sync(dev)
            t = time.perf_counter()
            run(c)
            sync(dev)
            ts.append(time.perf_counter() - t)
            free(dev)
        out[f"{name}_chunk"] = c
        out[f"{name}_seconds"] = statistics.median(ts)
        out[f"{name}_tokens_per_s"] = prompt / statistics.median(ts)
    return out


def quantized_backends():
    have = {}
    for mod in ("optimum.quanto", "hqq"):
        try:
            __import__(mod)
            have[mod] = True
        except Exception as e:  # noqa: BLE001 (any import failure means: not usable here)
            have[mod] = f"{type(e).__name__}: {e}"
    return have


def parse_bxd(x):
    b, d = x.lower().split("x")
    return int(b), int(d)


def kvq_rows(paths):
    """(shape, type, batch, depth) -> step ms; (shape, type, prompt) -> tiled tok/s, from kvq bench --json."""
    dec, pre = {}, {}
    for p in paths:
        try:
            j = json.load(open(p))
        except Exception as e:  # noqa: BLE001
            print(f"[hf_decode_bench] {p}: {e}", file=sys.stderr)
            continue
        shape = j.get("model", "").replace("synthetic:", "")
        for r in j.get("rows", []):
            if r.get("capacity"):
                continue
            key = (shape, r["type"], r["batch"], r["depth"])
            dec[key] = {"direct": r["step_ms_median"], "graph": r.get("graph_ms_median") or None}
        for r in j.get("prefill", []):
            pre[(shape, r["type"], r["prompt"])] = r["tiled_tokens_per_s"]
    return dec, pre


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--decode", nargs="*", default=["1x4096", "16x32768", "4x131072"], help="BATCHxDEPTH")
    ap.add_argument("--prefill", nargs="*", type=int, default=[4096, 32768])
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2 layers, 2 kv heads of 32, vocab 1024: a CPU test of the script")
    ap.add_argument("--quantized", action="store_true", help="also QuantizedCache('quanto', nbits=4) decode rows")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--kvq-json", nargs="*", default=[], help="kvq bench --device cuda --json outputs of the same run")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(dev),
            "quantized_backends": quantized_backends()}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_mem_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(json.dumps(info), flush=True)
    rows = []
    for name in args.shape:
        s = tiny(SHAPES[name]) if args.tiny else SHAPES[name]
        max_pos = max([parse_bxd(x)[1] for x in args.decode] + args.prefill + [1]) + args.warmup + args.steps + 8
        t = time.perf_counter()
        m = build_model(s, max_pos, dev, dtype)
        sync(dev)
        n_param = sum(p.numel() for p in m.parameters())
        print(f"[{name}] {s}: {n_param / 1e9:.2f} B parameters, built in {time.perf_counter() - t:.1f} s", flush=True)
        kinds = ["dynamic"] + (["quanto4"] if args.quantized else [])
        for x in args.decode:
            b, d = parse_bxd(x)
            for kind in kinds:
                try:
                    r = decode_row(m, s, b, d, args, dev, dtype, kind)
                except torch.OutOfMemoryError as e:
                    r = {"kind": "decode", "cache": kind, "batch": b, "depth": d, "error": f"out of memory: {e}"[:300]}
                    free(dev)
                except Exception as e:  # noqa: BLE001 (recorded, the other rows still run)
                    r = {"kind": "decode", "cache": kind, "batch": b, "depth": d, "error": f"{type(e).__name__}: {e}"[:300]}
                    free(dev)
                r["shape"] = name
                rows.append(r)
                print(json.dumps(r), flush=True)
        for p in args.prefill:
            try:
                r = prefill_row(m, s, p, args.prefill_chunk, args, dev)
            except torch.OutOfMemoryError as e:
                r = {"kind": "prefill", "prompt": p, "error": f"out of memory: {e}"[:300]}
                free(dev)
            r["shape"] = name
            rows.append(r)
            print(json.dumps(r), flush=True)
        del m
        free(dev)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)

    print(f"\ntransformers {transformers.__version__}, torch {torch.__version__}, bf16, sdpa, random weights; "
          f"decode: median of {args.steps} steps after {args.warmup}, greedy ids to the host\n")
    print("| shape | cache | batch | depth | step ms | tok/s | bf16 K/V GB at depth |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "decode":
            if "error" in r:
                print(f"| {r['shape']} | {r['cache']} | {r['batch']} | {r['depth']} | {r['error'][:60]} | | |")
            else:
                print(f"| {r['shape']} | {r['cache']} | {r['batch']} | {r['depth']} | {r['step_ms_median']:.2f} | "
                      f"{r['tokens_per_s']:.1f} | {r['kv_bytes'] / 1e9:.2f} |")
    print("\n| shape | prompt | one forward s | tok/s | chunks of N s | tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "prefill":
            if "error" in r:
                print(f"| {r['shape']} | {r['prompt']} | {r['error'][:60]} | | | |")
            else:
                print(f"| {r['shape']} | {r['prompt']} | {r['whole_seconds']:.3f} | {r['whole_tokens_per_s']:.0f} | "
                      f"{r['chunked_seconds']:.3f} (N={r['chunked_chunk']}) | {r['chunked_tokens_per_s']:.0f} |")
    if args.kvq_json:
        dec, pre = kvq_rows(args.kvq_json)
        print("\nkvq / transformers (same run): decode = transformers step ms / kvq step ms (x faster), "
              "kvq direct launches and CUDA graphs; prefill = kvq tiled tok/s / transformers tok/s\n")
        print("| shape | batch | depth | transformers ms | kvq type | kvq ms (direct / graph) | x faster (direct / graph) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            if r["kind"] != "decode" or "error" in r or r["cache"] != "dynamic":
                continue
            for t in ("f16", "q8", "q4"):
                k = dec.get((r["shape"], t, r["batch"], r["depth"]))
                if not k:
                    continue
                g = k["graph"]
                print(f"| {r['shape']} | {r['batch']} | {r['depth']} | {r['step_ms_median']:.2f} | {t} | "
                      f"{k['direct']:.2f} / {g:.2f} | {r['step_ms_median'] / k['direct']:.1f}x / "
                      f"{r['step_ms_median'] / g:.1f}x |" if g else
                      f"| {r['shape']} | {r['batch']} | {r['depth']} | {r['step_ms_median']:.2f} | {t} | "
                      f"{k['direct']:.2f} / - | {r['step_ms_median'] / k['direct']:.1f}x / - |")
        print("\n| shape | prompt | transformers tok/s (one forward / chunks) | kvq type | kvq tiled tok/s | "
              "x (vs one forward / vs chunks) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["kind"] != "prefill" or "error" in r:
                continue
            for t in ("f16", "q8", "q4"):
                k = pre.get((r["shape"], t, r["prompt"]))
                if k:
                    print(f"| {r['shape']} | {r['prompt']} | {r['whole_tokens_per_s']:.0f} / "
                          f"{r['chunked_tokens_per_s']:.0f} | {t} | {k:.0f} | {k / r['whole_tokens_per_s']:.2f}x / "
                          f"{k / r['chunked_tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    main()
