"""GPU tests of EP dispatch / combine on the peer backend (2 GPUs, NCCL group), against the
reference backend on NCCL in the same process group: dispatch byte for byte (it is pure
movement), combine bit for bit (same order, same roundings) and within bf16 tolerance of the
exact sum, under repetition with fresh routings, alternating buffer sets, outstanding handles,
CUDA-graph capture and replay, and with a peer that never arrives or disagrees.

Run on a 2-GPU host: ``python -m pytest tests/test_ep_gpu.py -m gpu -x -q``.
"""

import pytest
import torch
import torch.distributed as dist

from _dist import absent_peer_error, run_distributed
from llcomm.bench.timing import capture
from test_ep_oracle import KINDS, make_case, oracle_combine_f64
from test_ep_oracle import expert_fn_all_rows as _experts  # graph-safe stand-in experts

pytestmark = pytest.mark.gpu

DEEPSEEK = dict(E=256, H=7168, T=128, topk=8)       # the benchmark shape
SMALL = dict(E=16, H=512, T=24, topk=4)
ODD = dict(E=6, H=40, T=7, topk=3)                   # 80-byte rows, 3 local experts


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _buffers(E, H, T, dtype=torch.bfloat16, **kw):
    import llcomm.ep as ep
    peer = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T, dtype=dtype,
                       backend="peer", **kw)
    ref = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T, dtype=dtype,
                      backend="reference")
    assert peer.backend == "peer" and ref.backend == "reference"
    return peer, ref


