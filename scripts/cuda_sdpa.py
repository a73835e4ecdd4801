#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention (f16, flash backend when it accepts the shapes) for the
decode shapes of bench_cuda_decode: one query token, 32 query / 8 kv heads, head_dim 128. Prints a
table and, given the C++ benchmark's JSON, the combined table with the q4 fused kernel's ratios."""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_graph(fn, n_copies, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for c in range(n_copies):
                fn(c)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(n_copies):
            fn(c)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / n_copies)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--ctx", default="4096,32768,131072")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, help="bench_cuda_decode --json output")
    a = ap.parse_args()
    dev = torch.device("cuda")
    print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))
    cpp = {}
    copy_gbps = None
    if a.json:
        with open(a.json) as f:
            j = json.load(f)
        copy_gbps = j["copy_gbps"]
        for r in j["results"]:
            cpp[(r["batch"], r["ctx"])] = r
    # torch's own device-to-device copy of 4 GiB, bytes read + written (a second roofline reading)
    src = torch.empty(1 << 32, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    t_copy = time_graph(lambda c: dst.copy_(src), 1, 10)
    print(f"torch copy_: {2 * src.numel() / (t_copy * 1e-3) / 1e9:.0f} GB/s (read + write)")
    del src, dst
    torch.cuda.empty_cache()
    nh, nkv, hd = 32, 8, 128
    rows = []
    for B in map(int, a.batch.split(",")):
        for L in map(int, a.ctx.split(",")):
            kv_bytes = 2 * B * nkv * L * hd * 2
            n_copies = int(min(64, max(1, math.ceil(768e6 / kv_bytes))))
            q = torch.randn(B, nh, 1, hd, device=dev, dtype=torch.float16)
            ks = [torch.randn(B, nkv, L, hd, device=dev, dtype=torch.float16) for _ in range(n_copies)]
            vs = [torch.randn(B, nkv, L, hd, device=dev, dtype=torch.float16) * 0.5 for _ in range(n_copies)]
            backend = None
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                             ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
                try:
                    with sdpa_kernel([be]):
                        out = F.scaled_dot_product_attention(q, ks[0], vs[0], enable_gqa=True)
                    torch.cuda.synchronize()
                    backend = (name, be)
                    break
                except Exception as e:  # this backend rejects the shape; try the next
                    print(f"  {name}: {str(e).splitlines()[0][:120]}")
            # reference in float64 for the first sequence of the first copy
            kr = ks[0][:1].double().repeat_interleave(nh // nkv, dim=1)
            vr = vs[0][:1].double().repeat_interleave(nh // nkv, dim=1)
            w = torch.softmax(q[:1].double() @ kr.transpose(-1, -2) / math.sqrt(hd), dim=-1)
            ref = w @ vr
            err = ((out[:1].double() - ref).norm() / ref.norm()).item()
            del kr, vr, w, ref

            def fn(c):
                with sdpa_kernel([backend[1]]):
                    F.scaled_dot_product_attention(q, ks[c], vs[c], enable_gqa=True)

            t = time_graph(fn, n_copies, a.reps)
            gbps = kv_bytes / (t * 1e-3) / 1e9
            del ks, vs, out
            torch.cuda.empty_cache()
            # A framework dequantize-then-attend path: q4 codes + f16 scales (kvq's row layout) unpacked with
            # PyTorch ops to f16, then the same SDPA.
            kc = torch.randint(0, 256, (B, nkv, L, hd // 2), device=dev, dtype=torch.uint8)
            vc = torch.randint(0, 256, (B, nkv, L, hd // 2), device=dev, dtype=torch.uint8)
            ksc = (torch.rand(B, nkv, L, hd // 32, device=dev) * 0.3 + 0.05).half()
            vsc = (torch.rand(B, nkv, L, hd // 32, device=dev) * 0.3 + 0.05).half()

            def deq(c, sc):
                blk = c.view(B, nkv, L, hd // 32, 16)
                u = torch.cat([blk & 15, blk >> 4], dim=-1)  # channels 0..15 low nibbles, 16..31 high
                return ((u.half() - 8) * sc.unsqueeze(-1)).view(B, nkv, L, hd)

            def deq_fn():
                with sdpa_kernel([backend[1]]):
                    F.scaled_dot_product_attention(q, deq(kc, ksc), deq(vc, vsc), enable_gqa=True)

            for _ in range(2):
                deq_fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                deq_fn()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1))
            t_deq = sorted(ts)[2]
            rows.append((B, L, t, backend[0], gbps, err, t_deq))
            print(f"batch {B} ctx {L}: sdpa {backend[0]} {t * 1e3:.1f} us, {gbps:.0f} GB/s, rel err vs f64 {err:.1e}; "
                  f"torch dequant + sdpa {t_deq * 1e3:.0f} us")
            del kc, vc, ksc, vsc, q
            torch.cuda.empty_cache()
    print()
    print("| batch | ctx | torch SDPA f16 us | backend | GB/s | % copy | q4 fused us | SDPA/q4 | own f16 us | own f16/SDPA "
          "| torch dequant+SDPA us | that/q4 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, L, t, be, gbps, err, t_deq in rows:
        r = cpp.get((B, L))
        pc = f"{100 * gbps / copy_gbps:.0f}%" if copy_gbps else "-"
        if r:
            print(f"| {B} | {L // 1024}K | {t * 1e3:.1f} | {be} | {gbps:.0f} | {pc} | {r['q4_us']:.1f} | "
                  f"{t * 1e3 / r['q4_us']:.2f}x | {r['f16_us']:.1f} | {r['f16_us'] / (t * 1e3):.2f} | {t_deq * 1e3:.0f} | "
                  f"{t_deq * 1e3 / r['q4_us']:.0f}x |")
        else:
            print(f"| {B} | {L // 1024}K | {t * 1e3:.1f} | {be} | {gbps:.0f} | {pc} | - | - | - | - | {t_deq * 1e3:.0f} | - |")


if __name__ == "__main__":
    main()
