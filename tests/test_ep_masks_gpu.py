"""GPU test of EP rank masks (``EPBuffer(..., enable_masks=True)``, peer backend, 2 GPUs).

Fault injection: rank 1 stays away from two rounds (dispatch + combine). Rank 0 must finish the
first within one timeout (rank 1 is masked, not an error), the second without waiting for rank 1
at all, report ``query_mask() == [0, 1]``, and return exactly the oracle's results with rank 1's
contributions absent: its tokens not received, its experts' partials zero. Then rank 1 makes up
the two rounds late (its own results of them are unspecified: rank 0 did not serve its tokens),
both ranks ``clean_mask()``, and a full round matches the full oracle again.

Run on a 2-GPU host: ``python -m pytest tests/test_ep_masks_gpu.py -m gpu -x -q``.
"""
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from llcomm.bench.timing import capture
from test_ep_oracle import expert_fn, make_case, oracle_combine, oracle_dispatch

pytestmark = pytest.mark.gpu

E, H, T, K = 8, 256, 8, 3
DTYPE = torch.float32            # combine compared within 1e-6 (fp32, same order as the oracle)
TIMEOUT_MS = 300
ABSENT = 1
#: Rounds seeds (seed % 3 == 0: every rank sends T tokens).
WARM_SEEDS, FAULT_SEEDS, BACK_SEEDS = (3, 6), (9, 12), (15, 18)


