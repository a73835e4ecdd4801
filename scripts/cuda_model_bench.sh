#!/usr/bin/env bash
# The model on the GPU in one call on a GPU machine (issue 19's benchmark table, docs/perf.md "CUDA:
# batched decode"): builds kvq and test_cuda with -DKVQ_BUILD_CUDA=ON (runtime and tools on: needs
# PCRE2, nlohmann_json, CLI11, cpp-httplib, fmt, GoogleTest; --deps DIR adds DIR to CMAKE_PREFIX_PATH),
# runs the GPU model tests (tinylit from KVQ_DATA_DIR), then `kvq bench --device cuda` on the
# Llama-3.1-8B and Qwen2.5-1.5B shapes with random f16 weights: decode steps at batch 1 / 16 and
# depth 4K / 32K for f16 / q8 / q4 caches, and the number of 128K-token sequences each type fits
# (Llama shape), each step timed directly and as a CUDA graph; prefill of 4K / 32K-token prompts
# (chunks of 512) with the tiled prefill kernel beside the per-token decode path (--prefill-per-token-max
# caps the baseline's prompt length). --hf: also PyTorch + transformers on the same shapes in the same
# call (scripts/hf_decode_bench.py: bf16 weights, SDPA, DynamicCache; decode at batch 1 x 4K, 16 x 32K,
# 4 x 128K, prefill 4K / 32K) beside `kvq bench --json` rows of those shapes, and the kvq / transformers
# ratios. Logs and JSON go to $OUT (or build-cuda-model/out).
#   scripts/cuda_model_bench.sh [--deps DIR] [--build DIR] [--no-tests] [--no-bench] [--no-decode]
#                               [--no-prefill] [--prefill-per-token-max N] [-n STEPS] [--hf]
# --deps DIR: a prefix with the libraries the GPU machine lacks; its lib/pkgconfig/*.pc.in (prefix
# @DEPS@) become .pc files, its bin/ and lib/ join PATH and LD_LIBRARY_PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build-cuda-model/out}
mkdir -p "$out"
deps="" tests=1 bench=1 steps=10 build=build-cuda-model decode=1 prefill=1 pt_max=32k hf=0
while [ $# -gt 0 ]; do
  case "$1" in
    --deps) deps=$2; shift ;;
    --no-tests) tests=0 ;;
    --no-bench) bench=0 ;;
    --no-decode) decode=0 ;;
    --no-prefill) prefill=0 ;;
    --hf) hf=1 ;;
    --prefill-per-token-max) pt_max=$2; shift ;;
    --build) build=$2; shift ;;
    -n) steps=$2; shift ;;
  esac
  shift
done
if [ -n "$deps" ]; then
  for f in "$deps"/lib/pkgconfig/*.pc.in; do [ -e "$f" ] && sed "s|@DEPS@|$deps|" "$f" > "${f%.in}"; done
  export PKG_CONFIG_PATH=$deps/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  command -v pkg-config > /dev/null || export PATH=$deps/bin:$PATH
fi
echo "commit: ${KVQ_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" | tee "$out/device.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee -a "$out/device.txt"
nvcc --version | tail -2 | tee -a "$out/device.txt"

t0=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_BUILD_CUDA=ON -DKVQ_BUILD_RUNTIME=ON \
  -DKVQ_BUILD_TOOLS=ON -DKVQ_BUILD_PYTHON=OFF -DKVQ_BUILD_TESTS=ON -DKVQ_BUILD_BENCH=OFF \
  ${deps:+-DCMAKE_PREFIX_PATH=$deps} > "$out/build.log" 2>&1 &&
  cmake --build "$build" -j"$(nproc)" --target kvq test_cuda >> "$out/build.log" 2>&1 ||
  { grep -E "error|Error" -A3 "$out/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

status=0
if [ $tests = 1 ]; then
  $build/tests/test_cuda --gtest_filter='*CudaModel*:*CudaRuntime*:*CudaPrefill*' > "$out/test.log" 2>&1
  grep -E "^\[ (gpu|batched|beside|bench|greedy|graph|tiled|prefill)|Failure|FAILED|PASSED|SKIPPED \]" "$out/test.log" | head -60
  grep -q "FAILED" "$out/test.log" && status=1
fi
if [ $bench = 1 ]; then
  kvq=$build/kvq
  if [ $prefill = 1 ]; then
    for shape in qwen2.5-1.5b llama3.1-8b; do
      $kvq bench --device cuda --shape $shape --types f16,q8,q4 --prefill 4k,32k --prefill-chunk 512 \
        --prefill-per-token-max "$pt_max" --no-progress 2>&1 | tee "$out/prefill_$shape.txt"
    done
  fi
fi
if [ $bench = 1 ] && [ $decode = 1 ]; then
  kvq=$build/kvq
  $kvq bench --device cuda --shape llama3.1-8b --types f16,q8,q4 --batch 1,16 --depths 4k,32k --capacity 128k --cuda-graphs \
    -n "$steps" --no-progress 2>&1 | tee "$out/bench_llama.txt"
  $kvq bench --device cuda --shape qwen2.5-1.5b --types f16,q8,q4 --batch 1,16 --depths 4k,32k --cuda-graphs \
    -n "$steps" --no-progress 2>&1 | tee "$out/bench_qwen.txt"
fi
if [ $bench = 1 ] && [ $hf = 1 ]; then
  kvq=$build/kvq
  python3 -m pip show torch transformers optimum-quanto hqq 2>&1 | grep -E "^(Name|Version)|not found" | tee "$out/hf_packages.txt"
  jsons=()
  for shape in llama3.1-8b qwen2.5-1.5b; do
    for bd in 1:4k 16:32k 4:128k; do
      j="$out/kvq_${shape}_${bd/:/x}.json"
      $kvq bench --device cuda --shape $shape --types f16,q8,q4 --batch ${bd%%:*} --depths ${bd##*:} --cuda-graphs \
        -n "$steps" --no-progress --json > "$j" 2> "$j.err" && jsons+=("$j") || { echo "kvq bench $shape $bd failed"; tail -3 "$j.err"; }
    done
    j="$out/kvq_${shape}_prefill.json"
    $kvq bench --device cuda --shape $shape --types f16,q8,q4 --prefill 4k,32k --prefill-chunk 512 \
      --prefill-per-token-max 1 --no-progress --json > "$j" 2> "$j.err" && jsons+=("$j") || { echo "kvq bench $shape prefill failed"; tail -3 "$j.err"; }
  done
  PYTHONUNBUFFERED=1 python3 scripts/hf_decode_bench.py --steps "$steps" --json "$out/hf.json" --kvq-json "${jsons[@]}" \
    2>&1 | tee "$out/hf.txt" | grep -v '^{'
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | tee -a "$out/device.txt"
exit $status
