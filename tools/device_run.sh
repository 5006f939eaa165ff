#!/usr/bin/env bash
# One device-tool call that tests or measures in a row (run from the repo root on the 2-GPU host).
#
#   LLCOMM_COMMIT=<sha> tools/device_run.sh tests [FILE ...]   # GPU test files, each bounded
#   LLCOMM_COMMIT=<sha> tools/device_run.sh bench [NAME ...]   # benchmarks -> $OUT/results/
#   LLCOMM_COMMIT=<sha> tools/device_run.sh timeline [ARGS]     # EP stage timeline (ep_timeline.py)
#   LLCOMM_COMMIT=<sha> tools/device_run.sh ab NAME ...         # A/B runs: carry, small-grid, lamport-big, pdl, ...
#   LLCOMM_COMMIT=<sha> tools/device_run.sh link                # tools/nvlink_bw.py (link rates)
#   LLCOMM_COMMIT=<sha> tools/device_run.sh eager               # tools/eager_floor.py (host cost per launch)
#   LLCOMM_COMMIT=<sha> tools/device_run.sh one-gpu             # tools/one_gpu_check.py (2 ranks, 1 GPU)
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
echo "== $*" >> "$SUMMARY"      # several invocations in one device call append

# Seconds each step may take (whole file / whole benchmark), measured on 2xH200 (docs/gpu-machine.md).
declare -A TEST_S=([tests/test_tp_gpu.py]=300 [tests/test_ep_gpu.py]=330 [tests/test_fused_gpu.py]=120
                   [tests/test_faults_gpu.py]=400 [tests/test_compile_gpu.py]=180
                   [tests/test_tune.py]=180 [tests/test_cli.py]=240 [tests/test_ep_masks_gpu.py]=120)
declare -A BENCH_S=([tp]=200 [ep]=120 [fused]=120 [decode]=200 [soak]=420)

run_tests() {
    local files=("$@") per_test=()
    python -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout)
    [[ ${#files[@]} -gt 0 ]] || files=(tests/test_tp_gpu.py tests/test_ep_gpu.py tests/test_ep_fp8_quant.py tests/test_fused_gpu.py
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

# One A/B: the same benchmark under each environment, one text file each ($DIR/results/ab-*).
ab_run() {   # ab_run NAME "ENV ..." ARGS...   (ENV "-" for none)
    local name=$1 envs=$2; shift 2
    [[ $envs == - ]] && envs=
    env $envs timeout 120 python -m llcomm "$@" --no-progress > "$DIR/results/ab-$name.txt" 2>&1
    echo "ab $name: exit $?" | tee -a "$SUMMARY"
}

run_ab() {   # A/B runs named in docs/gpu-machine.md
    for what in "$@"; do
        case $what in
            carry)      # EPBuffer.dispatch(topk_weights=...): combine without its weights exchange
                ab_run carry-off - bench ep --tokens 1,128 --iters 30
                ab_run carry-on - bench ep --tokens 1,128 --iters 30 --carry-weights ;;
            lamport-big) # the multi-chunk Lamport all_reduce up to 16 MiB, by chunk bytes
                for c in 16384 8192 4096 2048; do
                    ab_run lamport-chunk$c "LLCOMM_LAMPORT_CHUNK_BYTES=$c" \
                        bench tp --ops all_reduce --algos all \
                        --sizes 1048576,2097152,4194304,8388608,16777216
                done ;;
            rs-lamport) # reduce_scatter: the Lamport kernel (default) against the flag kernel
                for v in default 0; do
                    ab_run rs-lamport-$v "$([[ $v == 0 ]] && echo LLCOMM_RS_LAMPORT_BYTES=0 || echo -)" \
                        bench tp --ops reduce_scatter --sizes 65536,1048576,4194304,8388608,16777216
                done ;;
            pdl)        # LLCOMM_PDL: programmatic dependent launch of the TP kernels
                for v in 0 1; do ab_run pdl-$v "LLCOMM_PDL=$v" bench tp --algos all \
                    --ops all_reduce,broadcast,all_gather,reduce_scatter \
                    --sizes 8192,65536,262144,1048576,8388608; done ;;
            pdl-ep)     # LLCOMM_PDL on the EP kernels, both buffer shapes
                for v in 0 1; do
                    ab_run pdl-ep-$v-b128 "LLCOMM_PDL=$v" bench ep --tokens 1,128 --iters 30
                    ab_run pdl-ep-$v-b512 "LLCOMM_PDL=$v" bench ep --iters 20
                done ;;
            ep-ll)      # LLCOMM_EP_LL: the LL dispatch (no fence, no flag wait) against the flag one
                ab_run ep-ll-0 "LLCOMM_EP_LL=0" bench ep --tokens 1,128 --iters 30 --fp8 --carry-weights
                ab_run ep-ll-1 "LLCOMM_EP_LL=1" bench ep --tokens 1,128 --iters 30 --fp8 --carry-weights
                ab_run ep-ll-1-rows-first "LLCOMM_EP_LL=1 LLCOMM_EP_ROWS_FIRST=1" bench ep \
                    --tokens 1,128 --iters 30 --fp8 --carry-weights ;;
            ep-blocks)  # LLCOMM_EP_NUM_BLOCKS: fewer EP blocks (fewer flags per wait, less expand)
                for nb in 128 64 32; do ab_run ep-nb-$nb "LLCOMM_EP_NUM_BLOCKS=$nb" bench ep \
                    --tokens 1,128 --iters 30; done ;;
            small-grid) # LLCOMM_NUM_BLOCKS: fewer blocks for the small TP ops
                for nb in 128 32 16; do ab_run nb-$nb "LLCOMM_NUM_BLOCKS=$nb" bench tp \
                    --sizes 8192,65536 --ops all_reduce,broadcast,all_gather --algos all; done ;;
            *) echo "unknown A/B $what (carry, small-grid, lamport-big, rs-lamport, pdl, pdl-ep, ep-ll, ep-blocks)" | tee -a "$SUMMARY" ;;
        esac
    done
}

