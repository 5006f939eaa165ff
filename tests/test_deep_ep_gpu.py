"""GPU tests of ``llcomm.deep_ep`` on the peer backend (2 GPUs, NCCL group).

- The CPU suite's DeepEP-style rounds (tests/test_deep_ep.py), here on the peer kernels: every
  variant (bf16, FP8, power-of-two scales, UE8M0) with and without receive hooks, rows checked
  through ``src_info`` and ``layout_range``, combine against the fp64 sum, stats, zero_copy,
  two outstanding handles.
- The dispatch writing DeepEP's layouts inside a captured CUDA graph, replayed with fresh
  inputs.
- ``async_finish``: a consumer on another stream that waits for the event sees the result (the
  producing stream is held back by a sleep kernel, so a missing wait reads the NaN poison).
- Shrink mode (``enable_shrink=True``): a rank stops calling, the survivor goes on with it
  masked (results equal the oracle without it), ``low_latency_query_mask_buffer`` reports it;
  the rank catches up, everyone cleans, full results; then it stops for good, and after
  ``low_latency_clean_mask_buffer`` the survivor is masked again after one timeout and keeps
  returning the results without it.
- A peer that compiles slowly: rank 1 takes longer than the default wait bound to compile the
  FP8 round's kernels; every wait that overlaps that compile is a first launch with the long
  bound, so rank 0 waits it out (and without that bound it times out).
- Masks by hand (``low_latency_update_mask_buffer``): set before the first call (kept until the
  EPBuffer exists), each rank masks the other and gets the results without it; unmasked, full
  results again.
- tests/test_deep_ep_surface.py's local buffer (zeroed between rounds) and int32 ``topk_idx``
  (bitwise the results of int64), here on the peer kernels.

Run on a 2-GPU host: ``python -m pytest tests/test_deep_ep_gpu.py -m gpu -x -q``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _deep_ep_case import (VARIANTS, Quant, case, check_combine, check_dispatch, combine_oracle,
                           expert_outputs)
from _dist import run_distributed
import llcomm
from llcomm.bench.timing import capture
from llcomm.runtime.protocol import DEFAULT_TIMEOUT_MS
from test_deep_ep import H, K, L, T, _round, _rounds_body

pytestmark = pytest.mark.gpu

TIMEOUT_MS = 300
ABSENT = 1


def _peer_rounds_body(rank, W):
    return _rounds_body(rank, W, list(range(300, 310)), device="cuda", backend="peer")


def test_rounds_on_the_peer_backend():
    fails = [f for r in run_distributed(_peer_rounds_body, 2, backend="nccl", timeout=600)
             for f in r]
    assert not fails, "\n".join(fails[:20])


def _peer_surface_body(rank, W, which):
    from test_deep_ep_surface import _local_body, _topk_int32_body
    body = {"local": _local_body, "topk_int32": _topk_int32_body}[which]
    return body(rank, W, device="cuda", backend="peer")


@pytest.mark.parametrize("which", ["local", "topk_int32"])
def test_local_buffer_and_int32_topk_on_the_peer_backend(which):
    fails = [f for r in run_distributed(_peer_surface_body, 2, which, backend="nccl",
                                        timeout=600) for f in r]
    assert not fails, "\n".join(fails[:20])


# -- CUDA graph ---------------------------------------------------------------------------------
def _graph_body(rank, W):
    """dispatch (FP8, UE8M0 or not, with the hook or not), graph-safe experts, combine, all
    captured; replayed with fresh inputs copied into the static ones, each replay checked."""
    import llcomm.deep_ep as deep_ep
    E = L * W
    buf = deep_ep.Buffer(None, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, H, W, E), backend="peer")
    buf.clean_low_latency_buffer(T, H, E)            # the EPBuffer, before any capture
    assert buf.ep_buffer.backend == "peer"
    fails, quant = [], Quant()
    factor = (1 + (rank * L + torch.arange(L, device="cuda", dtype=torch.float32)) / 8).view(
        L, 1, 1)
    shift = ((rank * L + torch.arange(L, device="cuda", dtype=torch.float32)) / 4).view(L, 1, 1)
    for variant, hook_on in ((VARIANTS[1], False), (VARIANTS[3], True), (VARIANTS[0], True)):
        fp8, round_scale, ue8m0 = variant
        x = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
        idx = torch.full((T, K), -1, dtype=torch.int64, device="cuda")
        w = torch.zeros(T, K, dtype=torch.float32, device="cuda")
        stats = torch.zeros(L, dtype=torch.int32, device="cuda")
        st = {}

        def step():
            recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
                x, idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8,
                round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=hook_on)
            if hook_on:
                hook()
            if fp8:                  # dequantise every row, filled or not: no count is read
                q, sc = recv_x
                if ue8m0:
                    shifts = torch.arange(4, device="cuda", dtype=torch.int32) * 8
                    byte = (sc.unsqueeze(-1) >> shifts) & 0xFF
                    sc = torch.pow(2.0, (byte - 127).float()).flatten(-2)
                rows = (q.float().view(L, W * T, H // 128, 128) * sc.unsqueeze(-1)).view(
                    L, W * T, H)
            else:
                rows = recv_x.float()
            out = (rows * factor + shift).to(torch.bfloat16)
            y, _, hook = buf.low_latency_combine(out, idx, w, handle,
                                                 return_recv_hook=hook_on)
            if hook_on:
                hook()
            st.update(recv_x=recv_x, recv_count=recv_count, handle=handle, y=y)

        g = capture(step, 1)
        for seed in (3, 6, 9):                       # seed % 3 == 0: T tokens on every rank
            inputs = case(W, E, T, H, K, seed)
            x.copy_(inputs[rank][0])
            idx.copy_(inputs[rank][1])
            w.copy_(inputs[rank][2])
            stats.zero_()
            g.replay()
            torch.cuda.synchronize()
            tag = f"[graph {variant} hook={hook_on} seed={seed}]"
            more, _ = check_dispatch(tag, rank, inputs, st["recv_x"], st["recv_count"],
                                     st["handle"], variant, quant, seed, W, E, T, H)
            fails += more
            if not torch.equal(stats, st["recv_count"]):
                fails.append(f"{tag} stats {stats.tolist()} != {st['recv_count'].tolist()}")
            fails += check_combine(tag, st["y"], *combine_oracle(inputs, rank, variant, quant,
                                                                 seed, E, torch.bfloat16))
    buf.ep_buffer.check()
    buf.destroy()
    return fails


def test_graph_capture_and_replay():
    fails = [f for r in run_distributed(_graph_body, 2, backend="nccl", timeout=600) for f in r]
    assert not fails, "\n".join(fails[:20])


# -- async_finish -------------------------------------------------------------------------------
def _async_body(rank, W):
    import llcomm.deep_ep as deep_ep
    E = L * W
    buf = deep_ep.Buffer(None, backend="peer")
    inputs = case(W, E, T, H, K, 12)
    x, idx, w = (t.cuda() for t in inputs[rank])
    recv_x, recv_count, handle, event, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False,
                                                                    async_finish=True)
    if not (isinstance(event.event, deep_ep.EventHandle)
            and isinstance(event.event.event, torch.cuda.Event)):
        return [f"async_finish=True gave event {event.event!r}"]
    event.current_stream_wait()
    more, rows_in = check_dispatch("[async]", rank, inputs, recv_x, recv_count, handle,
                                   VARIANTS[0], Quant(), 12, W, E, T, H)
    if more:
        return more
    eo = expert_outputs(rows_in, rank, L, W, T, H, torch.bfloat16, "cuda")
    out = torch.full((x.shape[0], H), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(200_000_000)                    # holds this stream back (~0.1 s)
    y, event, _ = buf.low_latency_combine(eo, idx, w, handle, async_finish=True, out=out)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        event.current_stream_wait()                   # without it the copy reads the poison
        seen = y.clone()
    torch.cuda.synchronize()
    fails = check_combine("[async consumer on another stream]", seen,
                          *combine_oracle(inputs, rank, VARIANTS[0], Quant(), 12, E,
                                          torch.bfloat16))
    buf.destroy()
    return fails


def test_async_finish_event_orders_another_stream():
    fails = [f for r in run_distributed(_async_body, 2, backend="nccl") for f in r]
    assert not fails, "\n".join(fails)


# -- shrink mode --------------------------------------------------------------------------------
def _masked_round(buf, rank, W, seed, absent=(), check=True):
    """One bf16 dispatch + combine; with ``check``, against the oracle with the ranks in
    ``absent`` removed (they send nothing; their experts' partials count as zero)."""
    E = L * W
    inputs = case(W, E, T, H, K, seed)
    x, idx, w = (t.cuda() for t in inputs[rank])
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    if not check:
        torch.cuda.synchronize()
        y, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
        torch.cuda.synchronize()
        return []
    seen = [(xs[:0], ix[:0], ws[:0]) if s in absent else (xs, ix, ws)
            for s, (xs, ix, ws) in enumerate(inputs)]
    tag = f"[shrink rank {rank} seed {seed} absent {sorted(absent)}]"
    fails, rows_in = check_dispatch(tag, rank, seen, recv_x, recv_count, handle, VARIANTS[0],
                                    Quant(), seed, W, E, T, H)
    if fails:
        return fails
    eo = expert_outputs(rows_in, rank, L, W, T, H, torch.bfloat16, "cuda")
    y, _, _ = buf.low_latency_combine(eo, idx, w, handle)
    gone = torch.tensor(sorted(absent) or [-1])
    cut = torch.where((inputs[rank][1] >= 0) & torch.isin(inputs[rank][1] // L, gone), -1,
                      inputs[rank][1])
    seen[rank] = (inputs[rank][0], cut, inputs[rank][2])
    return fails + check_combine(tag, y, *combine_oracle(seen, rank, VARIANTS[0], Quant(), seed,
                                                         E, torch.bfloat16))


def _mask_of(buf, W):
    m = torch.full((W,), 7, dtype=torch.int32, device="cuda")
    buf.low_latency_query_mask_buffer(m)
    return m.tolist()


def _shrink_body(rank, W):
    import llcomm.deep_ep as deep_ep
    buf = deep_ep.Buffer(None, enable_shrink=True, backend="peer", timeout_ms=TIMEOUT_MS)
    fails = []
    none, only = [0] * W, [int(r == ABSENT) for r in range(W)]
    if _mask_of(buf, W) != none:                         # before the EPBuffer exists
        fails.append("mask before the first call is not all zeros")
    for seed in (3, 4):                                  # everyone: full results
        fails += _masked_round(buf, rank, W, seed)
    if _mask_of(buf, W) != none:
        fails.append(f"rank {rank}: masked ranks {_mask_of(buf, W)} without a fault")
    dist.barrier()
    if rank != ABSENT:                                   # the absent rank stops calling
        for seed in (5, 6):
            fails += _masked_round(buf, rank, W, seed, absent={ABSENT})
        if _mask_of(buf, W) != only:
            fails.append(f"rank {rank}: mask {_mask_of(buf, W)} != {only}")
    dist.barrier()
    if rank == ABSENT:                                   # back: the missed calls, late
        for seed in (5, 6):
            _masked_round(buf, rank, W, seed, check=False)
        if _mask_of(buf, W) != none:
            fails.append("the late rank masked somebody")
    dist.barrier()
    buf.low_latency_clean_mask_buffer()
    if _mask_of(buf, W) != none:
        fails.append(f"rank {rank}: mask after clean {_mask_of(buf, W)}")
    for seed in (7, 8):                                  # in step again: full results
        fails += _masked_round(buf, rank, W, seed)
    dist.barrier()
    if rank != ABSENT:                                   # gone for good this time
        fails += _masked_round(buf, rank, W, 9, absent={ABSENT})
        if _mask_of(buf, W) != only:
            fails.append(f"rank {rank}: mask {_mask_of(buf, W)} != {only} (gone for good)")
        buf.low_latency_clean_mask_buffer()              # masked again by the next call
        fails += _masked_round(buf, rank, W, 10, absent={ABSENT})
        if _mask_of(buf, W) != only:
            fails.append(f"rank {rank}: mask {_mask_of(buf, W)} != {only} after clean")
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()
    return fails


def test_shrink_masks_a_silent_rank():
    fails = [f for r in run_distributed(_shrink_body, 2, backend="nccl", timeout=600) for f in r]
    assert not fails, "\n".join(fails)


def _update_mask_body(rank, W):
    """``low_latency_update_mask_buffer`` before the first call (the EPBuffer does not exist
    yet: the mask is kept and applied when it is made) and after: each rank masks the other,
    so each gets exactly the results without it while both call; unmasked after a barrier,
    full results."""
    import llcomm.deep_ep as deep_ep
    buf = deep_ep.Buffer(None, enable_shrink=True, backend="peer", timeout_ms=20_000)
    other = 1 - rank
    fails = []
    buf.low_latency_update_mask_buffer(other, True)
    if _mask_of(buf, W) != [int(r == other) for r in range(W)]:
        fails.append(f"rank {rank}: mask {_mask_of(buf, W)} before the EPBuffer exists")
    for seed in (11, 12):                   # the first creates the EPBuffer, other masked
        fails += _masked_round(buf, rank, W, seed, absent={other})
    if _mask_of(buf, W) != [int(r == other) for r in range(W)]:
        fails.append(f"rank {rank}: mask {_mask_of(buf, W)} after the masked rounds")
    torch.cuda.synchronize()
    dist.barrier()
    buf.low_latency_update_mask_buffer(other)               # mask=False: DeepEP's default
    if _mask_of(buf, W) != [0] * W:
        fails.append(f"rank {rank}: mask {_mask_of(buf, W)} after unmasking {other}")
    for seed in (13, 14):
        fails += _masked_round(buf, rank, W, seed)
    buf.destroy()
    return fails


def test_update_mask_buffer_masks_and_unmasks_by_hand():
    fails = [f for r in run_distributed(_update_mask_body, 2, backend="nccl", timeout=600)
             for f in r]
    assert not fails, "\n".join(fails)


# -- a peer that compiles slowly ------------------------------------------------------------------
#: How long rank 1 takes for each compile of the FP8 round: longer than the default wait bound,
#: far below the bound of a kernel's first launch.
SLOW_COMPILE_S = DEFAULT_TIMEOUT_MS / 1000 + 5


def _slow_compile_body(rank, W, rule):
    """A bf16 round compiles the dispatch and the combine; then every compile of rank 1 takes
    SLOW_COMPILE_S more, and a round with the FP8 dispatch, new to both ranks, runs: dispatch,
    check, combine (plain, then zero-copy), check, under the default bound. Every compile of
    that round is a waiting kernel's first launch, which waits up to FIRST_LAUNCH_TIMEOUT_US
    on every rank, so the round is right (``rule``). Without that bound (``rule`` False) rank
    0's FP8 dispatch gives up on rank 1 after the default bound: the test sees the failure the
    rule prevents. (A kernel that waited for nobody compiled after the dispatch, as the layout
    conversion once was, failed this test with the rule on: rank 0's combine, compiled in the
    bf16 round, timed out.)"""
    import time

    import llcomm.deep_ep as deep_ep
    from llcomm.runtime import launch
    if not rule:
        launch.FIRST_LAUNCH_TIMEOUT_US = 0
    slow = [False]
    go = launch.Launcher._go

    def slow_go(self, key, *args):
        if slow[0] and rank == 1 and key not in self._cache:       # about to compile
            time.sleep(SLOW_COMPILE_S)
        return go(self, key, *args)
    launch.Launcher._go = slow_go
    buf = deep_ep.Buffer(None, backend="peer", timeout_ms=DEFAULT_TIMEOUT_MS)   # whatever
    #                                                                the environment says
    stats = torch.zeros(L, dtype=torch.int32, device="cuda")
    fails, _ = _round(buf, rank, W, 500, VARIANTS[0], False, stats, Quant(), "cuda")
    slow[0] = True
    try:
        more, _ = _round(buf, rank, W, 501, VARIANTS[1], False, stats, Quant(), "cuda")
        buf.ep_buffer.check()
    except llcomm.LLCommError as e:
        more = [f"rank {rank}: {type(e).__name__}: {e}"]
    fails += more
    torch.cuda.synchronize()
    dist.barrier()
    return fails


@pytest.mark.parametrize("rule", [True, False], ids=["rule", "no_rule"])
def test_slow_compile_on_one_rank(rule):
    fails = run_distributed(_slow_compile_body, 2, rule, backend="nccl", timeout=600)
    if rule:
        assert not fails[0] and not fails[1], "\n".join(fails[0] + fails[1])
    else:       # what the rule prevents (so the test above is not passing by luck)
        assert fails[0], "rank 0 waited out rank 1's slow compile without the first-launch bound"
