"""``llcomm.deep_ep`` (DeepEP's low-latency API on ``EPBuffer``) on the reference backend: gloo,
CPU, 2 and 3 ranks.

The rounds follow the structure of DeepEP's own low-latency test, in our own code: self-checking
payloads, some top-k entries masked to -1, per-expert counts against the routing, every received
row against its source through ``src_info`` and ``layout_range``, FP8 codes and scales (float
and UE8M0) against an independent quantiser, the combine against an fp64 weighted sum of the
expert outputs, with and without receive hooks, ``async_finish`` events, cumulative receive
statistics, several rounds in one buffer, two handles outstanding and ``zero_copy``. Then every
refusal: the unsupported arguments (NotImplementedError naming them), bad arguments
(ValueError / TypeError naming them) and rank masks on the reference backend.
"""
from __future__ import annotations

import pytest
import torch

from _deep_ep_case import (VARIANTS, Quant, case, check_combine, check_dispatch,
                           combine_oracle, expert_outputs)
from _dist import run_distributed
from test_ep_reference import _expect  # a call must raise exc naming words

H, T, K, L = 512, 12, 4, 3


def _round(buf, rank, W, seed, variant, hook_on, stats, quant, device="cpu", dtype=None):
    """One DeepEP-style round on ``buf``: dispatch, check, experts, combine (plain and
    zero-copy), check. Returns (failures, recv_count)."""
    import llcomm.deep_ep as deep_ep
    dtype = dtype or torch.bfloat16
    E = L * W
    inputs = case(W, E, T, H, K, seed, dtype)
    x, idx, w = (t.to(device) for t in inputs[rank])
    tag = f"[W={W} rank={rank} seed={seed} fp8/round/ue8m0={variant} hook={hook_on}]"
    fp8, round_scale, ue8m0 = variant
    before = stats.clone()
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8,
        round_scale=round_scale, use_ue8m0=ue8m0, async_finish=not hook_on,
        return_recv_hook=hook_on)
    fails = []
    if not isinstance(event, deep_ep.EventOverlap):
        fails.append(f"{tag} event is {type(event).__name__}")
    if hook_on:
        if device == "cpu" and not torch.equal(stats, before):
            fails.append(f"{tag} the statistics moved before the receive hook ran")
        if not callable(hook) or event.extra_tensors is not None:
            fails.append(f"{tag} hook {hook!r}, event tensors {event.extra_tensors is not None}")
        hook()
    else:
        if hook is not None or event.extra_tensors is None:
            fails.append(f"{tag} without return_recv_hook the hook must be None and "
                         "async_finish=True must keep the call's tensors in the event")
        event.current_stream_wait()
    if not torch.equal(stats.cpu(), before.cpu() + recv_count.cpu()):
        fails.append(f"{tag} cumulative stats {stats.tolist()} != {before.tolist()} + "
                     f"{recv_count.tolist()}")
    more, rows_in = check_dispatch(tag, rank, inputs, recv_x, recv_count, handle, variant, quant,
                                   seed, W, E, T, H)
    fails += more
    if more:
        return fails, recv_count
    expert_out = expert_outputs(rows_in, rank, L, W, T, H, dtype, device)
    want, bound = combine_oracle(inputs, rank, variant, quant, seed, E, dtype)
    results = []
    for zero_copy in (False, True):
        given = expert_out
        if zero_copy:
            buf.get_next_low_latency_combine_buffer(handle)[:] = expert_out
            given = torch.full_like(expert_out, float("nan"))       # must not be read
        out = torch.full((x.shape[0], H), float("nan"), dtype=dtype, device=device)
        y, event, hook = buf.low_latency_combine(given, idx, w, handle, zero_copy=zero_copy,
                                                 async_finish=not hook_on,
                                                 return_recv_hook=hook_on, out=out)
        if hook_on:
            hook()
        else:
            with event:                     # DeepEP's context-manager form
                pass
        if y.data_ptr() != out.data_ptr():
            fails.append(f"{tag} combine did not fill out=")
        fails += check_combine(f"{tag} zero_copy={zero_copy}", y, want, bound)
        results.append(y.cpu())
    if not torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8)):
        fails.append(f"{tag} zero_copy=True differs from zero_copy=False")
    return fails, recv_count