def _case(rank, W, E, H, T, topk, seed, kind, dtype=torch.bfloat16):
    xs, topks, ws = make_case(W, E, T, H, topk, seed, kind, dtype)
    return xs, topks, ws, (xs[rank].cuda(), topks[rank].cuda(), ws[rank].cuda())


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _statics(n, E, H, T, topk, W):
    """A captured step's static tensors: x, topk_idx (empty: -1), weights, recv_x and out
    (poisoned) for ``n`` tokens of a buffer of ``T``."""
    return (torch.zeros(n, H, dtype=torch.bfloat16, device="cuda"),
            torch.full((n, topk), -1, dtype=torch.int64, device="cuda"),
            torch.zeros(n, topk, dtype=torch.float32, device="cuda"),
            _poisoned((E // W, W * T, H), torch.bfloat16), _poisoned((n, H), torch.bfloat16))


def _compare_dispatch(got, want, what):
    (rx, rc, h), (wx, wc, wh) = got, want
    assert torch.equal(rc, wc), f"{what}: recv_count {rc.tolist()} != {wc.tolist()}"
    for e, c in enumerate(wc.tolist()):
        assert torch.equal(_bits(rx[e, :c]), _bits(wx[e, :c])), f"{what}: recv_x of expert {e}"
        assert torch.equal(h.src_info[e, :c], wh.src_info[e, :c]), f"{what}: src_info {e}"


def _one_round(peer, ref, rank, W, cfg, seed, kind, dtype=torch.bfloat16, check_exact=True):
    E, H, T, topk = cfg["E"], cfg["H"], cfg["T"], cfg["topk"]
    L = E // W
    xs, topks, ws, (x, idx, w) = _case(rank, W, E, H, T, topk, seed, kind, dtype)
    what = f"seed={seed} kind={kind} cfg={cfg} {dtype}"
    got = peer.dispatch(x, idx, out=_poisoned((L, W * T, H), dtype))
    want = ref.dispatch(x, idx)
    _compare_dispatch(got, want, what)
    eo = _experts(want[0], rank)
    y = peer.combine(eo, idx, w, got[2], out=_poisoned((x.shape[0], H), dtype))
    y_ref = ref.combine(eo, idx, w, want[2])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol, msg=what)
    if check_exact:
        assert torch.equal(_bits(y), _bits(y_ref)), f"{what}: combine not bitwise = reference"
    return y


def _vs_reference_body(rank, W):
    for cfg, dtypes, seeds in ((ODD, (torch.bfloat16, torch.float32), (1, 2)),
                               (SMALL, (torch.bfloat16, torch.float16), (3,)),
                               (DEEPSEEK, (torch.bfloat16,), (4,))):
        for dtype in dtypes:
            peer, ref = _buffers(cfg["E"], cfg["H"], cfg["T"], dtype)
            for seed in seeds:
                for kind in KINDS:
                    y1 = _one_round(peer, ref, rank, W, cfg, seed, kind, dtype)
                    y2 = _one_round(peer, ref, rank, W, cfg, seed, kind, dtype)
                    assert torch.equal(_bits(y1), _bits(y2)), "combine not reproducible"
            peer.check()
            peer.close()


def test_dispatch_and_combine_match_reference():
    run_distributed(_vs_reference_body, 2, backend="nccl", timeout=600)


def _exact_sum_body(rank, W):
    """Combine within bf16 tolerance of the float64 sum of the same expert outputs."""
    cfg = DEEPSEEK
    E, H, T, topk = cfg["E"], cfg["H"], cfg["T"], cfg["topk"]
    peer, ref = _buffers(E, H, T)
    xs, topks, ws, (x, idx, w) = _case(rank, W, E, H, T, topk, 7, "random")
    rx, rc, h = peer.dispatch(x, idx)
    eo = _experts(rx, rank)
    y = peer.combine(eo, idx, w, h)
    # every rank's expert outputs on the host, for the float64 oracle
    eos = [torch.empty_like(eo) for _ in range(W)]
    dist.all_gather(eos, eo)
    exact = oracle_combine_f64([e.cpu() for e in eos], topks, ws, W, E)[rank]
    torch.testing.assert_close(y.cpu().double(), exact, rtol=1.6e-2, atol=1.6e-2)
    peer.close()


def test_combine_close_to_exact_sum():
    run_distributed(_exact_sum_body, 2, backend="nccl", timeout=600)


ROUNDS = 200


def _repeat_body(rank, W):
    """200 consecutive calls alternating buffer sets, a fresh routing each time, with sometimes
    two dispatches outstanding and combined in either order."""
    cfg = dict(E=32, H=1024, T=64, topk=6)
    peer, ref = _buffers(cfg["E"], cfg["H"], cfg["T"])
    i = dispatches = combines = 0
    while i < ROUNDS:
        kind = KINDS[i % len(KINDS)]
        if i % 7 == 3:  # two outstanding handles
            cases = [_case(rank, W, cfg["E"], cfg["H"], cfg["T"], cfg["topk"], 1000 + i + j, kind)
                     for j in range(2)]
            got = [peer.dispatch(c[3][0], c[3][1]) for c in cases]
            want = [ref.dispatch(c[3][0], c[3][1]) for c in cases]
            order = (1, 0) if i % 2 else (0, 1)
            for j in order:
                x, idx, w = cases[j][3]
                _compare_dispatch(got[j], want[j], f"round {i}+{j}")
                eo = _experts(want[j][0], rank)
                y = peer.combine(eo, idx, w, got[j][2])
                assert torch.equal(_bits(y), _bits(ref.combine(eo, idx, w, want[j][2]))), i
            i += 2
            dispatches += 2
            combines += 2
        else:
            _one_round(peer, ref, rank, W, cfg, 1000 + i, kind)
            i += 1
            dispatches += 1
            combines += 1
    peer.check()
    # every block of every kernel advanced its counter once per call
    ctrl = peer._impl.ctrl.tolist()
    assert ctrl[0] == [dispatches] * len(ctrl[0]) and ctrl[1] == [combines] * len(ctrl[1]), ctrl
    peer.close()


def test_200_rounds_alternating_sets():
    run_distributed(_repeat_body, 2, backend="nccl", timeout=600)


REPLAYS = 50


def _fill_static(rank, W, cfg, seed, kind, sx, sidx, sw):
    """A fresh case into a captured graph's static inputs: its first tokens (as many as fit),
    the rest empty (no expert, weight 0)."""
    xs, topks, ws, _ = _case(rank, W, cfg["E"], cfg["H"], cfg["T"], cfg["topk"], seed, kind)
    m = min(sx.shape[0], xs[rank].shape[0])
    sx.zero_()
    sidx.fill_(-1)
    sw.zero_()
    sx[:m].copy_(xs[rank][:m])
    sidx[:m].copy_(topks[rank][:m])
    sw[:m].copy_(ws[rank][:m])


def _graph_body(rank, W):
    cfg = dict(E=64, H=2048, T=32, topk=8)
    E, H, T, topk = cfg["E"], cfg["H"], cfg["T"], cfg["topk"]
    peer, ref = _buffers(E, H, T)
    n = T - 3 * rank                       # token counts differ per rank
    sx, sidx, sw, srecv, sy = _statics(n, E, H, T, topk, W)
    keep = {}

    def step():
        rx, rc, h = peer.dispatch(sx, sidx, out=srecv)
        keep["count"] = rc
        keep["src"] = h.src_info
        peer.combine(_experts(rx, rank), sidx, sw, h, out=sy)

    def fill(seed):
        _fill_static(rank, W, cfg, seed, KINDS[seed % len(KINDS)], sx, sidx, sw)

    fill(1)
    g = capture(step, 1)                   # compiles outside the capture
    for i in range(REPLAYS):
        fill(100 + i)
        srecv.fill_(float("nan"))
        sy.fill_(float("nan"))
        g.replay()
        wx, wc, wh = ref.dispatch(sx, sidx)
        assert torch.equal(keep["count"], wc), i
        for e, c in enumerate(wc.tolist()):
            assert torch.equal(_bits(srecv[e, :c]), _bits(wx[e, :c])), (i, e)
            assert torch.equal(keep["src"][e, :c], wh.src_info[e, :c]), (i, e)
        y_ref = ref.combine(_experts(wx, rank), sidx, sw, wh)
        assert torch.equal(_bits(sy), _bits(y_ref)), i
        if i % 3 == 1:  # eager calls between replays: the device-side set parity keeps going
            _one_round(peer, ref, rank, W, cfg, 5000 + i, "random")
    peer.check()
    peer.close()


def test_graph_capture_and_replay():
    run_distributed(_graph_body, 2, backend="nccl", timeout=600)


def _carried_body(rank, W):
    """dispatch(topk_weights=w) + combine(..., None, handle) against the reference's combine
    with w, bit for bit: the issue's shape and a small one, carried and plain calls mixed (both
    handle slots, both sets, two handles outstanding), the weights poisoned right after the
    dispatch (the dispatch-time values count), split phase, and a replayed graph."""
    for cfg in (DEEPSEEK, SMALL):
        E, H, T, topk = cfg["E"], cfg["H"], cfg["T"], cfg["topk"]
        peer, ref = _buffers(E, H, T)
        for i in range(12):
            cases = [_case(rank, W, E, H, T, topk, 300 + 2 * i + j, KINDS[(i + j) % len(KINDS)])
                     for j in range(2)]
            carry = (i % 3 != 0, i % 2 == 0)
            got = []
            for (_, _, _, (x, idx, w)), c in zip(cases, carry):
                wc = w.clone()
                got.append(peer.dispatch(x, idx, topk_weights=wc if c else None))
                wc.fill_(float("nan"))
            for j in ((1, 0) if i % 2 else (0, 1)):
                x, idx, w = cases[j][3]
                rx, rc, h = ref.dispatch(x, idx)
                _compare_dispatch(got[j], (rx, rc, h), f"round {i}.{j}")
                eo = _experts(rx, rank)
                want = ref.combine(eo, idx, w, h)
                hooked = i % 4 == 1
                r = peer.combine(eo, idx, None if carry[j] else w, got[j][2],
                                 out=_poisoned(want.shape, want.dtype), return_recv_hook=hooked)
                if hooked:
                    r[1]()
                    r = r[0]
                assert torch.equal(_bits(r), _bits(want)), (cfg, i, j, carry[j])
        peer.check()
        peer.close()
    # a replayed graph of a carried dispatch + combine, eager calls between replays
    cfg = dict(E=64, H=2048, T=32, topk=8)
    E, H, T, topk = cfg["E"], cfg["H"], cfg["T"], cfg["topk"]
    peer, ref = _buffers(E, H, T)
    sx, sidx, sw, srecv, sy = _statics(T - 3 * rank, E, H, T, topk, W)

    def step():
        rx, _, h = peer.dispatch(sx, sidx, out=srecv, topk_weights=sw)
        peer.combine(_experts(rx, rank), sidx, None, h, out=sy)

    _fill_static(rank, W, cfg, 1, "random", sx, sidx, sw)
    g = capture(step, 1)
    for i in range(20):
        _fill_static(rank, W, cfg, 700 + i, KINDS[i % len(KINDS)], sx, sidx, sw)
        sy.fill_(float("nan"))
        g.replay()
        wx, _, wh = ref.dispatch(sx, sidx)
        assert torch.equal(_bits(sy), _bits(ref.combine(_experts(wx, rank), sidx, sw, wh))), i
        if i % 3 == 1:
            _one_round(peer, ref, rank, W, cfg, 7000 + i, "random")
    peer.check()
    peer.close()


def test_weights_carried_by_the_dispatch():
    run_distributed(_carried_body, 2, backend="nccl", timeout=600)


TIMEOUT_MS = 200


def _timeout_body(rank, W, op):
    import llcomm
    peer, _ = _buffers(**dict(E=8, H=256, T=8), timeout_ms=TIMEOUT_MS)
    x = torch.ones(4, 256, dtype=torch.bfloat16, device="cuda")
    idx = torch.tensor([[0, 7], [1, 2], [3, 4], [5, 6]], device="cuda")
    w = torch.ones(4, 2, device="cuda")
    rx, rc, h = peer.dispatch(x, idx)
    call = (lambda: peer.dispatch(x, idx)) if op == "dispatch" else \
        (lambda: peer.combine(rx, idx, w, h))
    err = absent_peer_error(rank, call, peer.check, TIMEOUT_MS)
    if err is None:
        return None
    assert op in err.op, err
    with pytest.raises(llcomm.CommBrokenError, match="destroy it"):
        peer.dispatch(x, idx)
    return str(err)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_missing_peer_times_out(op):
    msgs = run_distributed(_timeout_body, 2, op, backend="nccl")
    assert "did not arrive" in msgs[0]


def _mismatch_body(rank, W):
    import llcomm
    peer, _ = _buffers(**dict(E=8, H=256, T=8), timeout_ms=TIMEOUT_MS)
    topk = 2 + rank                        # the ranks disagree about top-k
    x = torch.ones(4, 256, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(4, topk, dtype=torch.int64, device="cuda")
    peer.dispatch(x, idx)
    with pytest.raises((llcomm.CommMismatchError, llcomm.CommTimeoutError)) as info:
        peer.check()
    return type(info.value).__name__


def test_ranks_disagreeing_on_topk_are_reported():
    names = run_distributed(_mismatch_body, 2, backend="nccl")
    assert "CommMismatchError" in names, names


def _bad_topk_body(rank, W):
    peer, _ = _buffers(**dict(E=8, H=256, T=8))
    x = torch.ones(2, 256, dtype=torch.bfloat16, device="cuda")
    idx = torch.tensor([[0, 8], [-3, 1]], device="cuda")   # 8 and -3 are out of range
    rx, rc, h = peer.dispatch(x, idx)
    with pytest.raises(ValueError, match="2 topk_idx entries outside"):
        peer.check()
    # the bad entries were treated as -1: rank 0 holds experts 0-3 and got tokens 0 and 1 of
    # both ranks; rank 1 got nothing. The buffer keeps working.
    assert rc.tolist() == ([2, 2, 0, 0] if rank == 0 else [0, 0, 0, 0]), rc.tolist()
    idx_ok = torch.tensor([[0, 7], [-1, 1]], device="cuda")
    rx, rc, h = peer.dispatch(x, idx_ok)
    peer.combine(_experts(rx, rank), idx_ok, torch.ones(2, 2, device="cuda"), h)
    peer.check()
    peer.close()


def test_out_of_range_topk_reported_on_gpu():
    run_distributed(_bad_topk_body, 2, backend="nccl")


def _fp8_body(rank, W):
    """FP8 dispatch: peer and reference give the same e4m3 bytes and scales, with and without
    power-of-two scales, on a buffer for both kinds and on an FP8-only buffer; combine after an
    FP8 dispatch stays bitwise equal."""
    for cfg, fp8_only in ((dict(E=16, H=512, T=24, topk=4), False), (DEEPSEEK, False),
                          (dict(E=8, H=128, T=7, topk=3), True)):
        E, H, T, topk = cfg["E"], cfg["H"], cfg["T"], cfg["topk"]
        L = E // W
        peer, ref = _buffers(E, H, T, fp8=fp8_only)
        for seed in (1, 2):
            for kind in KINDS:
                for rs in (False, True):
                    what = f"fp8 seed={seed} kind={kind} round_scale={rs} cfg={cfg}"
                    xs, topks, ws, (x, idx, w) = _case(rank, W, E, H, T, topk, seed, kind)
                    poison = (torch.full((L, W * T, H), 0x7F, dtype=torch.uint8, device="cuda")
                              .view(torch.float8_e4m3fn), _poisoned((L, W * T, H // 128),
                                                                    torch.float32))
                    (q, sc), rc, h = peer.dispatch(x, idx, use_fp8=True, round_scale=rs,
                                                   out=poison)
                    (wq, wsc), wc, wh = ref.dispatch(x, idx, use_fp8=True, round_scale=rs)
                    assert torch.equal(rc, wc), what
                    for e, c in enumerate(wc.tolist()):
                        assert torch.equal(_bits(q[e, :c]), _bits(wq[e, :c])), (what, e)
                        assert torch.equal(_bits(sc[e, :c]), _bits(wsc[e, :c])), (what, e)
                        assert torch.equal(h.src_info[e, :c], wh.src_info[e, :c]), (what, e)
                    from llcomm.runtime.fp8_format import dequantize
                    eo = _experts(dequantize(wq, wsc), rank)
                    y = peer.combine(eo, idx, w, h)
                    assert torch.equal(_bits(y), _bits(ref.combine(eo, idx, w, wh))), what
        if not fp8_only:    # bf16 dispatches on the same buffer still match
            _one_round(peer, ref, rank, W, cfg, 77, "random")
        peer.check()
        peer.close()


def test_fp8_dispatch_matches_reference():
    run_distributed(_fp8_body, 2, backend="nccl", timeout=600)


def _hook_body(rank, W):
    """return_recv_hook: the send half, unrelated GPU work, then the hook; results byte / bit
    equal to the reference, eagerly, for bf16 and FP8, and inside a captured CUDA graph."""
    from llcomm.runtime.fp8_format import dequantize
    cfg = SMALL
    E, H, T, topk = cfg["E"], cfg["H"], cfg["T"], cfg["topk"]
    peer, ref = _buffers(E, H, T)
    busy = torch.randn(2048, 2048, device="cuda")
    for seed in (1, 2, 3):
        for kind in KINDS:
            for fp8 in (False, True):
                what = f"hook seed={seed} kind={kind} fp8={fp8}"
                xs, topks, ws, (x, idx, w) = _case(rank, W, E, H, T, topk, seed, kind)
                rx, rc, h, hook = peer.dispatch(x, idx, use_fp8=fp8, return_recv_hook=True)
                busy = busy @ busy / 2048          # overlapped work on the same stream
                hook()
                want = ref.dispatch(x, idx, use_fp8=fp8)
                got_x = rx if fp8 else (rx,)
                want_x = want[0] if fp8 else (want[0],)
                assert torch.equal(rc, want[1]), what
                for e, c in enumerate(want[1].tolist()):
                    for a, b in zip(got_x, want_x):
                        assert torch.equal(_bits(a[e, :c]), _bits(b[e, :c])), (what, e)
                    assert torch.equal(h.src_info[e, :c], want[2].src_info[e, :c]), (what, e)
                rows = dequantize(*want_x) if fp8 else want_x[0]
                eo = _experts(rows, rank)
                y, chook = peer.combine(eo, idx, w, h, return_recv_hook=True)
                busy = busy @ busy / 2048
                chook()
                assert torch.equal(_bits(y), _bits(ref.combine(eo, idx, w, want[2]))), what
    # graph: send halves and hooks captured together, replayed with fresh inputs
    sx, sidx, sw, srecv, sy = _statics(T - 2 * rank, E, H, T, topk, W)

    def step():
        rx, rc, h, hook = peer.dispatch(sx, sidx, out=srecv, return_recv_hook=True)
        hook()
        y, chook = peer.combine(_experts(rx, rank), sidx, sw, h, out=sy, return_recv_hook=True)
        chook()

    g = capture(step, 1)
    for i in range(10):
        _fill_static(rank, W, cfg, 300 + i, KINDS[i % len(KINDS)], sx, sidx, sw)
        g.replay()
        wx, wc, wh = ref.dispatch(sx, sidx)
        assert torch.equal(_bits(sy), _bits(ref.combine(_experts(wx, rank), sidx, sw, wh))), i
    peer.check()
    peer.close()


def test_recv_hook_matches_reference():
    run_distributed(_hook_body, 2, backend="nccl", timeout=600)
