#!/usr/bin/env bash
# One device-tool call that tests or measures in a row (run from the repo root on the 2-GPU host).
#
#   LLCOMM_COMMIT=<sha> tools/device_run.sh tests [FILE ...]   # GPU test files, each bounded
#   LLCOMM_COMMIT=<sha> tools/device_run.sh bench [NAME ...]   # benchmarks -> $OUT/results/
#   LLCOMM_COMMIT=<sha> tools/device_run.sh timeline [ARGS]     # EP stage timeline (ep_timeline.py)
#
# The device copy of the tree has no .git: LLCOMM_COMMIT names what the results measured.
# Each step gets its own `timeout` and pytest its own per-test `--timeout`, so one hang costs
# one step, not the call, and pytest still prints its failures (a killed pytest prints
# nothing). Logs go to $OUT (the device tool's folder) or out/device; a summary prints last.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
: "${LLCOMM_COMMIT:?set LLCOMM_COMMIT=<sha>: the device copy has no .git}"
DIR=${OUT:-out/device}
mkdir -p "$DIR/tests" "$DIR/results"
SUMMARY=$DIR/summary.txt
: > "$SUMMARY"

# Seconds each step may take (whole file / whole benchmark), measured on 2xH200 (docs/gpu-machine.md).
declare -A TEST_S=([tests/test_tp_gpu.py]=300 [tests/test_ep_gpu.py]=330 [tests/test_fused_gpu.py]=120
                   [tests/test_faults_gpu.py]=400 [tests/test_compile_gpu.py]=180
                   [tests/test_tune.py]=180 [tests/test_cli.py]=240 [tests/test_ep_masks_gpu.py]=120)
declare -A BENCH_S=([tp]=200 [ep]=120 [fused]=120 [decode]=200 [soak]=420)

run_tests() {
    local files=("$@") per_test=()
    python -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout)
    [[ ${#files[@]} -gt 0 ]] || files=(tests/test_tp_gpu.py tests/test_ep_gpu.py tests/test_fused_gpu.py
                                       tests/test_ep_masks_gpu.py tests/test_compile_gpu.py
                                       tests/test_tune.py tests/test_cli.py tests/test_faults_gpu.py)
    for f in "${files[@]}"; do
        local log=$DIR/tests/$(basename "$f" .py).log budget=${TEST_S[$f]:-240}
        timeout "$budget" python -m pytest "$f" -m gpu -v -rA --tb=short \
            ${per_test[@]/%/=$((budget / 2))} > "$log" 2>&1
        echo "$f: exit $? ($(grep -cE ' PASSED' "$log") passed, $(grep -cE ' FAILED| ERROR' "$log") failed)" \
            | tee -a "$SUMMARY"
    done
}

run_benches() {
    local names=("$@")
    [[ ${#names[@]} -gt 0 ]] || names=(ep fused decode tp soak)
    for b in "${names[@]}"; do
        local extra=()
        [[ $b == tp ]] && extra=(--algos all --ops all)
        [[ $b == soak ]] || extra+=(--plot "$DIR/results/h200x2-$b.png")
        timeout "${BENCH_S[$b]:-200}" python -m llcomm bench "$b" --no-progress "${extra[@]}" \
            --json "$DIR/results/h200x2-$b.json" > "$DIR/results/h200x2-$b.txt" 2>&1
        echo "bench $b: exit $?" | tee -a "$SUMMARY"
    done
}

run_timeline() {   # EP stage timeline (tools/ep_timeline.py), bf16 then FP8
    timeout 150 python tools/ep_timeline.py --json "$DIR/results/ep-timeline.json" "$@" \
        > "$DIR/results/ep-timeline.txt" 2>&1
    echo "ep timeline: exit $?" | tee -a "$SUMMARY"
    timeout 150 python tools/ep_timeline.py --fp8 --json "$DIR/results/ep-timeline-fp8.json" \
        "$@" > "$DIR/results/ep-timeline-fp8.txt" 2>&1
    echo "ep timeline fp8: exit $?" | tee -a "$SUMMARY"
}

case "${1:-}" in
    tests) shift; run_tests "$@" ;;
    bench) shift; run_benches "$@" ;;
    timeline) shift; run_timeline "$@" ;;
    *) echo "usage: LLCOMM_COMMIT=<sha> $0 tests|bench|timeline [what ...]" >&2; exit 2 ;;
esac
# The device tool brings back at most 8 files from $OUT per call (more are dropped): past that,
# everything but the summary travels as one archive (tar xzf device-files.tgz here).
if [[ $(find "$DIR" -type f | wc -l) -gt 8 ]]; then
    tar czf "$DIR/device-files.tgz" -C "$DIR" tests results && rm -rf "$DIR/tests" "$DIR/results"
    echo "(logs and results packed into $DIR/device-files.tgz)" >> "$SUMMARY"
fi
echo "--- summary ($DIR)"; cat "$SUMMARY"
