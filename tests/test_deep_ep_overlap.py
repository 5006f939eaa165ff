"""Single-batch overlap arguments of ``low_latency_combine`` (``llcomm/deep_ep/overlap.py``).

On gloo (2 ranks, reference backend): a thread plays the expert GEMM, writing the expert
outputs block by block and raising each block's compute signal only after its rows are written
(in several steps, as a GEMM counts its tiles), while ``low_latency_combine(overlap=True, ...)``
runs; the result must equal the normal combine of the finished outputs, bit for bit, for both
forms of signals (Hopper's per-block ``comp_signal``, Blackwell's per-expert ``src_signals``),
with and without a receive hook. A signal that never reaches its threshold raises
``CommTimeoutError`` naming it within the buffer's bound; bad arguments raise naming them
before anything is sent. The device kernel's wait (``overlap_kernel.py``) runs under Triton's
interpreter: signals raised late from another thread, and one never raised.
"""
from __future__ import annotations

import threading
import time

import torch

from _deep_ep_case import case
from _dist import run_distributed
from _interp import run_in_interpreter
from test_ep_reference import _expect

W, L, T, H, K = 2, 3, 6, 256, 3
E = W * L
R = W * T


def _gemm(out, done, count, block_m, signal, per_expert, steps, delay, value=None):
    """A thread that copies ``done`` into ``out`` one (expert, block) at a time, then raises
    that block's signal in ``steps`` increments (to ``value`` at the end, if given)."""
    def run():
        for e in range(L):
            blocks = -(-int(count[e]) // block_m) if block_m else 1
            for b in range(blocks):
                time.sleep(delay)
                rows = slice(b * block_m, (b + 1) * block_m) if block_m else slice(None)
                out[e, rows] = done[e, rows]
                i = e * per_expert + b
                for _ in range(steps):
                    signal[i] += 1
                if value is not None:
                    signal[i] = value
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def _rounds_body(rank, world):
    import llcomm.deep_ep as deep_ep
    fails = []
    buf = deep_ep.Buffer(None, backend="reference")
    for seed, hook_on, form in ((3, False, "hopper"), (6, True, "hopper"),
                                (9, False, "blackwell"), (12, True, "blackwell")):
        x, idx, w = case(W, E, T, H, K, seed)[rank]
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        done = (recv_x.float() * 2 + 1).bfloat16()
        ref, _, _ = buf.low_latency_combine(done, idx, w, handle)
        target = torch.zeros_like(done)
        if form == "hopper":
            block_m, threshold = 2, 3
            per_expert = -(-R // block_m)
            signal = torch.zeros(L * per_expert, dtype=torch.int32)
            th = _gemm(target, done, count, block_m, signal, per_expert, threshold, 0.03)
            kw = dict(packed_recv_count=count, comp_signal=signal, block_m=block_m,
                      threshold=threshold, num_sms=3)
        else:
            expect = 2 ** 31 + 5                   # past int32: compared as uint32
            signal = torch.zeros(L, dtype=torch.uint32)
            th = _gemm(target, done, count, 0, signal, 1, 0, 0.05, value=expect)
            kw = dict(src_signals=signal, src_signal_expect_value=expect)
        t0 = time.monotonic()
        y, _, hook = buf.low_latency_combine(target, idx, w, handle, overlap=True,
                                             return_recv_hook=hook_on, **kw)
        waited = time.monotonic() - t0
        if hook_on:
            hook()
        th.join()
        tag = f"[rank {rank} seed {seed} {form} hook {hook_on}]"
        if not torch.equal(y, ref):
            fails.append(f"{tag}: the overlapped combine differs from the normal one")
        if waited < 0.03:
            fails.append(f"{tag}: the combine returned after {waited:.3f} s, before the "
                         "thread's first block")
    return fails


def test_overlapped_combine_waits_for_the_signals():
    fails = [f for r in run_distributed(_rounds_body, W) for f in r]
    assert fails == []


def _timeout_body(rank, world):
    import llcomm.deep_ep as deep_ep
    from llcomm.errors import CommTimeoutError
    buf = deep_ep.Buffer(None, backend="reference", timeout_ms=400)
    x, idx, w = case(W, E, T, H, K, 6)[rank]
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    signal = torch.full((L * R,), 5, dtype=torch.int32)
    first = next(e for e in range(L) if int(count[e]))
    signal[first * R + int(count[first]) - 1] = 4           # one block short of threshold 5
    t0 = time.monotonic()
    try:
        buf.low_latency_combine(recv_x, idx, w, handle, overlap=True, packed_recv_count=count,
                                comp_signal=signal, block_m=1, threshold=5)
    except CommTimeoutError as e:
        took = time.monotonic() - t0
        words = ["timeout_ms=400", f"local expert {first}", f"block {int(count[first]) - 1}",
                 "threshold"]
        missing = [wd for wd in words if wd not in str(e)]
        return ([f"message lacks {missing}: {e}"] if missing else []) + \
            ([f"raised after {took:.2f} s"] if not 0.35 < took < 3 else [])
    return ["no CommTimeoutError"]


def test_a_signal_that_never_arrives_times_out():
    fails = [f for r in run_distributed(_timeout_body, W) for f in r]
    assert fails == []


def _refusals_body(rank, world):
    import llcomm.deep_ep as deep_ep
    errors = []
    buf = deep_ep.Buffer(None, backend="reference")
    x, idx, w = case(W, E, T, H, K, 6)[rank]
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    sig = torch.zeros(L * R, dtype=torch.int32)

    def expect(what, exc, words, **kw):
        args = dict(overlap=True, packed_recv_count=count, comp_signal=sig, block_m=1,
                    threshold=1) | kw
        _expect(errors, what, exc, words,
                lambda: buf.low_latency_combine(recv_x, idx, w, handle, **args))

    expect("overlap type", TypeError, ["overlap=1"], overlap=1)
    expect("signal dtype", TypeError, ["comp_signal", "torch.int32"],
           comp_signal=sig.to(torch.int64))
    expect("signal size", ValueError, ["comp_signal", f"at least {L * R}"],
           comp_signal=sig[:-1])
    expect("signal shape", ValueError, ["comp_signal", "1-D"], comp_signal=sig.view(L, R))
    expect("no count", ValueError, ["packed_recv_count"], packed_recv_count=None)
    expect("count dtype", TypeError, ["packed_recv_count", "int32"],
           packed_recv_count=count.long())
    expect("block_m", ValueError, ["block_m=0"], block_m=0)
    expect("threshold", ValueError, ["threshold=0"], threshold=0)
    expect("num_sms", TypeError, ["num_sms"], num_sms="3")
    expect("both forms", ValueError, ["comp_signal", "src_signals"],
           src_signals=torch.zeros(L, dtype=torch.uint32))
    expect("src dtype", TypeError, ["src_signals"], comp_signal=None,
           src_signals=torch.zeros(L, dtype=torch.float32))
    expect("expect value", ValueError, ["src_signal_expect_value"], comp_signal=None,
           src_signals=torch.zeros(L, dtype=torch.uint32), src_signal_expect_value=1 << 32)
    # nothing was sent: the buffer is still in step with its peer
    y, _, _ = buf.low_latency_combine(recv_x, idx, w, handle, overlap=False, comp_signal=sig)
    if y.shape != x.shape:
        errors.append("the combine after the refusals did not run")
    return errors


def test_overlap_refusals_name_the_argument():
    errors = [e for r in run_distributed(_refusals_body, W) for e in r]
    assert errors == []


# -- the device wait under Triton's interpreter ------------------------------------------------
def simulate_wait(counts, block_m, threshold, never, timeout_us, unsigned):
    """Inside the interpreter: ``wait_signals`` over int32 signals that a thread raises late,
    one per 20 ms; ``never`` (an index or -1) is never raised. Returns (status, seconds, the
    indices the kernel had to wait for that were below threshold when it returned)."""
    from llcomm.deep_ep.overlap import signals_to_wait
    from llcomm.deep_ep.overlap_kernel import wait_signals
    n = len(counts)
    per = -(-max(max(counts), 1) // block_m) if block_m else 1
    sig = torch.zeros(n * per, dtype=torch.int32)
    cnt = torch.tensor(counts, dtype=torch.int32)
    want = signals_to_wait(cnt if block_m else None, n, per, block_m or 1)
    value = threshold - 2 ** 32 if unsigned and threshold >= 2 ** 31 else threshold

    def raise_late():
        for i in want:
            time.sleep(0.02)
            if i != never:
                sig[i] = value
    th = threading.Thread(target=raise_late, daemon=True)
    th.start()
    status = torch.zeros(1, dtype=torch.int64)
    t0 = time.monotonic()
    wait_signals[(n,)](sig, cnt, status, per, block_m or 1, threshold, timeout_us,
                       HAS_COUNTS=bool(block_m), UNSIGNED=unsigned)
    took = time.monotonic() - t0
    low = [i for i in want if (int(sig[i]) & 0xFFFFFFFF if unsigned else int(sig[i])) < threshold]
    th.join()
    return int(status[0]), took, low


def test_wait_kernel_in_the_interpreter():
    counts = [3, 0, 5]
    status, took, low = run_in_interpreter("test_deep_ep_overlap", "simulate_wait", counts, 2, 7,
                                           -1, 30_000_000, False)
    assert status == 0 and low == [] and took >= 0.02 * 5      # 2 + 0 + 3 blocks, one by one
    # the Blackwell form: one unsigned word per expert, a threshold past int32
    status, took, low = run_in_interpreter("test_deep_ep_overlap", "simulate_wait", counts, 0,
                                           2 ** 31 + 9, -1, 30_000_000, True)
    assert status == 0 and low == []
    # signal 6 (expert 2, block 0: three signals per expert) is never raised
    status, took, low = run_in_interpreter("test_deep_ep_overlap", "simulate_wait", counts, 2, 7,
                                           6, 300_000, False)
    assert status == 1 + 6 and low == [6] and took < 10
