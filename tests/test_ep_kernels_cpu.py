"""The EP Triton kernels' logic on the CPU, under ``TRITON_INTERPRET=1``, in one process.

Symmetric memory needs GPUs, but everything except the signals and waits can run here: every
virtual rank gets a plain CPU region laid out by ``ep_layout``, the table of region addresses
plays the peer table, and each stage (``STAGES`` bits) runs for every rank in turn, which is the
order the flags enforce on the GPU. Checked against the oracle: recv_x bytes, recv_count,
src_info, and combine bit for bit in fp32 and fp16 (the interpreter does no multiply-add
contraction either); in bf16 within two bf16 ulps, since the interpreter's fp32 -> bf16 cast
truncates where the GPU rounds to nearest even (the GPU tests compare bf16 bit for bit).
Consecutive calls alternate buffer sets through the kernels' own counters, as on the GPU.
FP8 dispatches are checked byte for byte (e4m3 codes and fp32 scales) against the oracle's
quantiser and against ``llcomm.runtime.fp8_format.quantize`` (what the reference backend sends).

The interpreter is chosen when Triton is imported, so the simulation runs in a subprocess.
"""

import pytest
import torch

from _interp import run_in_interpreter



#: The dispatch kernels' DeepEP outputs (deep_src, deep_layout, deep_stats): none here
#: (tests/test_deep_ep_convert.py runs them).
NO_DEEP_EP = (None, None, None)


def _pow2(n):
    return 1 << max(n - 1, 0).bit_length()


def _same_up_to_interpreter_rounding(got, want):
    """Bitwise for fp32 and fp16. For bf16 the interpreter rounds fp32 -> bf16 by truncation
    (the GPU rounds to nearest even), so allow the two roundings of combine (partial, total) to
    differ by a couple of bf16 ulps; a wrong row or weight is off by far more."""
    if got.dtype != torch.bfloat16:
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if got.numel() == 0:
        return True
    scale = 1 + float(want.float().abs().max())
    return torch.allclose(got.float(), want.float(), rtol=2 ** -5, atol=2 ** -5 * scale)


def _escaped(x):
    """x as the LL dispatch delivers it: every all-ones 32-bit word with its top bit cleared."""
    w = x.contiguous().view(torch.int32).clone()
    w[w == -1] = 0x7FFFFFFF
    return w.view(x.dtype)


def _poisoned_index_outputs(W, L, T, topk):
    """Every rank's dispatch index outputs, poisoned with -7: (row_of, src_info, recv_count,
    ntok)."""
    return ([torch.full((W, T, topk), -7, dtype=torch.int32) for _ in range(W)],
            [torch.full((L, W * T), -7, dtype=torch.int32) for _ in range(W)],
            [torch.full((L,), -7, dtype=torch.int32) for _ in range(W)],
            [torch.full((W,), -7, dtype=torch.int32) for _ in range(W)])


def _rows_fails(tag, r, exp_r, cnt, recv, src, L, ntok=None, want_ntok=None):
    """What rank r's dispatch got wrong against the oracle's ``exp_r`` (rows, counts,
    src_info) and, given ``want_ntok``, the token counts ``ntok``: a list of messages, empty
    when right. The rest is not compared after a wrong count."""
    ex, ec, es = exp_r
    if not torch.equal(cnt[r], ec):
        return [f"{tag} rank {r} recv_count {cnt[r].tolist()} != {ec.tolist()}"]
    fails = []
    if want_ntok is not None and ntok[r].tolist() != want_ntok:
        fails.append(f"{tag} rank {r} ntok {ntok[r].tolist()} != {want_ntok}")
    for e in range(L):
        c = int(ec[e])
        if not torch.equal(recv[r][e, :c].view(torch.uint8), ex[e, :c].view(torch.uint8)):
            fails.append(f"{tag} rank {r} recv_x of local expert {e} differs")
        if not torch.equal(src[r][e, :c], es[e, :c]):
            fails.append(f"{tag} rank {r} src_info of local expert {e} differs")
    return fails


