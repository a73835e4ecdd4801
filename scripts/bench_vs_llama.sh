#!/usr/bin/env bash
# kvq bench beside llama.cpp's llama-bench on the same GGUF file, in the same window so that the
# load of a shared host falls on both alike (issue 14 point 5; docs/perf.md). One round runs, as
# separate jobs: one kvq bench over every kvq KV format (kvq interleaves its formats step by step)
# and one llama-bench per llama.cpp KV type (flash attention on, as the golden bench.json's
# command). Tests: prefill pp P at depth 0, decode tg N at each depth. At the end it prints every
# round, the medians, and the ratios of kvq to llama.cpp (of the medians, and the median of the
# per-round ratios), against the same type and against llama.cpp's fastest KV type at that row.
#
#   scripts/bench_vs_llama.sh LLAMA_BENCH [MODEL] [ROUNDS] [THREADS] [DEPTHS]
#     LLAMA_BENCH  path of a llama-bench binary (built outside this repository)
#     MODEL        default models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
#     ROUNDS       default 3; THREADS default 2; DEPTHS default 0,4096,16384 (comma-separated)
#   env:
#     KVQ          kvq binary (default build/kvq)
#     N_GEN        decode tokens (128); N_PROMPT prefill tokens at depth 0 (512; 0: no prefill)
#     KVQ_TYPES    kvq formats, K/V pairs and +sinkN allowed (f16,q8,q4,kivi4/q4a+sink4: the README's
#                  recommended -ctk kivi4 -ctv q4a --kv-sink 4)
#     LLAMA_TYPES  llama.cpp KV types, K and V alike (f16,q8_0,q4_0)
#     KVQ_FILL     how kvq fills a depth: real (a prefill, as llama-bench does) or synthetic (K/V
#                  appended with the model's measured statistics: same cache bytes, no prefill cost)
#     CPUSETS      space-separated CPU lists, e.g. "2,3 4,5 6,7 8,9". Empty (default): the jobs of a
#                  round run one after another, the order alternating between rounds, unpinned or
#                  pinned to PIN (a CPU list for taskset). Given: the jobs of a round run at the same
#                  time, job j on CPU list (j + round) mod n (rounds still one after another).
#     REPS         timed repetitions inside each job (1): llama-bench -r REPS (it fills a depth once
#                  and restores it for the next repetition) and REPS kvq benches in a row; every
#                  repetition is listed as its own sample
#     SPLIT_DEPTHS  1: one llama-bench job per KV type and depth (with CPUSETS, so that the deep
#                  fills run side by side); default 0
#     KEEP         folder to keep every raw JSON in (default: a temporary folder, removed)
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,35p' "$0"
  exit 2