def _rounds_body(rank, W, seeds, device="cpu", backend="auto"):
    """Every variant with and without hooks, several rounds in one Buffer, stats accumulated
    over all of them on top of a random start; then two handles outstanding."""
    import llcomm.deep_ep as deep_ep
    E = L * W
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, W, E)
    buf = deep_ep.Buffer(None, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=L,
                         backend=backend)
    assert buf.ep_buffer is None                         # created by the first dispatch
    quant = Quant()
    stats = torch.randint(0, 1000, (L,), dtype=torch.int32).to(device)
    start, total = stats.clone(), torch.zeros(L, dtype=torch.int32)
    fails, seed_iter = [], iter(seeds)
    for variant in VARIANTS:
        for hook_on in (False, True):
            more, rc = _round(buf, rank, W, next(seed_iter), variant, hook_on, stats, quant,
                              device)
            fails += more
            total += rc.cpu()
    if not torch.equal(stats.cpu(), start.cpu() + total):
        fails.append(f"rank {rank}: stats over all rounds {stats.tolist()} != start + "
                     f"{total.tolist()}")
    fails += _two_outstanding(buf, rank, W, next(seed_iter), device)
    buf.destroy()
    return fails


def _two_outstanding(buf, rank, W, seed, device):
    """dispatch A, dispatch B, combine B, combine A (a handle lives for two dispatches)."""
    E = L * W
    quant, fails, pending = Quant(), [], []
    for s in (seed, seed + 1):
        inputs = case(W, E, T, H, K, s)
        x, idx, w = (t.to(device) for t in inputs[rank])
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        more, rows_in = check_dispatch(f"[two outstanding seed {s}]", rank, inputs, recv_x,
                                       recv_count, handle, VARIANTS[0], quant, s, W, E, T, H)
        fails += more
        pending.append((s, inputs, idx, w, handle, rows_in))
    for s, inputs, idx, w, handle, rows_in in reversed(pending):
        if not rows_in:
            continue
        eo = expert_outputs(rows_in, rank, L, W, T, H, torch.bfloat16, device)
        y, _, _ = buf.low_latency_combine(eo, idx, w, handle)
        fails += check_combine(f"[two outstanding seed {s}]", y,
                               *combine_oracle(inputs, rank, VARIANTS[0], quant, s, E,
                                               torch.bfloat16))
    return fails


@pytest.mark.parametrize("W,seeds", [(2, range(100, 110)), (3, range(200, 210))],
                         ids=["w2", "w3"])
def test_rounds_match_the_oracle(W, seeds):
    fails = [f for r in run_distributed(_rounds_body, W, list(seeds)) for f in r]
    assert not fails, "\n".join(fails[:20])


# -- the conversions, by hand -------------------------------------------------------------------
def test_layout_range_and_source_token_by_hand():
    from llcomm.deep_ep import convert
    T, W = 4, 3
    # expert 0: 2 rows from rank 0, none from 1, 1 from 2; expert 1: one from rank 1; expert 2:
    # nothing. Past recv_count: poison that must not be counted (out of range, other ranks).
    src = torch.tensor([[0 * T + 1, 0 * T + 3, 2 * T + 0, 1 * T + 2, 99, -7],
                        [1 * T + 3, 2 * T + 2, 0, 5, 2 * T, 1 << 30],
                        [1 * T, 2 * T, -1, 0, 7, 11]], dtype=torch.int32)
    count = torch.tensor([3, 1, 0], dtype=torch.int32)
    layout = torch.empty(3, W, dtype=torch.int64)
    convert.layout_range(src, count, convert.layout_aux(3, 2 * W, T, W, torch.device("cpu")),
                         layout)
    pairs = [[(int(v) >> 32, int(v) & 0xFFFFFFFF) for v in row] for row in layout]
    assert pairs == [[(0, 2), (2, 0), (2, 1)], [(0, 0), (0, 1), (1, 0)], [(0, 0)] * 3]
    tok = torch.empty_like(src)
    convert.source_token(src, T, tok)
    assert tok[0, :3].tolist() == [1, 3, 0] and tok[1, :1].tolist() == [3]