def simulate(W, E, T, H, topk, NB, dtype_name, seeds, kinds, fp8=0, signals=False,
             carry=False, ll=0, plant=False, stats=False):
    """Run dispatch + combine for each (seed, kind) in turn on W virtual ranks; return failures.
    ``fp8``: the dispatch's FP8 mode (0 off, 1 on, 2 power-of-two scales). ``signals``: run the
    signal stages too, grouped as the send halves of ``return_recv_hook`` launch them
    (``D_SEND | D_SIGNAL``; ``C_WEIGHTS``, ``C_REDUCE | C_SIGNAL_P``), and check that every
    flag a wait would poll holds the expected word (the waits themselves read the GPU clock,
    which the interpreter lacks). ``carry``: the dispatch carries the weights (CARRY) into the
    handle slot's region (call i uses slot i % 2, as EPBuffer does) and the combine reads them
    there (CARRIED); the combine's own weights are then poisoned, so using them would show.
    ``ll``: the LL dispatch; each receive slot must be armed again after the call, and no
    word may have been missing (the receive half reads once and reports what it lacks).
    ``plant``: some row words are the LL sentinel (0xFFFFFFFF); they must arrive escaped
    (``_escaped``) and the combine is skipped (those rows are NaNs). ``stats``: the kernels'
    wait-statistics variants (STATS=1, a ``[W]`` int64 tensor per rank): the same results, and
    the statistics stay zero, since nothing here waits or reads the GPU clock (the LL receive
    reads each word once; ``lamport._clock`` is 0 there), so only the STATS code paths' data
    handling is exercised, not the timing (which the GPU tests check)."""
    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)
    from llcomm.ep import kernels as K
    from llcomm.runtime.fp8_format import dequantize, quantize
    from llcomm.ep.layout import ARM_BYTE, ep_layout
    from llcomm.ep.peer import dispatch_kernel, kernel_consts, ll_row_consts
    from test_ep_oracle import (expert_fn, make_case, oracle_combine, oracle_dispatch,
                                oracle_dispatch_fp8)

    dtype = getattr(torch, dtype_name)
    L = E // W
    isz = torch.tensor([], dtype=dtype).element_size()
    lay = ep_layout(T, H, W, E, isz, num_blocks=NB)
    regions = [torch.zeros(lay.total_bytes, dtype=torch.uint8) for _ in range(W)]
    for region in regions:          # as EPBuffer arms them
        for a, b in lay.armed_ranges():
            region[a:b] = ARM_BYTE
    tab = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    host = [torch.zeros(2, dtype=torch.int64) for _ in range(W)]
    err = [torch.tensor([0, h.data_ptr(), h.data_ptr() + 8], dtype=torch.int64) for h in host]
    ctrl = [torch.zeros(2, NB, dtype=torch.int64) for _ in range(W)]
    st = [torch.zeros(W, dtype=torch.int64) if stats else None for _ in range(W)]
    # scan tiles of 4 tokens: several even at these small token counts; up to 2 tokens take
    # the one-small-tile path
    dc, cc, _ = kernel_consts(lay, topk, ll=ll, tile_tokens=4, small_tile_tokens=2)
    if ll:
        dc = dict(dc, **ll_row_consts(lay, fp8))
    dispatch = dispatch_kernel(ll)
    fails = []
    call = 0
    for seed in seeds:
        for kind in kinds:
            tag = (f"[W={W} E={E} T={T} H={H} topk={topk} NB={NB} {dtype_name} fp8={fp8} "
                   f"carry={carry} seed={seed} {kind}]")
            xs, topks, weights = make_case(W, E, T, H, topk, seed, kind, dtype)
            if plant:       # sentinel words at the start, middle and end of some rows
                for x in xs:
                    words = x.view(torch.int32)
                    words[::2, 0] = -1
                    words[1::3, -1] = -1
                    words[:, words.shape[1] // 2] = -1
            w_off = lay.sets[call % 2].dispatch_weights
            call += 1
            if fp8:
                recv = [torch.full((L, W * T, H), 0x7F, dtype=torch.uint8) for _ in range(W)]
            else:
                recv = [torch.full((L, W * T, H), float("nan"), dtype=dtype) for _ in range(W)]
            scales = [torch.full((L, W * T, max(H // 128, 1)), float("nan")) for _ in range(W)]
            row_of, src, cnt, ntok = _poisoned_index_outputs(W, L, T, topk)
            d_stages = (K.DISPATCH_SEND_HALF, K.D_RECV) if signals else (K.D_SEND, K.D_RECV)
            for stage in d_stages:
                if stage == K.D_RECV and signals and not ll:
                    fails += _check_flags(regions, lay, ctrl, 0, [0], NB, W, tag)
                for r in range(W):
                    dispatch[(NB,)](
                        xs[r], topks[r], xs[r].shape[0], recv[r], scales[r], row_of[r], src[r],
                        cnt[r], ntok[r], tab, ctrl[r][0], err[r], r, 0, 0, weights[r], w_off,
                        st[r], *NO_DEEP_EP, **dict(dc, STAGES=stage, FP8=fp8, CARRY=int(carry),
                                      STATS=int(stats)))
            if ll:
                for r in range(W):
                    a, b = lay.armed_ranges()[(call - 1) % 2]
                    if not bool((regions[r][a:b] == ARM_BYTE).all()):
                        fails.append(f"{tag} rank {r}: receive slots not armed again")
                    if int(err[r][0]):
                        fails.append(f"{tag} rank {r}: error word {int(err[r][0]):#x}")
            exp = oracle_dispatch([_escaped(x) for x in xs] if plant else xs, topks, W, E, T)
            if fp8:
                exp8 = oracle_dispatch_fp8(xs, topks, W, E, T, fp8 == 2)
                lib = [quantize(x, round_scale=fp8 == 2) for x in xs]
                for r in range(W):
                    ec, es = exp8[r][2], exp8[r][3]
                    for e in range(L):
                        c = int(ec[e])
                        if not (torch.equal(recv[r][e, :c], exp8[r][0][e, :c])
                                and torch.equal(scales[r][e, :c], exp8[r][1][e, :c])):
                            fails.append(f"{tag} rank {r} fp8 rows / scales of local expert {e} "
                                         "differ from the oracle")
                        for j in range(c):
                            s_, t_ = divmod(int(es[e, j]), T)
                            q, sc = lib[s_][0][t_], lib[s_][1][t_]
                            if not (torch.equal(recv[r][e, j], q.view(torch.uint8))
                                    and torch.equal(scales[r][e, j], sc)):
                                fails.append(f"{tag} rank {r} expert {e} row {j} differs from "
                                             "llcomm.runtime.fp8_format.quantize (the reference "
                                             "backend)")
                # the rest of the checks and the combine run on the dequantised rows
                recv = [dequantize(recv[r].view(torch.float8_e4m3fn), scales[r], dtype)
                        for r in range(W)]
                exp = [(dequantize(a.view(torch.float8_e4m3fn), b, dtype), c, d)
                       for a, b, c, d in exp8]
            for r in range(W):
                fails += _rows_fails(tag, r, exp[r], cnt, recv, src, L, ntok,
                                     [x.shape[0] for x in xs])
            if plant:
                continue
            outs_e = [expert_fn(recv[r], cnt[r], r) for r in range(W)]
            outs = [torch.full((x.shape[0], H), float("nan"), dtype=dtype) for x in xs]
            c_stages = (K.C_WEIGHTS, K.C_REDUCE | K.C_SIGNAL_P, K.C_SUM) if signals \
                else (K.C_WEIGHTS, K.C_REDUCE, K.C_SUM)
            given = [torch.full_like(w, float("nan")) if carry else w for w in weights]
            for stage in c_stages:
                if stage == K.C_SUM and signals:
                    fails += _check_flags(regions, lay, ctrl, 1, [2], NB, W, tag)
                for r in range(W):
                    K.combine_kernel[(NB,)](
                        outs_e[r], topks[r], given[r], xs[r].shape[0], outs[r], row_of[r],
                        ntok[r], tab, ctrl[r][1], err[r], r, 0, 0, w_off, st[r],
                        **dict(cc, STAGES=stage, CARRIED=int(carry), STATS=int(stats)))
            want = oracle_combine(outs_e, topks, weights, W, E, dtype)
            for r in range(W):
                if not _same_up_to_interpreter_rounding(outs[r], want[r]):
                    d = (outs[r].float() - want[r].float()).abs()
                    worst = d.max() if d.numel() else 0
                    fails.append(f"{tag} rank {r} combine differs (max {worst})")
    calls = len(seeds) * len(kinds)
    for r in range(W):
        if stats and st[r].tolist() != [0] * W:
            fails.append(f"rank {r}: wait statistics {st[r].tolist()} without any wait")
        if ctrl[r].tolist() != [[calls] * NB, [0 if plant else calls] * NB]:
            fails.append(f"rank {r}: op counters {ctrl[r].tolist()}, expected {calls} everywhere")
        if int(host[r][1]):
            fails.append(f"rank {r}: out-of-range top-k reported without cause")
    return fails


def _check_flags(regions, lay, ctrl, op, phases, NB, W, tag):
    """Every flag ``[phase][block][source]`` of the set in use holds ``(seq + 1) << EPOCH_SHIFT``
    (the kernels ran with tag 0), as the receive half's wait requires."""
    from llcomm.runtime.protocol import EPOCH_SHIFT
    fails = []
    for r in range(W):
        seq = int(ctrl[r][op][0])
        base = (seq % 2) * lay.set_bytes + lay.offsets()["signal"]
        flags = regions[r][base:base + 8 * 3 * NB * W].view(torch.int64).view(3, NB, W)
        for ph in phases:
            want = (seq + 1) << EPOCH_SHIFT
            if not bool((flags[ph] == want).all()):
                fails.append(f"{tag} rank {r}: flags of phase {ph} {flags[ph].tolist()} != "
                             f"{want:#x}")
    return fails


def _bad_topk():
    """Out-of-range entries are counted into the host word and routed nowhere, by both
    dispatches."""
    from llcomm.ep import kernels as K
    from llcomm.ep.layout import ep_layout
    from llcomm.ep.peer import dispatch_kernel, kernel_consts
    W, E, T, H, NB, topk = 1, 4, 4, 16, 2, 2
    lay = ep_layout(T, H, W, E, 2, num_blocks=NB)
    region = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    tab = torch.tensor([region.data_ptr()], dtype=torch.int64)
    host = torch.zeros(2, dtype=torch.int64)
    err = torch.tensor([0, host.data_ptr(), host.data_ptr() + 8], dtype=torch.int64)
    ctrl = torch.zeros(NB, dtype=torch.int64)
    x = torch.randn(3, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 4], [-2, 1], [1, 99]])
    recv = torch.zeros(E, T, H, dtype=torch.bfloat16)
    row_of = torch.zeros(W, T, topk, dtype=torch.int32)
    src = torch.zeros(E, T, dtype=torch.int32)
    cnt = torch.zeros(E, dtype=torch.int32)
    ntok = torch.zeros(W, dtype=torch.int32)
    fails = []
    for ll in (0, 1):
        dc, _, _ = kernel_consts(lay, topk, ll=ll, tile_tokens=2)
        for stage in (K.D_SEND, K.D_RECV):
            dispatch_kernel(ll)[(NB,)](x, idx, 3, recv, recv, row_of, src, cnt, ntok, tab,
                                       ctrl, err, 0, 0, 0, idx, 0, None, *NO_DEEP_EP,
                                       STAGES=stage, FP8=0,
                                       **dc)
        if int(host[1]) != 3:
            fails.append(f"ll={ll}: reported {int(host[1])} bad entries, expected 3")
        if cnt.tolist() != [1, 2, 0, 0]:
            fails.append(f"ll={ll}: counts {cnt.tolist()}, expected [1, 2, 0, 0] (bad entries "
                         "ignored)")
        host.zero_()
        cnt.fill_(-7)
    return fails


def _run_in_interpreter(fn_name, *args):
    return run_in_interpreter("test_ep_kernels_cpu", fn_name, *args)


CASES = [  # W, E, T, H, topk, NB, dtype, seeds, kinds
    (2, 8, 6, 32, 3, 4, "bfloat16", [1, 2], ["random", "dups", "zero_and_max"]),
    (2, 4, 5, 16, 1, 3, "float32", [3], ["random", "one_expert", "none"]),
    (4, 8, 4, 16, 2, 2, "bfloat16", [4], ["random", "sparse", "zero_and_max"]),
    (3, 6, 3, 8, 4, 5, "float16", [5], ["random", "dups"]),
    (2, 8, 5, 256, 3, 4, "bfloat16", [1], ["random", "dups", "zero_and_max"], 1),   # FP8
    (3, 6, 3, 128, 2, 2, "float32", [2], ["random", "sparse"], 2),                # pow2 scales
    (2, 4, 4, 16, 2, 2, "float32", [6, 7], ["random", "zero_and_max"], 0, True),  # send halves
    # weights carried by the dispatch, both slots (three calls), plain and split-phase stages
    (2, 8, 6, 32, 3, 4, "float32", [1, 2], ["random", "dups", "zero_and_max"], 0, False, True),
    (3, 6, 3, 8, 4, 5, "float16", [5], ["random", "dups", "none"], 0, True, True),
    # the LL dispatch (LL=1): the same cases' shapes, FP8 both ways, send halves, carried weights
    (2, 8, 6, 32, 3, 4, "bfloat16", [1, 2], ["random", "dups", "zero_and_max"], 0, False, False,
     1),
    (4, 8, 4, 16, 2, 2, "bfloat16", [4], ["random", "sparse", "zero_and_max"], 0, False, False,
     1),
    (3, 6, 3, 8, 4, 5, "float16", [5], ["random", "dups", "none"], 0, True, True, 1),
    (2, 8, 5, 256, 3, 4, "bfloat16", [1], ["random", "dups", "zero_and_max"], 1, False, True, 1),
    (3, 6, 3, 128, 2, 2, "float32", [2], ["random", "sparse"], 2, True, False, 1),
    (2, 8, 6, 32, 3, 4, "float32", [1, 2], ["random", "dups", "zero_and_max"], 0, False, True,
     1),
    (2, 8, 6, 32, 3, 4, "bfloat16", [3], ["random", "zero_and_max"], 0, False, False, 1, True),
    # the wait-statistics variants (STATS=1), LL and flag dispatch, FP8 and carried weights
    (3, 6, 3, 128, 2, 2, "float32", [2], ["random", "dups"], 1, False, True, 1, False, True),
    (2, 8, 6, 32, 3, 4, "bfloat16", [1], ["random", "zero_and_max"], 0, True, False, 0, False,
     True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"w{c[0]}-e{c[1]}-k{c[4]}-{c[6]}"
                                             + (f"-fp8m{c[9]}" if len(c) > 9 else "")
                                             + ("-signals" if len(c) > 10 and c[10] else "")
                                             + ("-carry" if len(c) > 11 and c[11] else "")
                                             + ("-ll" if len(c) > 12 and c[12] else "")
                                             + ("-sentinel" if len(c) > 13 and c[13] else "")
                                             + ("-stats" if len(c) > 14 else "")
                                             for c in CASES])
def test_kernels_match_oracle_in_interpreter(case):
    fails = _run_in_interpreter("simulate", *case)
    assert not fails, "\n".join(fails[:20])


def test_out_of_range_topk_is_reported_and_ignored():
    fails = _run_in_interpreter("_bad_topk")
    assert not fails, "\n".join(fails)


def _e4m3_exhaustive():
    """``_e4m3_bits`` against torch's float8_e4m3fn cast on every tie and its neighbours, the
    subnormal range, the saturation edge and random values."""
    import triton
    import triton.language as tl
    from llcomm.ep.kernels import fp8_rows as F
    globals()["_E4M3_BITS"] = F._e4m3_bits      # a jit function resolves module globals

    @triton.jit
    def conv(src, dst, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, _E4M3_BITS(tl.load(src + i)).to(tl.uint8))  # noqa: F821  (set above)

    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    ulp = mids.view(torch.int32)
    v = torch.cat([vals, mids, (ulp + 1).view(torch.float32), (ulp - 1).view(torch.float32),
                   torch.rand(4096) * 448, torch.rand(2048) * 2 ** -6,
                   torch.tensor([448.0, 447.9, 2.0 ** -130, 0.0])])
    v = torch.cat([v, -v])
    n = 1 << (v.numel() - 1).bit_length()
    src = torch.zeros(n)
    src[:v.numel()] = v
    dst = torch.zeros(n, dtype=torch.uint8)
    conv[(1,)](src, dst, N=n)
    want = src.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (dst != want).nonzero().view(-1)[:5].tolist()
    return [f"{float(src[i])!r}: kernel {int(dst[i]):#x}, torch {int(want[i]):#x}" for i in bad]


def test_e4m3_rounding_matches_torch():
    fails = _run_in_interpreter("_e4m3_exhaustive")
    assert not fails, "\n".join(fails)


def simulate_masked(W, E, T, H, topk, NB, dtype_name, seed, kind, masked):
    """Rank masks (``MASKS=1``): every rank pushes (a masked rank's late rows and counts land
    too, so a stage that read them would be caught), then only the live ranks receive, with
    ``err[ERR_MASK]`` naming ``masked``, and run the combine without the masked ranks (their
    weights never come). Checked against the oracle with the masked ranks' contributions
    absent: dispatch as if they had sent no token, combine as if their experts were not in any
    top-k (zeros for a token routed only to them). Returns failures."""
    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)
    from llcomm.ep import kernels as K
    from llcomm.ep.layout import ep_layout
    from llcomm.ep.peer import kernel_consts
    from test_ep_oracle import expert_fn, make_case, oracle_combine, oracle_dispatch

    dtype = getattr(torch, dtype_name)
    L = E // W
    live = [r for r in range(W) if r not in masked]
    bits = sum(1 << r for r in masked)
    isz = torch.tensor([], dtype=dtype).element_size()
    lay = ep_layout(T, H, W, E, isz, num_blocks=NB)
    regions = [torch.zeros(lay.total_bytes, dtype=torch.uint8) for _ in range(W)]
    tab = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    host = [torch.zeros(2, dtype=torch.int64) for _ in range(W)]
    err = [torch.tensor([0, h.data_ptr(), h.data_ptr() + 8, bits, 0], dtype=torch.int64)
           for h in host]
    ctrl = [torch.zeros(2, NB, dtype=torch.int64) for _ in range(W)]
    dc, cc, _ = kernel_consts(lay, topk, ll=0, tile_tokens=4, small_tile_tokens=2)
    dc, cc = dict(dc, MASKS=1), dict(cc, MASKS=1)      # masks: the flag dispatch
    tag = f"[W={W} E={E} T={T} H={H} topk={topk} {dtype_name} seed={seed} {kind} masked={masked}]"
    xs, topks, weights = make_case(W, E, T, H, topk, seed, kind, dtype)
    recv = [torch.full((L, W * T, H), float("nan"), dtype=dtype) for _ in range(W)]
    row_of, src, cnt, ntok = _poisoned_index_outputs(W, L, T, topk)
    for stage, ranks in ((K.D_SEND, range(W)), (K.D_RECV, live)):
        for r in ranks:
            K.flag_dispatch_kernel[(NB,)](
                xs[r], topks[r], xs[r].shape[0], recv[r], recv[r], row_of[r], src[r], cnt[r],
                ntok[r], tab, ctrl[r][0], err[r], r, 0, 0, topks[r], 0, None, *NO_DEEP_EP,
                STAGES=stage, FP8=0, **dc)
    # the oracle: masked sources sent nothing
    xs_live = [x if s in live else x[:0] for s, x in enumerate(xs)]
    topks_live = [t if s in live else t[:0] for s, t in enumerate(topks)]
    exp = oracle_dispatch(xs_live, topks_live, W, E, T)
    fails = []
    for r in live:
        fails += _rows_fails(tag, r, exp[r], cnt, recv, src, L, ntok,
                             [x.shape[0] for x in xs_live])
    # combine among the live ranks only; a masked rank's partial slots are poisoned
    outs_e = [expert_fn(recv[r], cnt[r], r) if r in live else None for r in range(W)]
    outs = [torch.full((x.shape[0], H), float("nan"), dtype=dtype) for x in xs]
    cx = lay.offsets()["combine_x"]
    for r in live:
        seq = int(ctrl[r][1][0])
        base = (seq % 2) * lay.set_bytes + cx
        region = regions[r][base:base + W * T * H * isz].view(dtype).view(W, T, H)
        for q in masked:
            region[q] = float("nan")
    for stage in (K.C_WEIGHTS, K.C_REDUCE, K.C_SUM):
        for r in live:
            K.combine_kernel[(NB,)](
                outs_e[r], topks[r], weights[r], xs[r].shape[0], outs[r], row_of[r], ntok[r],
                tab, ctrl[r][1], err[r], r, 0, 0, 0, None, STAGES=stage, **cc)
    # experts on masked ranks count as absent from every top-k
    topks_cut = [torch.where((t >= 0) & (t < E) & torch.isin(t // L, torch.tensor(masked)), -1, t)
                 for t in topks_live]
    all_out = [expert_fn(*exp[q][:2], q) for q in range(W)]
    want = oracle_combine(all_out, topks_cut, weights, W, E, dtype)
    for r in live:
        if not _same_up_to_interpreter_rounding(outs[r], want[r]):
            d = (outs[r].float() - want[r].float()).abs()
            fails.append(f"{tag} rank {r} combine differs (max {d.max() if d.numel() else 0})")
        if int(err[r][0]) or int(err[r][3]) != bits:
            fails.append(f"{tag} rank {r}: error word {int(err[r][0]):#x}, mask "
                         f"{int(err[r][3]):#x} (expected 0, {bits:#x})")
    return fails


MASK_CASES = [  # W, E, T, H, topk, NB, dtype, seed, kind, masked ranks
    (2, 8, 6, 32, 3, 4, "float32", 1, "random", [1]),
    (3, 6, 5, 16, 3, 2, "float32", 2, "random", [1]),
    (3, 6, 4, 16, 2, 3, "bfloat16", 3, "dups", [0]),
    (4, 8, 4, 16, 4, 2, "float16", 4, "random", [0, 3]),
    (4, 8, 5, 16, 2, 2, "float32", 5, "zero_and_max", [2]),
]


@pytest.mark.parametrize("case", MASK_CASES,
                         ids=[f"w{c[0]}-{c[6]}-{c[8]}-m{''.join(map(str, c[9]))}"
                              for c in MASK_CASES])
def test_masked_sources_are_skipped_in_interpreter(case):
    fails = _run_in_interpreter("simulate_masked", *case)
    assert not fails, "\n".join(fails[:20])


def simulate_masked_by_hand(W, E, T, H, topk, NB, dtype_name, seeds, kind, hand):
    """A rank masked by hand (``EPBuffer.set_mask`` / DeepEP's ``low_latency_update_mask_
    buffer``): every live rank sets bit ``hand`` of its mask word with
    ``masks.update_mask_word``, the update ``set_mask`` makes (and sets and clears another bit,
    which must leave no trace), then one round runs with every rank making every stage, the
    masked one included (it is alive: its rows, counts and partials land, and must be ignored).
    The live ranks' results must equal the oracle without it; its partial slots are poisoned
    before the sums. Then the live ranks unmask it with the same update and a second round must
    match the full oracle on every rank. Returns failures."""
    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)
    from llcomm.ep import kernels as K
    from llcomm.ep.layout import ERR_MASK, ep_layout
    from llcomm.ep.masks import update_mask_word
    from llcomm.ep.peer import kernel_consts
    from test_ep_oracle import expert_fn, make_case, oracle_combine, oracle_dispatch

    dtype = getattr(torch, dtype_name)
    L = E // W
    live = [r for r in range(W) if r != hand]
    isz = torch.tensor([], dtype=dtype).element_size()
    lay = ep_layout(T, H, W, E, isz, num_blocks=NB)
    regions = [torch.zeros(lay.total_bytes, dtype=torch.uint8) for _ in range(W)]
    tab = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    host = [torch.zeros(2, dtype=torch.int64) for _ in range(W)]
    err = [torch.tensor([0, h.data_ptr(), h.data_ptr() + 8, 0, 0], dtype=torch.int64)
           for h in host]
    ctrl = [torch.zeros(2, NB, dtype=torch.int64) for _ in range(W)]
    dc, cc, _ = kernel_consts(lay, topk, ll=0, tile_tokens=4, small_tile_tokens=2)
    dc, cc = dict(dc, MASKS=1), dict(cc, MASKS=1)      # masks: the flag dispatch
    fails = []
    if K.ERR_MASK.value != ERR_MASK:
        fails.append(f"the kernels' mask word {K.ERR_MASK.value} is not layout's {ERR_MASK}")
    other = (hand + 1) % W
    for r in live:
        update_mask_word(err[r], hand, True)
        update_mask_word(err[r], other, True)
        update_mask_word(err[r], other, False)
        if int(err[r][ERR_MASK]) != 1 << hand:
            fails.append(f"rank {r}: mask word {int(err[r][ERR_MASK]):#x} after masking "
                         f"{hand} and {other}, unmasking {other} (expected {1 << hand:#x})")
    for round_, seed in enumerate(seeds):
        absent = [hand] if round_ == 0 else []
        tag = f"[W={W} E={E} T={T} H={H} topk={topk} {dtype_name} seed={seed} {kind} " \
              f"masked by hand={absent}]"
        xs, topks, weights = make_case(W, E, T, H, topk, seed, kind, dtype)
        recv = [torch.full((L, W * T, H), float("nan"), dtype=dtype) for _ in range(W)]
        row_of, src, cnt, ntok = _poisoned_index_outputs(W, L, T, topk)
        for stage in (K.D_SEND, K.D_RECV):
            for r in range(W):
                K.flag_dispatch_kernel[(NB,)](
                    xs[r], topks[r], xs[r].shape[0], recv[r], recv[r], row_of[r], src[r],
                    cnt[r], ntok[r], tab, ctrl[r][0], err[r], r, 0, 0, topks[r], 0, None,
                    *NO_DEEP_EP, STAGES=stage, FP8=0, **dc)
        xs_l = [x[:0] if s in absent else x for s, x in enumerate(xs)]
        tk_l = [t[:0] if s in absent else t for s, t in enumerate(topks)]
        exp = oracle_dispatch(xs_l, tk_l, W, E, T)
        checked = live if absent else range(W)
        for r in checked:
            fails += _rows_fails(tag, r, exp[r], cnt, recv, src, L)
        outs_e = [expert_fn(recv[r], cnt[r], r) for r in range(W)]
        outs = [torch.full((x.shape[0], H), float("nan"), dtype=dtype) for x in xs]
        cx = lay.offsets()["combine_x"]
        for stage in (K.C_WEIGHTS, K.C_REDUCE, K.C_SUM):
            if stage == K.C_SUM and absent:        # the masked rank's partials: poisoned
                for r in live:
                    base = (int(ctrl[r][1][0]) % 2) * lay.set_bytes + cx
                    region = regions[r][base:base + W * T * H * isz].view(dtype).view(W, T, H)
                    region[hand] = float("nan")
            for r in range(W):
                K.combine_kernel[(NB,)](
                    outs_e[r], topks[r], weights[r], xs[r].shape[0], outs[r], row_of[r],
                    ntok[r], tab, ctrl[r][1], err[r], r, 0, 0, 0, None, STAGES=stage, **cc)
        gone = torch.tensor(absent or [-1])
        cut = [torch.where((t >= 0) & (t < E) & torch.isin(t // L, gone), -1, t) for t in tk_l]
        all_out = [expert_fn(*exp[q][:2], q) for q in range(W)]
        want = oracle_combine(all_out, cut, weights, W, E, dtype)
        for r in checked:
            if not _same_up_to_interpreter_rounding(outs[r], want[r]):
                d = (outs[r].float() - want[r].float()).abs()
                fails.append(f"{tag} rank {r} combine differs (max {d.max() if d.numel() else 0})")
        if round_ == 0:
            for r in live:                          # back: unmasked by hand
                update_mask_word(err[r], hand, False)
    for r in range(W):
        if int(err[r][0]) or int(err[r][ERR_MASK]):
            fails.append(f"rank {r}: error word {int(err[r][0]):#x}, mask "
                         f"{int(err[r][ERR_MASK]):#x} at the end (expected 0, 0)")
    return fails


HAND_CASES = [  # W, E, T, H, topk, NB, dtype, seeds (masked round, full round), kind, masked
    (2, 8, 6, 32, 3, 4, "float32", [1, 2], "random", 1),
    (3, 6, 4, 16, 2, 3, "bfloat16", [3, 4], "dups", 0),
    (4, 8, 5, 16, 4, 2, "float16", [5, 6], "zero_and_max", 2),
]


@pytest.mark.parametrize("case", HAND_CASES, ids=[f"w{c[0]}-{c[6]}-m{c[9]}" for c in HAND_CASES])
def test_rank_masked_by_hand_is_skipped_then_back_in_interpreter(case):
    fails = _run_in_interpreter("simulate_masked_by_hand", *case)
    assert not fails, "\n".join(fails[:20])


def _stub_peer(ll, masks):
    """A ``PeerEP`` without a GPU: its launch arguments built exactly as ``dispatch`` /
    ``combine`` build them, the launch recorded instead of made."""
    from types import SimpleNamespace
    from llcomm.ep import kernels
    from llcomm.ep.layout import HANDLE_SLOTS, MAX_TOPK, ep_layout
    from llcomm.ep.peer import PeerEP, dispatch_kernel, ll_row_consts
    from llcomm.runtime.settings import EPSettings

    W, T, H, E, NB = 2, 4, 64, 8, 4
    p = PeerEP.__new__(PeerEP)
    p.k, p.rank, p.W, p.nb, p.num_warps = kernels, 0, W, NB, 4
    p.settings = EPSettings.read()
    p.layout = ep_layout(T, H, W, E, 2, num_blocks=NB)
    p.buf = SimpleNamespace(max_tokens=T, num_local_experts=E // W, hidden=H,
                            dtype=torch.bfloat16, sends_in_flight=1)
    p.timeout_us, p.ll, p.masks, p.profile = 1000, ll, masks, 0
    p.dispatch_kernel, p.combine_kernel = dispatch_kernel(ll), kernels.combine_kernel
    p._rows = [ll_row_consts(p.layout, f) for f in range(3)]
    p.tab = torch.zeros(W, dtype=torch.int64)
    ctrl = torch.zeros(2, NB, dtype=torch.int64)
    p._ctrl, p.err = (ctrl[0], ctrl[1]), torch.zeros(16, dtype=torch.int64)
    p._slot_words = (W * T * MAX_TOPK, (E // W) * W * T, E // W, W)
    p.slots = [torch.zeros(sum(p._slot_words), dtype=torch.int32) for _ in range(HANDLE_SLOTS)]
    p._call_consts, p._slot_views, p._tags = {}, {}, {}
    p.launches = []
    p._launch = lambda fn, grid, args, warps, **consts: p.launches.append((fn, args, consts))
    return p, W, T, H


@pytest.mark.parametrize("ll,masks", [(1, 0), (0, 0), (0, 1)])
def test_peer_launch_arguments_bind_to_the_kernels(ll, masks):
    """Every launch ``PeerEP`` makes (dispatch, split halves, combine, with and without wait
    statistics) binds to its kernel's parameters: no argument missing or extra, ``stats`` the
    tensor with STATS=1 and None (a constexpr: no code) without. A mistake here would only show
    on the GPU otherwise."""
    import inspect
    p, W, T, H = _stub_peer(ll, masks)
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    idx = torch.zeros(T, 2, dtype=torch.int64)
    w = torch.zeros(T, 2)
    recv = torch.zeros(4, W * T, H, dtype=torch.bfloat16)
    for stats in (None, torch.zeros(W, dtype=torch.int64)):
        p.launches.clear()
        _, _, state, recv_half = p.dispatch(x, idx, recv, 0, stats=stats)
        p.dispatch(x, idx, recv, 1, split=True, weights=w, stats=stats)[3]()
        p.combine(recv, idx, w, state, torch.zeros(T, H, dtype=torch.bfloat16), stats=stats)
        p.combine_send(recv, idx, w, state, torch.zeros(T, H, dtype=torch.bfloat16),
                       stats=stats)()
        assert recv_half is None and len(p.launches) == 6
        for fn, args, consts in p.launches:
            params = inspect.signature(fn.fn).parameters
            bound = inspect.signature(fn.fn).bind(
                *args, **{k: v for k, v in consts.items() if k in params})
            assert bound.arguments["stats"] is stats, fn.fn.__name__
            assert consts.get("STATS", 0) == int(stats is not None), fn.fn.__name__