fi
LLAMA_BENCH=$1
MODEL=${2:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
ROUNDS=${3:-3}
THREADS=${4:-2}
DEPTHS=${5:-0,4096,16384}
KVQ=${KVQ:-build/kvq}
export N_GEN=${N_GEN:-128}
export N_PROMPT=${N_PROMPT:-512}
KVQ_TYPES=${KVQ_TYPES:-f16,q8,q4,kivi4/q4a+sink4}
LLAMA_TYPES=${LLAMA_TYPES:-f16,q8_0,q4_0}
KVQ_FILL=${KVQ_FILL:-real}
CPUSETS=${CPUSETS:-}
PIN=${PIN:-}
KEEP=${KEEP:-}
export REPS=${REPS:-1}
SPLIT_DEPTHS=${SPLIT_DEPTHS:-0}
for f in "$LLAMA_BENCH" "$KVQ"; do
  [[ -x $f ]] || { echo "error: '$f' is not an executable" >&2; exit 2; }
done
[[ -f $MODEL ]] || { echo "error: model '$MODEL' not found (scripts/fetch-models.sh)" >&2; exit 2; }
[[ $KVQ_FILL == real || $KVQ_FILL == synthetic ]] || { echo "error: KVQ_FILL '$KVQ_FILL' must be real or synthetic" >&2; exit 2; }
if [[ -n $KEEP ]]; then out=$KEEP; mkdir -p "$out"; else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
deep=$(tr ',' '\n' <<<"$DEPTHS" | awk '$1 != 0' | paste -sd, -)
has0=$(tr ',' '\n' <<<"$DEPTHS" | awk '$1 == 0 {print "yes"}' | head -1)

# job NAME ROUND CPUS: one kvq bench (every format) or one llama-bench type; output $out/NAME.ROUND.*.json
job() {
  local name=$1 i=$2 cpus=$3 pin=()
  [[ -n $cpus ]] && pin=(taskset -c "$cpus")
  if [[ $name == kvq ]]; then
    local k
    for ((k = 1; k <= REPS; ++k)); do
      if [[ -n $has0 ]]; then
        "${pin[@]}" "$KVQ" bench -m "$MODEL" --types "$KVQ_TYPES" --depths 0 -n "$N_GEN" -p "$N_PROMPT" -r 1 \
          -t "$THREADS" --json --no-progress >"$out/kvq.$i.d0.$k.json"
      fi
      if [[ -n $deep ]]; then
        "${pin[@]}" "$KVQ" bench -m "$MODEL" --types "$KVQ_TYPES" --depths "$deep" -n "$N_GEN" -p 0 \
          --fill "$KVQ_FILL" -t "$THREADS" --json --no-progress >"$out/kvq.$i.deep.$k.json"
      fi
    done
  else
    local t=${name#llama-} d=$DEPTHS
    [[ $t == *@* ]] && { d=${t#*@}; t=${t%@*}; }
    if [[ $d == "$DEPTHS" && -n $has0 && $N_PROMPT -gt 0 ]] || [[ $d == 0 && $N_PROMPT -gt 0 ]]; then
      "${pin[@]}" "$LLAMA_BENCH" -m "$MODEL" -p "$N_PROMPT" -n 0 -t "$THREADS" -r "$REPS" -fa 1 -ctk "$t" -ctv "$t" \
        -d 0 -o json >"$out/$name.$i.pp.json" 2>"$out/$name.$i.pp.err" || { cat "$out/$name.$i.pp.err" >&2; return 1; }
    fi
    "${pin[@]}" "$LLAMA_BENCH" -m "$MODEL" -p 0 -n "$N_GEN" -t "$THREADS" -r "$REPS" -fa 1 -ctk "$t" -ctv "$t" \
      -d "$d" -o json >"$out/$name.$i.tg.json" 2>"$out/$name.$i.tg.err" || { cat "$out/$name.$i.tg.err" >&2; return 1; }
  fi
}

jobs=(kvq)
for t in ${LLAMA_TYPES//,/ }; do
  if [[ $SPLIT_DEPTHS == 1 ]]; then
    for d in ${DEPTHS//,/ }; do jobs+=("llama-$t@$d"); done
  else
    jobs+=("llama-$t")
  fi
done
read -r -a sets <<<"$CPUSETS"
for ((i = 1; i <= ROUNDS; ++i)); do
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  start=$(date +%s)
  if ((${#sets[@]} > 0)); then
    pids=()
    for ((j = 0; j < ${#jobs[@]}; ++j)); do
      job "${jobs[j]}" "$i" "${sets[(j + i) % ${#sets[@]}]}" & pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
  else
    order=("${jobs[@]}")
    if ((i % 2 == 0)); then order=(); for ((j = ${#jobs[@]} - 1; j >= 0; --j)); do order+=("${jobs[j]}"); done; fi
    for n in "${order[@]}"; do job "$n" "$i" "$PIN"; done
  fi
  echo "round $i/$ROUNDS done in $(($(date +%s) - start)) s (load average at start $load)" >&2
done

python3 - "$out" "$ROUNDS" "$MODEL" "$THREADS" "$LLAMA_TYPES" "$KVQ_FILL" "${CPUSETS:-${PIN:-unpinned}}" <<'EOF'
import glob, json, os, statistics, sys
out, rounds, model, threads, ltypes, fill, pin = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
ltypes = ltypes.split(",")
vals = {}  # (test, depth) -> config -> [tok/s per round and repetition]
def add(test, depth, cfg, v):
    vals.setdefault((test, depth), {}).setdefault(cfg, []).append(v)
kvq_cfgs = []
n_tg, n_pp = os.environ.get("N_GEN", "128"), os.environ.get("N_PROMPT", "512")
for i in range(1, rounds + 1):
    for part in ("d0", "deep"):
        for f in sorted(glob.glob(f"{out}/kvq.{i}.{part}.*.json"), key=lambda f: int(f.split(".")[-2])):
            for r in json.load(open(f))["rows"]:
                if r.get("baseline_only"):
                    continue
                cfg = "kvq " + (r["type_k"] if r["type_k"] == r["type_v"] else r["type_k"] + "/" + r["type_v"]) + \
                      (f"+sink{r['sink']}" if r.get("sink") else "")
                if cfg not in kvq_cfgs:
                    kvq_cfgs.append(cfg)
                add("tg", r["depth"], cfg, r["decode_tokens_per_s"])
                if part == "d0" and r["prefill_tokens_per_s"] > 0:
                    add("pp", 0, cfg, r["prefill_tokens_per_s"])
    for t in ltypes:
        for f in sorted(glob.glob(f"{out}/llama-{t}.{i}.*.json") + glob.glob(f"{out}/llama-{t}@*.{i}.*.json")):
            if os.path.getsize(f) == 0:  # a job stopped before it wrote (e.g. by a timeout)
                print(f"note: {os.path.basename(f)} is empty: no result", file=sys.stderr)
                continue
            for r in json.load(open(f)):
                for v in r.get("samples_ts") or [r["avg_ts"]]:
                    add("pp" if r["n_gen"] == 0 else "tg", r["n_depth"], "llama " + t, v)
fmt = lambda v: "-" if v is None else f"{v:.1f}"
med = lambda v: statistics.median([x for x in v if x is not None])
print(f"model {model}, {threads} threads, {rounds} rounds x {os.environ.get('REPS', '1')} repetitions, kvq fill {fill}, CPUs {pin}; tok/s")
print("| test | depth | config | per round (and repetition) | median |")
print("| --- | --- | --- | --- | --- |")
for (test, d), byc in sorted(vals.items()):
    for cfg in kvq_cfgs + ["llama " + t for t in ltypes]:
        if cfg in byc:
            print(f"| {test}{n_tg if test == 'tg' else n_pp} | {d} | {cfg} | {', '.join(fmt(v) for v in byc[cfg])} | {med(byc[cfg]):.2f} |")
print()
print("kvq / llama.cpp: ratio of medians (median of per-round ratios); 'fastest' = llama.cpp's KV type with the highest median at that row")
same = {"kvq f16": "llama f16", "kvq q8": "llama q8_0", "kvq q4": "llama q4_0"}
print("| test | depth | config | vs llama.cpp same bits | vs llama.cpp fastest (type) |")
print("| --- | --- | --- | --- | --- |")
def ratio(a, b):
    per = [x / y for x, y in zip(a, b)]  # same round and repetition
    return f"{med(a) / med(b):.2f}x ({statistics.median(per):.2f}x)" if per else "-"
for (test, d), byc in sorted(vals.items()):
    lc = [c for c in byc if c.startswith("llama ")]
    if not lc:
        continue
    best = max(lc, key=lambda c: med(byc[c]))
    for cfg in kvq_cfgs:
        if cfg not in byc:
            continue
        s = same.get(cfg)
        print(f"| {test}{n_tg if test == 'tg' else n_pp} | {d} | {cfg} | {ratio(byc[cfg], byc[s]) if s in byc else '-'} | {ratio(byc[cfg], byc[best])} ({best[6:]}) |")
EOF
