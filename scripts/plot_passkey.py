#!/usr/bin/env python3
"""Heat maps of passkey retrieval accuracy written by `kvq eval-passkey --plot`.

usage: plot_passkey.py RESULT.json [MORE.json ...] OUT.png   (each RESULT = eval-passkey's --json object)
One panel per result (one KV-cache configuration): rows = context length, columns = needle depth,
colour = accuracy (red 0 % .. green 100 %, as the needle-in-a-haystack papers draw it), each cell
labelled with its accuracy in %. The title gives the cache, its bytes per token and the overall
accuracy.
"""
import json
import math
import sys
import textwrap

import plot_common  # matplotlib's headless backend first
import matplotlib.pyplot as plt


def fmt_len(n):
    return "%dK" % (n // 1024) if n % 1024 == 0 else str(n)


def panel(ax, r):
    lengths, depths = r["lengths"], r["depths"]
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in r["cells"]}
    grid = [[100 * acc.get((L, d), float("nan")) for d in depths] for L in lengths]
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
    for i in range(len(lengths)):
        for k in range(len(depths)):
            v = grid[i][k]
            if not math.isnan(v):
                ax.text(k, i, "%.0f" % v, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), ["%g" % d for d in depths], fontsize=7)
    ax.set_yticks(range(len(lengths)), [fmt_len(L) for L in lengths], fontsize=7)
    ax.set_xlabel("needle depth %", fontsize=7)
    ax.set_ylabel("context length (tokens)", fontsize=7)
    kv = r["kv_type_k"] if r["kv_type_k"] == r["kv_type_v"] else r["kv_type_k"] + "/" + r["kv_type_v"]
    ax.set_title("%s  %.0f B/tok\n%s\naccuracy %.1f %% (%d trials/cell)" %
                 (kv, r["kv_bytes_per_token"], "\n".join(textwrap.wrap(r["kv_cache"], 48)), 100 * r["accuracy"], r["trials_per_cell"]), fontsize=7)
    return im


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    results = []
    for path in sys.argv[1:-1]:
        with open(path) as f:
            results.append(json.load(f))
    n = len(results)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    h = max(len(r["lengths"]) for r in results)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1.0, (0.45 * h + 1.9) * rows), squeeze=False,
                             constrained_layout=True)
    im = None
    for i, r in enumerate(results):
        im = panel(axes[i // cols][i % cols], r)
    for i in range(n, rows * cols):
        axes[i // cols][i % cols].axis("off")
    fig.colorbar(im, ax=axes, shrink=0.8, label="accuracy %")
    fig.suptitle("passkey retrieval: %s" % results[0]["model"].split("/")[-1], fontsize=9)
    fig.savefig(sys.argv[-1], dpi=120)


if __name__ == "__main__":
    main()
