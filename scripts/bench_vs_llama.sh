#!/usr/bin/env bash
# kvq bench beside llama.cpp's llama-bench on the same GGUF file, interleaved so that the load of a
# shared host falls on both alike (issue 14 point 5; docs/perf.md). Each round runs one kvq bench and
# one llama-bench (decode tg N and prefill pp P at each depth, f16 KV cache, flash attention on for
# llama.cpp, as the golden bench.json's command), alternating which goes first; at the end it prints
# every round, the medians and the kvq / llama.cpp ratios (of the medians, and the median of the
# per-round ratios).
#
#   scripts/bench_vs_llama.sh LLAMA_BENCH [MODEL] [ROUNDS] [THREADS] [DEPTHS]
#     LLAMA_BENCH  path of a llama-bench binary (built outside this repository)
#     MODEL        default models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
#     ROUNDS       default 5; THREADS default 2; DEPTHS default 0 (comma-separated)
#   env: KVQ (default build/kvq), N_GEN (128), N_PROMPT (512)
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,15p' "$0"
  exit 2
fi
LLAMA_BENCH=$1
MODEL=${2:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
ROUNDS=${3:-5}
THREADS=${4:-2}
DEPTHS=${5:-0}
KVQ=${KVQ:-build/kvq}
N_GEN=${N_GEN:-128}
N_PROMPT=${N_PROMPT:-512}
for f in "$LLAMA_BENCH" "$KVQ"; do
  [[ -x $f ]] || { echo "error: '$f' is not an executable" >&2; exit 2; }
done
[[ -f $MODEL ]] || { echo "error: model '$MODEL' not found (scripts/fetch-models.sh)" >&2; exit 2; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run_kvq() {
  "$KVQ" bench -m "$MODEL" --types f16 --depths "$DEPTHS" -n "$N_GEN" -p "$N_PROMPT" -r 1 -t "$THREADS" \
    --json --no-progress >"$out/kvq.$1.json"
}
run_llama() {
  "$LLAMA_BENCH" -m "$MODEL" -p "$N_PROMPT" -n "$N_GEN" -t "$THREADS" -r 1 -fa 1 -ctk f16 -ctv f16 \
    -d "$DEPTHS" -o json >"$out/llama.$1.json" 2>"$out/llama.$1.err" ||
    { cat "$out/llama.$1.err" >&2; exit 1; }
}
for ((i = 1; i <= ROUNDS; ++i)); do
  load=$(cut -d' ' -f1 /proc/loadavg)
  if ((i % 2)); then run_kvq "$i"; run_llama "$i"; else run_llama "$i"; run_kvq "$i"; fi
  echo "round $i/$ROUNDS done (load average at start $load)" >&2
done

python3 - "$out" "$ROUNDS" "$MODEL" "$THREADS" <<'EOF'
import json, statistics, sys
out, rounds, model, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = {}  # (test, depth) -> [(kvq, llama) per round]
for i in range(1, rounds + 1):
    k = json.load(open(f"{out}/kvq.{i}.json"))
    l = json.load(open(f"{out}/llama.{i}.json"))
    for r in k["rows"]:
        d = r["depth"]
        rows.setdefault(("decode", d), []).append([r["decode_tokens_per_s"], None])
        rows.setdefault(("prefill", d), []).append([r["prefill_tokens_per_s"], None])
    for r in l:
        test = "decode" if r["n_gen"] > 0 else "prefill"
        rows[(test, r["n_depth"])][-1][1] = r["avg_ts"]
print(f"model {model}, {threads} threads, {rounds} interleaved rounds; tok/s per round (kvq / llama.cpp)")
print("| test | depth | rounds kvq / llama.cpp | median kvq | median llama.cpp | ratio of medians | median of ratios |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for (test, d), v in sorted(rows.items()):
    ks, ls = [a for a, _ in v], [b for _, b in v]
    name = f"tg{json.load(open(f'{out}/kvq.1.json'))['n_decode']}" if test == "decode" else f"pp{json.load(open(f'{out}/kvq.1.json'))['n_prefill']}"
    per = ", ".join(f"{a:.1f} / {b:.1f}" for a, b in v)
    mk, ml = statistics.median(ks), statistics.median(ls)
    print(f"| {name} | {d} | {per} | {mk:.2f} | {ml:.2f} | {mk / ml:.2f} | {statistics.median(a / b for a, b in v):.2f} |")
EOF
