#!/usr/bin/env bash
# The CUDA backend in one call on a GPU machine (docs/perf.md "CUDA"): configures the main CMake
# project with -DKVQ_BUILD_CUDA=ON (and -DKVQ_BUILD_RUNTIME=OFF: the GPU machine has no PCRE2, and
# these targets need no tokenizer), builds test_cuda, bench_cuda_decode and bench_cuda_model from
# the same source lists as every other build, runs the correctness tests, compute-sanitizer memcheck
# once on the test binary, then the decode benchmark, PyTorch SDPA and the model benchmark (tinylit
# from KVQ_DATA_DIR, when there). Logs and JSON go to $OUT (or build-cuda-dev/out). Needs nvcc, CMake, Ninja, fmt, GoogleTest and Google Benchmark.
#   scripts/cuda_bench.sh [--no-sanitize] [--no-bench] [--batch 1,8,32] [--ctx 4096,32768,131072]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build-cuda-dev/out}
mkdir -p "$out"
sanitize=1 bench=1 batch=1,8,32 ctx=4096,32768,131072
while [ $# -gt 0 ]; do
  case "$1" in
    --no-sanitize) sanitize=0 ;;
    --no-bench) bench=0 ;;
    --batch) batch=$2; shift ;;
    --ctx) ctx=$2; shift ;;
  esac
  shift
done
echo "commit: ${KVQ_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" | tee "$out/device.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee -a "$out/device.txt"
nvcc --version | tail -2 | tee -a "$out/device.txt"

t0=$(date +%s)
cmake -S . -B build-cuda-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_BUILD_CUDA=ON -DKVQ_BUILD_RUNTIME=OFF \
  -DKVQ_BUILD_TESTS=ON -DKVQ_BUILD_BENCH=ON > "$out/build.log" 2>&1 &&
  cmake --build build-cuda-dev -j"$(nproc)" --target test_cuda bench_cuda_decode bench_cuda_model >> "$out/build.log" 2>&1 ||
  { tail -50 "$out/build.log"; exit 1; }
test_bin=build-cuda-dev/tests/test_cuda bench_bin=build-cuda-dev/bench/bench_cuda_decode
echo "build: $(( $(date +%s) - t0 )) s"

status=0
if [ -x $test_bin ]; then
  $test_bin 2>&1 | tee "$out/test.log" | grep -E "^\[ rel err|FAILED|PASSED|SKIPPED|tests ran|Failure|error" || true
  grep -q "FAILED" "$out/test.log" && status=1
  if [ $sanitize = 1 ]; then
    # memcheck once over the test binary; the 32768-token batches are left out to keep it inside minutes
    compute-sanitizer --tool memcheck --error-exitcode 3 $test_bin \
      --gtest_filter='-*_b17_*:*_l32768*' > "$out/memcheck.log" 2>&1
    echo "compute-sanitizer memcheck exit $? ($(grep -c 'PASSED\|OK \]' "$out/memcheck.log") ok lines): $(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1)"
  fi
fi
if [ $bench = 1 ]; then
  $bench_bin --batch "$batch" --ctx "$ctx" --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -14
  PYTHONUNBUFFERED=1 python3 scripts/cuda_sdpa.py --batch "$batch" --ctx "$ctx" --json "$out/bench.json" 2>&1 | tee "$out/sdpa.log" | tail -12
  # the model on the GPU beside the CPU engine (tinylit from KVQ_DATA_DIR, when there)
  tl=${KVQ_DATA_DIR:-../shared}/models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf
  [ -f "$tl" ] && build-cuda-dev/bench/bench_cuda_model "$tl" --prefill 512 --decode 256 2>&1 | tee "$out/model_bench.log"
fi
exit $status
