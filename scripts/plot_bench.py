#!/usr/bin/env python3
"""Decode tokens/s and KV-cache memory against context depth, from `kvq bench --plot` (or --json).

usage: plot_bench.py RESULT.json OUT.png   (RESULT.json = the tool's --json object)
Left: decode tokens/s (median step, log scale) per KV format; right: KV bytes held at that depth (MiB).
The x axis is symmetric-log so that depth 0 fits next to 32K; a dashed line marks the model's training
context when some depths go past it (those points measure speed only).
"""
import sys

import plot_common  # matplotlib's headless backend first
import matplotlib.pyplot as plt
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter


def main():
    r = plot_common.read_result(__doc__)
    series = {}
    for row in r["rows"]:
        name = row["type_k"] if row["type_k"] == row["type_v"] else row["type_k"] + "/" + row["type_v"]
        series.setdefault(name, []).append(row)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for name, rows in series.items():
        rows.sort(key=lambda x: x["depth"])
        d = [x["depth"] for x in rows]
        a1.plot(d, [x["decode_tokens_per_s"] for x in rows], marker="o", label=name)
        a2.plot(d, [x["kv_bytes_used"] / 1048576.0 for x in rows], marker="o", label=name)
    train = r.get("n_ctx_train", 0)
    beyond = any(row.get("beyond_train_ctx", False) for row in r["rows"])
    for ax, title, unit in ((a1, "decode speed", "tokens/s"), (a2, "KV cache held", "MiB")):
        ax.set_xscale("symlog", linthresh=512)
        if beyond and train > 0:  # rows past the training context measure speed only
            ax.axvline(train, color="grey", linestyle="--", linewidth=1, label="training context")
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    a1.set_yscale("log")
    speeds = [row["decode_tokens_per_s"] for row in r["rows"] if row["decode_tokens_per_s"] > 0]
    narrow = speeds and max(speeds) < 20 * min(speeds)  # within about a decade: label every 1..9 step
    a1.yaxis.set_major_locator(LogLocator(base=10, subs=tuple(range(1, 10)) if narrow else (1.0, 2.0, 5.0)))
    a1.yaxis.set_major_formatter(ScalarFormatter())
    a1.yaxis.set_minor_formatter(NullFormatter())
    fig.suptitle("kvq bench: %s, %d threads, %s fill" % (r.get("model_desc", r["model"]), r["n_threads"], r["fill"]),
                 fontsize=9)
    fig.savefig(sys.argv[2], dpi=110, format="png")


if __name__ == "__main__":
    main()