def _oracle(W, seed, absent):
    """Per rank ``(dispatch oracle, combine oracle)`` with the ranks in ``absent`` removed:
    they send nothing and their experts count as -1 in every top-k."""
    xs, topks, ws = make_case(W, E, T, H, K, seed, "random", DTYPE)
    L = E // W
    xs_l = [x[:0] if s in absent else x for s, x in enumerate(xs)]
    tk_l = [t[:0] if s in absent else t for s, t in enumerate(topks)]
    disp = oracle_dispatch(xs_l, tk_l, W, E, T)
    gone = torch.tensor(sorted(absent) or [-1])
    cut = [torch.where((t >= 0) & torch.isin(t // L, gone), -1, t) for t in tk_l]
    outs = [expert_fn(*disp[q][:2], q) for q in range(W)]
    return xs, topks, ws, disp, oracle_combine(outs, cut, ws, W, E, DTYPE)


def _round(buf, rank, W, seed, absent=(), check=True, stats=(None, None), delay=(0.0, 0.0)):
    """One dispatch + combine on this rank; with ``check``, compared with the oracle. Returns
    the seconds the two calls and ``check()`` took. ``stats``: the ``wait_stats`` tensors of
    the dispatch and the combine; ``delay``: host seconds slept before each call."""
    xs, topks, ws, disp, comb = _oracle(W, seed, set(absent))
    x, idx, w = xs[rank].cuda(), topks[rank].cuda(), ws[rank].cuda()
    L = E // W
    t0 = time.monotonic()
    time.sleep(delay[0])
    rx, rc, h = buf.dispatch(x, idx, out=torch.full((L, W * T, H), float("nan"), device="cuda"),
                             wait_stats=stats[0])
    eo = expert_fn(rx.cpu(), rc.cpu(), rank).cuda()     # syncs: the dispatch is done here
    time.sleep(delay[1])
    y = buf.combine(eo, idx, w, h, out=torch.full((x.shape[0], H), float("nan"), device="cuda"),
                    wait_stats=stats[1])
    buf.check()
    elapsed = time.monotonic() - t0
    if not check:
        return elapsed
    what = f"rank {rank} seed {seed} absent {sorted(absent)}"
    wx, wc, wsrc = disp[rank]
    assert torch.equal(rc.cpu(), wc), f"{what}: recv_count {rc.tolist()} != {wc.tolist()}"
    for e, c in enumerate(wc.tolist()):
        assert torch.equal(rx[e, :c].cpu(), wx[e, :c]), f"{what}: recv_x of expert {e}"
        assert torch.equal(h.src_info[e, :c].cpu(), wsrc[e, :c]), f"{what}: src_info {e}"
    torch.testing.assert_close(y.cpu(), comb[rank], rtol=1e-6, atol=1e-6, msg=what)
    return elapsed


def _masks_body(rank, W):
    import llcomm.ep as ep
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T, dtype=DTYPE,
                      backend="peer", enable_masks=True, timeout_ms=TIMEOUT_MS)
    assert buf.backend == "peer"
    for seed in WARM_SEEDS:                 # no fault: the full result (and the compile)
        _round(buf, rank, W, seed)
    assert buf.query_mask().tolist() == [0] * W
    dist.barrier()
    times = []
    if rank != ABSENT:
        for seed in FAULT_SEEDS:
            times.append(_round(buf, rank, W, seed, absent={ABSENT}))
        mask = buf.query_mask()
        assert mask.dtype == torch.int32 and mask.tolist() == [int(r == ABSENT) for r in range(W)]
        # one timeout for the first round, none for the second (the masked rank is skipped)
        assert times[0] < 1.8 * TIMEOUT_MS / 1000, times
        assert times[1] < 0.5 * TIMEOUT_MS / 1000, times
    dist.barrier()
    if rank == ABSENT:                      # back: make up the missed calls, results ignored
        for seed in FAULT_SEEDS:
            _round(buf, rank, W, seed, check=False)
        torch.cuda.synchronize()
        assert buf.query_mask().tolist() == [0] * W, "the late rank masked somebody"
    dist.barrier()
    buf.clean_mask()
    assert buf.query_mask().tolist() == [0] * W
    for seed in BACK_SEEDS:                 # in step again: full results
        _round(buf, rank, W, seed)
    assert buf.query_mask().tolist() == [0] * W
    return times


def test_masked_rank_is_absent_then_restored():
    times = run_distributed(_masks_body, 2, backend="nccl")
    print(f"rank 0: the two rounds without rank {ABSENT} took {times[0]} s")


def _no_masks_body(rank, W):
    import llcomm.ep as ep
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T, dtype=DTYPE,
                      backend="peer", timeout_ms=TIMEOUT_MS)
    with pytest.raises(ValueError, match="enable_masks=True"):
        buf.query_mask()
    _round(buf, rank, W, WARM_SEEDS[0])
    return None


def test_query_mask_needs_enable_masks():
    run_distributed(_no_masks_body, 2, backend="nccl")


#: Rounds of the masks-by-hand test (seed % 3 == 0: every rank sends T tokens).
HAND_SEEDS, HAND_ALONE_SEEDS, HAND_BACK_SEEDS = (21, 24), (27,), (30, 33)


def _by_hand_body(rank, W):
    """``set_mask`` by hand: each rank masks the other, so each serves only itself and its
    results equal the oracle without the other (both call, nothing is waited for); masking
    is captured in a CUDA graph too; then rank 1 stays away from a round that rank 0 makes
    alone with a long timeout (rank 0 does not wait: it finishes before rank 1 starts, which
    the barrier between them orders, and its wait statistics for rank 1 stay 0), rank 1 makes
    it up late, both unmask, and full rounds match the full oracle."""
    import llcomm.ep as ep
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T, dtype=DTYPE,
                      backend="peer", enable_masks=True, timeout_ms=20_000)
    other = 1 - rank
    _round(buf, rank, W, WARM_SEEDS[0])                 # the compile, full results
    with pytest.raises(ValueError, match="rank=2"):
        buf.set_mask(W, True)
    with pytest.raises(TypeError, match="masked=1"):
        buf.set_mask(other, 1)
    assert buf.query_mask().tolist() == [0] * W, "a refused set_mask changed the mask"
    buf.set_mask(other, True)                           # stream-ordered, no sync
    assert buf.query_mask().tolist() == [int(r == other) for r in range(W)]
    dist.barrier()
    for seed in HAND_SEEDS:
        _round(buf, rank, W, seed, absent={other})
    # in a graph: unmask and mask again, replayed (the mask word must end masked)
    def unmask_mask():
        buf.set_mask(other, False)
        buf.set_mask(other, True)

    g = capture(unmask_mask, 1, warm=False)
    buf.set_mask(other, False)
    g.replay()
    assert buf.query_mask().tolist() == [int(r == other) for r in range(W)]
    dist.barrier()
    if rank == 0:           # alone: rank 1 starts only after this rank has finished
        ds, cs = (torch.zeros(W, dtype=torch.int64, device="cuda") for _ in range(2))
        for seed in HAND_ALONE_SEEDS:
            _round(buf, rank, W, seed, absent={1}, stats=(ds, cs))
        torch.cuda.synchronize()    # never waited for rank 1: its wait statistics stay 0
        assert ds[1].item() == 0 and cs[1].item() == 0, (ds.tolist(), cs.tolist())
    dist.barrier()
    if rank == 1:           # late, its results unspecified (rank 0 masked it)
        for seed in HAND_ALONE_SEEDS:
            _round(buf, rank, W, seed, check=False)
    torch.cuda.synchronize()
    dist.barrier()
    buf.set_mask(other, False)
    assert buf.query_mask().tolist() == [0] * W
    for seed in HAND_BACK_SEEDS:
        _round(buf, rank, W, seed)
    assert buf.query_mask().tolist() == [0] * W
    buf.close()


def test_rank_masked_by_hand_is_skipped_then_restored():
    run_distributed(_by_hand_body, 2, backend="nccl")
