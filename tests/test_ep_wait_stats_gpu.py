"""GPU tests of the wait statistics (``EPBuffer.dispatch / combine(wait_stats=...)`` and DeepEP's
``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats``), peer backend, 2 GPUs.

The interpreter cannot read the GPU's clock, so the timing is checked only here:

- Results with statistics equal the oracle (the STATS kernels move the same data).
- The statistics only grow, and stay nonnegative; a call without them leaves them alone.
- A peer that sleeps ``DELAY_S`` on the host before it calls shows in the waiting rank's entry
  for it: at least half the sleep (each block waits about the whole sleep, and the entries sum
  over blocks), and more than the entry of the rank that did not sleep. The sleep is 100 ms
  against waits of microseconds, so the comparison has a margin of thousands, not a timing.
- Both dispatch kernels (the LL one, the flag one: ``LLCOMM_EP_LL=0``), the combine, the split
  phase (``return_recv_hook=True``) and a replayed CUDA graph.
- Rank masks: the entry of a rank masked by hand stays exactly 0 (it is never waited for).
- ``llcomm.deep_ep``: the same through DeepEP's arguments.

Run on a 2-GPU host: ``python -m pytest tests/test_ep_wait_stats_gpu.py -m gpu -x -q``.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from test_ep_masks_gpu import DTYPE, E, H, T, _round

pytestmark = pytest.mark.gpu

DELAY_S = 0.1
SLEEPER = 1


def _zeros(W):
    return torch.zeros(W, dtype=torch.int64, device="cuda")


def _delayed_rounds(buf, rank, W, seed, which):
    """A round in which SLEEPER sleeps before the dispatch (``which`` 0) or the combine (1);
    returns this rank's (dispatch, combine) statistics of that round alone, checked: results
    equal the oracle, entries nonnegative."""
    ds, cs = _zeros(W), _zeros(W)
    dist.barrier()
    delay = [0.0, 0.0]
    if rank == SLEEPER:
        delay[which] = DELAY_S
    _round(buf, rank, W, seed, stats=(ds, cs), delay=tuple(delay))
    torch.cuda.synchronize()
    d, c = ds.tolist(), cs.tolist()
    assert min(d + c) >= 0, (d, c)
    return d, c


def _stats_body(rank, W, ll):
    import llcomm.ep as ep
    os.environ["LLCOMM_EP_LL"] = ll            # both ranks: the settings must agree
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T, dtype=DTYPE,
                      backend="peer", timeout_ms=5000)
    assert buf._impl.ll == int(ll)
    # the compiles of both variants (a first launch waits up to 60 s for the peer's compile)
    _round(buf, rank, W, 3, stats=(_zeros(W), _zeros(W)))
    _round(buf, rank, W, 6)
    # grows, never shrinks; a call without statistics leaves them alone
    ds, cs = _zeros(W), _zeros(W)
    seen = []
    for seed in (9, 12, 15):
        _round(buf, rank, W, seed, stats=(ds, cs))
        torch.cuda.synchronize()
        seen.append(ds.tolist() + cs.tolist())
    _round(buf, rank, W, 18)
    torch.cuda.synchronize()
    assert ds.tolist() + cs.tolist() == seen[-1], "a call without wait_stats changed them"
    for a, b in zip(seen, seen[1:]):
        assert all(0 <= x <= y for x, y in zip(a, b)), seen
    # a sleeping peer shows in the waiting rank's entry for it
    for which in (0, 1):
        d, c = _delayed_rounds(buf, rank, W, 21 + 3 * which, which)
        got = (d, c)[which]
        if rank != SLEEPER:
            assert got[SLEEPER] >= DELAY_S * 1e9 / 2, (which, d, c)
            assert got[SLEEPER] > 10 * got[rank], (which, d, c)
    # split phase: the receive halves are timed too (the first split round compiles the
    # halves' STATS variants, which takes far longer than the sleep: it is not the timed one)
    x = torch.randn(T, H, dtype=DTYPE, device="cuda")
    idx = torch.randint(0, E, (T, 2), device="cuda")
    w = torch.rand(T, 2, device="cuda")
    for delayed in (False, True):
        ds, cs = _zeros(W), _zeros(W)
        dist.barrier()
        if delayed and rank == SLEEPER:
            time.sleep(DELAY_S)
        rx, rc, h, hook = buf.dispatch(x, idx, return_recv_hook=True, wait_stats=ds)
        hook()
        y, hook = buf.combine(rx, idx, w, h, return_recv_hook=True, wait_stats=cs)
        hook()
        buf.check()
    if rank != SLEEPER:
        assert ds[SLEEPER].item() >= DELAY_S * 1e9 / 2, ds.tolist()
    # a CUDA graph: each replay adds; the sleeper's replay is late (warmed up eagerly first)
    rx, rc, h = buf.dispatch(x, idx, wait_stats=_zeros(W))
    buf.combine(rx, idx, w, h, wait_stats=_zeros(W))
    buf.check()
    ds, cs = _zeros(W), _zeros(W)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        rx, rc, h = buf.dispatch(x, idx, wait_stats=ds)
        buf.combine(rx, idx, w, h, wait_stats=cs)
    torch.cuda.current_stream().wait_stream(s)
    assert ds.tolist() == [0] * W, "the capture ran the kernels"
    before = []
    for i in range(3):
        dist.barrier()
        if rank == SLEEPER and i == 2:
            time.sleep(DELAY_S)
        g.replay()
        torch.cuda.synchronize()
        before.append(ds.tolist())
    buf.check()
    assert all(0 <= a <= b for a, b in zip(before[0], before[2])), before
    if rank != SLEEPER:
        assert before[2][SLEEPER] - before[1][SLEEPER] >= DELAY_S * 1e9 / 2, before
    buf.close()


@pytest.mark.parametrize("ll", ["1", "0"], ids=["ll-dispatch", "flag-dispatch"])
def test_wait_stats_grow_and_show_a_late_peer(ll):
    run_distributed(_stats_body, 2, ll, backend="nccl", timeout=600)


def _masked_stats_body(rank, W):
    """A rank masked by hand is never waited for: its entry stays exactly 0, while the other
    entries still grow; unmasked, it is timed again."""
    import llcomm.ep as ep
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T, dtype=DTYPE,
                      backend="peer", enable_masks=True, timeout_ms=5000)
    other = 1 - rank
    _round(buf, rank, W, 3, stats=(_zeros(W), _zeros(W)))      # the compiles
    buf.set_mask(other, True)
    ds, cs = _zeros(W), _zeros(W)
    dist.barrier()
    delay = (DELAY_S, DELAY_S) if rank == SLEEPER else (0.0, 0.0)
    for seed in (6, 9):
        _round(buf, rank, W, seed, absent={other}, stats=(ds, cs), delay=delay)
    torch.cuda.synchronize()
    assert ds[other].item() == 0 and cs[other].item() == 0, (ds.tolist(), cs.tolist())
    assert min(ds.tolist() + cs.tolist()) >= 0
    dist.barrier()
    buf.set_mask(other, False)
    ds, cs = _zeros(W), _zeros(W)
    dist.barrier()
    _round(buf, rank, W, 12, stats=(ds, cs), delay=delay)
    torch.cuda.synchronize()
    if rank != SLEEPER:
        assert ds[SLEEPER].item() >= DELAY_S * 1e9 / 2, ds.tolist()
        assert cs[SLEEPER].item() >= DELAY_S * 1e9 / 2, cs.tolist()
    buf.close()


def test_masked_rank_entry_stays_zero():
    run_distributed(_masked_stats_body, 2, backend="nccl", timeout=600)


def _deep_ep_body(rank, W):
    """DeepEP's arguments: both statistics tensors grow, the sleeper's entry most."""
    import llcomm.deep_ep as deep_ep
    L = 4
    num_experts = L * W
    buf = deep_ep.Buffer(None, backend="peer", timeout_ms=5000)
    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    idx = torch.randint(0, num_experts, (T, 2), device="cuda")
    w = torch.rand(T, 2, device="cuda")
    ds, cs = _zeros(W), _zeros(W)
    for delayed in (False, False, True):
        dist.barrier()
        if delayed and rank == SLEEPER:
            time.sleep(DELAY_S)
        rx, _, handle, _, _ = buf.low_latency_dispatch(
            x, idx, T, num_experts, use_fp8=False, dispatch_wait_recv_cost_stats=ds)
        buf.low_latency_combine(rx, idx, w, handle, combine_wait_recv_cost_stats=cs)
        torch.cuda.synchronize()
    assert min(ds.tolist() + cs.tolist()) >= 0
    if rank != SLEEPER:
        assert ds[SLEEPER].item() >= DELAY_S * 1e9 / 2, ds.tolist()
    with pytest.raises(TypeError, match="dispatch_wait_recv_cost_stats"):
        buf.low_latency_dispatch(x, idx, T, num_experts, use_fp8=False,
                                 dispatch_wait_recv_cost_stats=ds.int())
    buf.destroy()


def test_deep_ep_wait_cost_stats():
    run_distributed(_deep_ep_body, 2, backend="nccl", timeout=600)