run_link() {   # link rates: push / pull / TMA / copy engine, and the launch floor
    timeout 200 python tools/nvlink_bw.py --json "$DIR/results/nvlink-bw.json" \
        > "$DIR/results/nvlink-bw.txt" 2>&1
    echo "nvlink_bw: exit $?" | tee -a "$SUMMARY"
}

run_eager() {   # one eager launch's host cost: torch, Triton's binder, llcomm's launcher and plan
    timeout 120 python tools/eager_floor.py --json "$DIR/results/eager-floor.json" \
        > "$DIR/results/eager-floor.txt" 2>&1
    echo "eager floor: exit $?" | tee -a "$SUMMARY"
}

run_one_gpu() {   # the kernels' functional check with two ranks on one GPU (one-GPU machines)
    local log=$DIR/results/one-gpu${1:+-$1}.txt      # one-gpu [NAME]: a second run's own log
    timeout 480 python tools/one_gpu_check.py > "$log" 2>&1
    echo "one-gpu check${1:+ $1}: exit $? ($(grep -cE '^rank [0-9]+ ok ' "$log") ok," \
         "$(grep -cE '^rank [0-9]+ FAIL ' "$log") failed)" | tee -a "$SUMMARY"
}

case "${1:-}" in
    tests) shift; run_tests "$@" ;;
    bench) shift; run_benches "$@" ;;
    timeline) shift; run_timeline "$@" ;;
    ab) shift; run_ab "$@" ;;
    link) shift; run_link ;;
    eager) shift; run_eager ;;
    one-gpu) shift; run_one_gpu "$@" ;;
    *) echo "usage: LLCOMM_COMMIT=<sha> $0 tests|bench|timeline|ab|link|eager|one-gpu [what ...]" >&2; exit 2 ;;
esac
# The device tool brings back at most 8 files from $OUT per call (more are dropped): past that,
# this invocation's logs and results travel as one archive of their own (a later invocation in
# the same call adds another; tar xzf device-files-*.tgz here).
if [[ $(find "$DIR" -type f | wc -l) -gt 8 ]]; then
    pack=device-files-$(date +%s%N).tgz
    tar czf "$DIR/$pack" -C "$DIR" tests results && rm -rf "$DIR/tests" "$DIR/results"
    echo "(logs and results packed into $DIR/$pack)" >> "$SUMMARY"
fi
echo "--- summary ($DIR)"; cat "$SUMMARY"
