#!/usr/bin/env python3
"""Heat maps (layer x head) of the attention-output relative error written by `kvq kv-error --plot`.

usage: plot_kv_error.py RESULT.json OUT.png   (RESULT.json = the tool's --json object)
One panel per KV format; colour = relative error vs f32 on a shared log scale; the panel title
gives the format, bytes/token and mean relative error / mean TV distance.
"""
import math
import sys

import plot_common  # matplotlib's headless backend first
import matplotlib.pyplot as plt
from matplotlib.colors import LogNorm


def main():
    r = plot_common.read_result(__doc__)
    fmts = r["formats"]
    L, H = r["n_layer"], r["n_head"]
    vals = [v for f in fmts for v in f["rel_err"] if v > 0]
    lo = min(vals) if vals else 1e-6
    hi = max(vals) if vals else 1.0
    if hi <= lo:
        hi = lo * 10
    n = len(fmts)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1.2, 0.35 * L * rows + 1.8 * rows), squeeze=False,
                             constrained_layout=True)
    im = None
    for i, f in enumerate(fmts):
        ax = axes[i // cols][i % cols]
        grid = [[max(f["rel_err"][il * H + h], lo) for h in range(H)] for il in range(L)]
        im = ax.imshow(grid, aspect="auto", cmap="magma", norm=LogNorm(vmin=lo, vmax=hi), origin="upper")
        name = f["type_k"] if f["type_k"] == f["type_v"] else f["type_k"] + "/" + f["type_v"]
        tv = "TV %.2e" % f["mean_tv"] if "mean_tv" in f else "TV not computed"  # absent with --no-tv
        ax.set_title("%s  %.0f B/tok\nrel.err %.2e  %s" % (name, f["bytes_per_token"], f["mean_rel_err"], tv),
                     fontsize=8)
        ax.set_xlabel("head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        ax.tick_params(labelsize=6)
    for j in range(n, rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle("attention-output relative error vs f32 (%s, %d x %d tokens)" % (
        r["model"].split("/")[-1], r["n_chunk"], r["n_ctx"]), fontsize=9)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.savefig(sys.argv[2], dpi=110, format="png")


if __name__ == "__main__":
    main()