def test_ue8m0_packing_by_hand():
    from llcomm.deep_ep import convert
    exps = [[-3, 0, 5, -126], [1, 2, -1, 127]]           # powers of two, biased: e + 127
    scales = torch.tensor([[2.0 ** e for e in row] for row in exps], dtype=torch.float32)
    words = convert.pack_ue8m0(scales.view(1, 2, 4)).view(2).tolist()
    for row, word in zip(exps, words):
        want = sum((e + 127) << (8 * b) for b, e in enumerate(row))
        assert word & 0xFFFFFFFF == want, (hex(word), hex(want))
    assert words[1] < 0                   # byte 3 = 254: bit 31 set, a negative int32
    # the bytes in memory (a little-endian host): scale 4 i + b at byte b of word i
    storage = convert.scales_storage(1, 2, 512, True, torch.device("cpu"))
    convert.fill_scales(storage, scales.view(1, 2, 4), True)
    raw = storage.transpose(1, 2).contiguous().view(torch.uint8).view(2, 4).tolist()
    assert raw == [[e + 127 for e in row] for row in exps]


# -- refusals -----------------------------------------------------------------------------------
def _refusals_body(rank, W):
    import llcomm
    import llcomm.deep_ep as deep_ep
    from llcomm.errors import CommClosedError, UnsupportedConfigError
    E = L * W
    errors = []

    def expect(what, exc, words, fn):
        _expect(errors, what, exc, words, fn)

    B = deep_ep.Buffer
    # the constructor: DeepEP's arguments llcomm cannot honour, and bad values
    expect("no NVLink", NotImplementedError, ["allow_nvlink_for_low_latency_mode=False"],
           lambda: B(None, allow_nvlink_for_low_latency_mode=False))
    expect("fabric", NotImplementedError, ["use_fabric=True"], lambda: B(None, use_fabric=True))
    expect("not a communicator", TypeError, ["comm=", "Get_rank", "group="],
           lambda: B(None, comm=object()))
    expect("shrink on gloo", UnsupportedConfigError, ["enable_shrink=True", "reference backend"],
           lambda: B(None, enable_shrink=True))
    expect("negative budget", ValueError, ["num_rdma_bytes=-1"], lambda: B(None, 0, -1))
    expect("qps type", TypeError, ["num_qps_per_rank"], lambda: B(None, num_qps_per_rank="8"))
    expect("Config", ValueError, ["num_max_nvl_chunked_send_tokens=6", "less than"],
           lambda: deep_ep.Config(20, 6, 6))
    expect("set_num_sms odd", ValueError, ["new_num_sms=3"], lambda: B.set_num_sms(3))
    expect("set_num_sms type", TypeError, ["new_num_sms='24'"], lambda: B.set_num_sms("24"))
    if deep_ep.topk_idx_t is not torch.int64:
        errors.append(f"topk_idx_t is {deep_ep.topk_idx_t}")
    if B.get_low_latency_rdma_size_hint(T, H, W, E) != llcomm.EPBuffer.size_hint(
            T, H, W, E, sends_in_flight=2):
        errors.append("get_low_latency_rdma_size_hint is not EPBuffer.size_hint in bf16 with "
                      "two sends in flight")
    if not B.get_low_latency_rdma_size_hint(128, 7168, 2, 256) < 40 << 20:
        errors.append("the size hint for DeepSeek-V3 on 2 ranks is not llcomm's own (< 40 MiB)")

    inputs = case(W, E, T, H, K, 6)                  # seed % 3 == 0: T tokens on every rank
    x, idx, w = inputs[rank]
    # a budget smaller than llcomm's need: refused before the EPBuffer's collective
    small = B(None, num_rdma_bytes=B.get_low_latency_rdma_size_hint(T, H, W, E) - 1)
    expect("budget too small", ValueError, ["num_rdma_bytes", "get_low_latency_rdma_size_hint"],
           lambda: small.low_latency_dispatch(x, idx, T, E, use_fp8=False))

    # masks set by hand before the first call (which creates the EPBuffer) are kept and
    # reported; gloo refuses enable_shrink, so the flag is set on a plain Buffer to reach the
    # path a shrink Buffer takes before its first call
    early = B(None)
    early.enable_shrink = True
    status = torch.full((W,), -1, dtype=torch.int32)
    for r, m, want in ((W - 1, True, [0] * (W - 1) + [1]), (0, True, [1] + [0] * (W - 2) + [1]),
                       (W - 1, False, [1] + [0] * (W - 1))):
        early.low_latency_update_mask_buffer(r, m)
        early.low_latency_query_mask_buffer(status)
        if status.tolist() != want:
            errors.append(f"before the EPBuffer: mask {status.tolist()} after update({r}, {m}), "
                          f"expected {want}")
    early.low_latency_clean_mask_buffer()
    early.low_latency_query_mask_buffer(status)
    if status.tolist() != [0] * W:
        errors.append(f"before the EPBuffer: mask {status.tolist()} after clean")

    buf = B(None)
    d = buf.low_latency_dispatch
    # wait-cost statistics: checked (named), then refused on the reference backend, before the
    # EPBuffer is made
    expect("wait stats", NotImplementedError, ["dispatch_wait_recv_cost_stats",
                                               "reference backend"],
           lambda: d(x, idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(W, dtype=torch.int64)))
    expect("wait stats dtype", TypeError, ["dispatch_wait_recv_cost_stats", "torch.int64"],
           lambda: d(x, idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(W)))
    expect("wait stats shape", ValueError, ["dispatch_wait_recv_cost_stats", f"[{W}]"],
           lambda: d(x, idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(
               W, W, dtype=torch.int64)))
    expect("ue8m0 without round_scale", ValueError, ["use_ue8m0=True", "round_scale=True"],
           lambda: d(x, idx, T, E, use_ue8m0=True))
    expect("ue8m0 hidden", ValueError, ["use_ue8m0=True", "512", "hidden=384"],
           lambda: d(x[:, :384], idx, T, E, round_scale=True, use_ue8m0=True))
    expect("1-D x", ValueError, ["x must be a 2-D"], lambda: d(x[0], idx, T, E))
    expect("use_fp8 type", TypeError, ["use_fp8=1"], lambda: d(x, idx, T, E, use_fp8=1))
    if buf.ep_buffer is not None:
        errors.append("a refused dispatch created the EPBuffer")
    buf.clean_low_latency_buffer(T, H, E)            # creates it (bf16), a collective
    if buf.ep_buffer is None or buf.ep_buffer.dtype != torch.bfloat16:
        errors.append("clean_low_latency_buffer did not create the bf16 EPBuffer")
    expect("clean other shapes", ValueError, ["num_max_dispatch_tokens_per_rank=13", "for 12"],
           lambda: buf.clean_low_latency_buffer(T + 1, H, E))
    expect("other T", ValueError, ["num_max_dispatch_tokens_per_rank=13"],
           lambda: d(x, idx, T + 1, E))
    expect("other E", ValueError, ["num_experts=" + str(E + W)], lambda: d(x, idx, T, E + W))
    expect("other hidden", ValueError, ["hidden=384"], lambda: d(x[:, :384], idx, T, E))
    expect("stats dtype", TypeError, ["cumulative_local_expert_recv_stats", "int32"],
           lambda: d(x, idx, T, E, cumulative_local_expert_recv_stats=torch.zeros(L)))
    expect("stats shape", ValueError, ["cumulative_local_expert_recv_stats", f"[{L}]"],
           lambda: d(x, idx, T, E, cumulative_local_expert_recv_stats=torch.zeros(
               L + 1, dtype=torch.int32)))
    expect("x dtype", TypeError, ["x has dtype float32"], lambda: d(x.float(), idx, T, E))

    recv_x, recv_count, handle, _, _ = d(x, idx, T, E, use_fp8=False)
    c = buf.low_latency_combine
    expect("logfmt", NotImplementedError, ["use_logfmt=True"],
           lambda: c(recv_x, idx, w, handle, use_logfmt=True))
    expect("combine wait stats", NotImplementedError, ["combine_wait_recv_cost_stats",
                                                       "reference backend"],
           lambda: c(recv_x, idx, w, handle,
                     combine_wait_recv_cost_stats=torch.zeros(W, dtype=torch.int64)))
    expect("combine wait stats type", TypeError, ["combine_wait_recv_cost_stats",
                                                  "torch.Tensor or None"],
           lambda: c(recv_x, idx, w, handle, combine_wait_recv_cost_stats=[0] * W))
    expect("combine wait stats device", ValueError, ["combine_wait_recv_cost_stats", "meta"],
           lambda: c(recv_x, idx, w, handle, combine_wait_recv_cost_stats=torch.zeros(
               W, dtype=torch.int64, device="meta")))
    expect("rebuilt handle", TypeError, ["LowLatencyHandle", "tuple"],
           lambda: c(recv_x, idx, w, tuple(handle)))
    expect("zero_copy unprepared", ValueError, ["zero_copy=True",
                                                "get_next_low_latency_combine_buffer"],
           lambda: c(recv_x, idx, w, handle, zero_copy=True))
    expect("bad weights", TypeError, ["topk_weights"],
           lambda: c(recv_x, idx, w.double(), handle))
    # the mask update's arguments are checked first (named), then the backend refuses
    for args, exc, words in (((W, True), ValueError, [f"rank_to_mask={W}", f"[0, {W})"]),
                             ((-1,), ValueError, ["rank_to_mask=-1"]),
                             (("1", True), TypeError, ["rank_to_mask='1'"]),
                             ((0, "yes"), TypeError, ["mask='yes'"])):
        expect(f"update_mask{args}", exc, ["low_latency_update_mask_buffer"] + words,
               lambda args=args: buf.low_latency_update_mask_buffer(*args))
    for name, call in (("update", lambda: buf.low_latency_update_mask_buffer(1, True)),
                       ("query", lambda: buf.low_latency_query_mask_buffer(
                           torch.zeros(W, dtype=torch.int32))),
                       ("clean", lambda: buf.low_latency_clean_mask_buffer())):
        expect(f"mask {name} on reference", UnsupportedConfigError, ["reference backend"], call)
    # the normal mode's calls (collectives: every rank makes the same bad call here)
    expect("normal dispatch", TypeError, ["num_tokens_per_rank is required"],
           lambda: buf.dispatch(x))
    expect("normal combine", TypeError, ["handle must be the 6-tuple"],
           lambda: buf.combine(x, None))
    expect("normal layout", TypeError, ["topk_idx has dtype"],
           lambda: buf.get_dispatch_layout(x, E))
    other = B(None)
    other.clean_low_latency_buffer(T, H, E)
    expect("foreign handle", ValueError, ["another deep_ep.Buffer"],
           lambda: other.low_latency_combine(recv_x, idx, w, handle))
    y, _, _ = c(recv_x, idx, w, handle)             # the refusals left the buffer usable
    if y.shape != (x.shape[0], H):
        errors.append(f"combine after the refusals: shape {tuple(y.shape)}")
    other.destroy()
    buf.destroy()
    expect("after destroy", CommClosedError, ["closed"], lambda: d(x, idx, T, E))
    with deep_ep.EventOverlap():                     # an empty event waits for nothing
        pass
    handle = B.capture().event                      # an event on the current CUDA stream
    recorded = isinstance(handle, deep_ep.EventHandle) and handle.event is not None
    if recorded != torch.cuda.is_available():        # (no GPU: a complete handle)
        errors.append(f"Buffer.capture() recorded an event: {recorded} ({handle!r}), with a "
                      f"GPU: {torch.cuda.is_available()}")
    deep_ep.EventOverlap().current_stream_wait()
    return errors


def test_refusals_name_the_argument():
    errors = [e for r in run_distributed(_refusals_body, 2) for e in r]
    assert not errors, "\n".join(errors)
