#!/usr/bin/env python3
"""Heat maps of passkey retrieval accuracy written by `kvq eval-passkey --plot`.

usage: plot_passkey.py RESULT.json [MORE.json ...] OUT.png   (each RESULT = eval-passkey's --json object)
One panel per KV-cache configuration: rows = context length, columns = needle depth, colour =
accuracy (red 0 % .. green 100 %, as the needle-in-a-haystack papers draw it), each cell labelled
with its accuracy in %. The title gives the cache, its bytes per token, the device and the overall
accuracy. Results of one configuration (same model, device, K / V types and cache description),
e.g. one run per length or per depth, are merged into one panel: their cells' trials are summed, a
(length, depth) cell no run measured stays blank.
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
    dev = " (GPU)" if r.get("device", "cpu") == "cuda" else ""
    n = r["trials_per_cell"]  # a count, or "2-5" for merged runs of different counts
    ax.set_title("%s%s  %.0f B/tok\n%s\naccuracy %.1f %% (%s trial%s/cell)" %
                 (kv, dev, r["kv_bytes_per_token"], "\n".join(textwrap.wrap(r["kv_cache"], 48)), 100 * r["accuracy"],
                  n, "" if n == 1 else "s"), fontsize=7)
    return im


def config_key(r):
    return (r["model"], r.get("device", "cpu"), r["kv_type_k"], r["kv_type_v"], r["kv_cache"], r["kv_bytes_per_token"])


def merge(group):
    """One result of several runs of one configuration: lengths and depths ascending, cells summed."""
    if len(group) == 1:
        return group[0]
    r = dict(group[0])
    cells = {}
    for g in group:
        for c in g["cells"]:
            k = (c["length"], c["depth"])
            n, ok = cells.get(k, (0, 0))
            cells[k] = (n + c["n_trials"], ok + c["n_correct"])
    r["lengths"] = sorted({k[0] for k in cells})
    r["depths"] = sorted({k[1] for k in cells})
    r["cells"] = [{"length": L, "depth": d, "n_trials": n, "n_correct": ok, "accuracy": ok / n if n else float("nan")}
                  for (L, d), (n, ok) in sorted(cells.items())]
    n_all = sum(n for n, _ in cells.values())
    r["accuracy"] = sum(ok for _, ok in cells.values()) / n_all if n_all else float("nan")
    per_cell = sorted({n for n, _ in cells.values()})
    r["trials_per_cell"] = per_cell[0] if len(per_cell) == 1 else "%d-%d" % (per_cell[0], per_cell[-1])
    return r


def group_results(results):
    """Results merged per configuration, in the order each configuration first appears."""
    order, groups = [], {}
    for r in results:
        k = config_key(r)
        if k not in groups:
            order.append(k)
            groups[k] = []
        groups[k].append(r)
    return [merge(groups[k]) for k in order]


def load(path):
    """One eval-passkey --json result, or exit with a one-line error naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
    except OSError as e:
        sys.exit("plot_passkey.py: cannot read %s: %s" % (path, e.strerror or e))
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        sys.exit("plot_passkey.py: %s is not JSON (%s); give the output of kvq eval-passkey --json" % (path, e))
    keys = ("model", "cells", "lengths", "depths", "accuracy", "trials_per_cell", "kv_type_k", "kv_type_v", "kv_cache",
            "kv_bytes_per_token")
    missing = [k for k in keys if not isinstance(r, dict) or k not in r]
    if missing:
        sys.exit("plot_passkey.py: %s is not a kvq eval-passkey --json result (no %s)" % (path, ", ".join(missing)))
    return r


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    results = [load(path) for path in sys.argv[1:-1]]
    results = group_results(results)
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
