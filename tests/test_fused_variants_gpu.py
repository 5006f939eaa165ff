"""GPU tests of ``all_reduce_rmsnorm``, ``all_reduce_residual_rmsnorm_fp8`` and
``all_reduce_residual_rmsnorm_fp8_per_group`` on the peer backend (2 GPUs, NCCL group).

Against the same communicator's other ops and the fp32 oracle of ``tests/_norm_oracle.py``:
``residual_out`` bit for bit ``all_reduce`` (+ residual); the no-residual ``out`` bit for bit
``all_reduce_residual_rmsnorm`` with a zero residual, and within tolerance of torch's RMSNorm;
FP8 codes and scales byte for byte the oracle's (and ``llcomm.runtime.fp8_format``'s) quantisation
of the ``y`` that ``all_reduce_residual_rmsnorm`` returns for the same inputs, and within one e4m3
step of the unfused torch sequence (llcomm all_reduce + torch add + RMSNorm + quantisation).
Every output bitwise equal across ranks. Fresh random inputs per case, outputs poisoned first,
both algorithms, CUDA-graph capture and replay with a new static scale value each replay, ranks
that call different variants, and a peer that never arrives. Run on a 2-GPU host:
``python -m pytest -m gpu -q tests/test_fused_variants_gpu.py``.
"""

import pytest
import torch
import torch.distributed as dist

import _norm_oracle as O
from _dist import absent_peer_error, run_distributed
from llcomm.bench.timing import capture
# the plain fused join's GPU tests share their cases and helpers
from test_fused_gpu import DTYPES, EPS, LAMPORT_MAX, TOKENS, TOL, _case, _comm, _rms_norm

pytestmark = pytest.mark.gpu

HIDDENS = (7168, 8192, 4099)   # DeepSeek-V3, Llama-70B, an odd row (no FP8 groups there)
NAN8 = 0x7F


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _same_bits(a, b):
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _same_on_all_ranks(t):
    b = _bits(t)        # the bytes: a collective need not know float8
    got = [torch.empty_like(b) for _ in range(dist.get_world_size())]
    dist.all_gather(got, b)
    return all(torch.equal(g, got[0]) for g in got)


def _poison8(shape):
    return torch.full(shape, NAN8, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)


def _nan(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _unfused_y(comm, x, res, w, algo):
    """llcomm all_reduce, torch add, torch RMSNorm: the sequence the fused ops replace."""
    h = comm.all_reduce(x, algo=algo) + res
    return _rms_norm(h, w, EPS), h


def _check_static(q, yp, y_unfused, scale, case):
    from llcomm.runtime import fp8_format as F8
    codes = q.view(torch.uint8).cpu()
    assert torch.equal(codes, O.static_codes(yp.cpu(), scale.cpu())), f"{case}: codes != oracle"
    assert torch.equal(codes, F8.quantize_static(yp, scale).view(torch.uint8).cpu()), \
        f"{case}: codes != llcomm.runtime.fp8_format.quantize_static of y"
    unfused = (y_unfused.float() * (1 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert int(O.step_distance(codes, unfused.view(torch.uint8).cpu()).max()) <= 1, \
        f"{case}: more than one e4m3 step from the unfused sequence"


def _check_group(q, s, yp, y_unfused, round_scale, case):
    from llcomm.runtime import fp8_format as F8
    want_q, want_s = O.group_codes(yp.cpu(), round_scale)
    assert torch.equal(s.cpu(), want_s), f"{case}: scales != oracle"
    assert torch.equal(q.view(torch.uint8).cpu(), want_q), f"{case}: codes != oracle"
    lq, ls = F8.quantize(yp, round_scale)
    assert _same_bits(q, lq) and _same_bits(s, ls), \
        f"{case}: != llcomm.runtime.fp8_format.quantize of y"
    if not round_scale:
        uq, us = O.group_codes(y_unfused.cpu())
        assert ((s.cpu() - us).abs() <= 2.0 ** -5 * us).all(), f"{case}: scales off the unfused"
        assert int(O.step_distance(q.view(torch.uint8).cpu(), uq).max()) <= 1, \
            f"{case}: more than one e4m3 step from the unfused sequence"


def _sweep_body(rank, ws):
    comm = _comm()
    seed = 0
    for dtype in DTYPES:
        for hidden in HIDDENS:
            for tokens in TOKENS:
                nbytes = tokens * hidden * dtype.itemsize
                algos = ["auto", "one_shot"] + (["lamport"] if nbytes <= LAMPORT_MAX else [])
                plain = "lamport" if nbytes <= LAMPORT_MAX else "one_shot"
                for algo in algos:
                    seed += 1
                    case = f"[{str(dtype)[6:]} {tokens}x{hidden} {algo}]"
                    shape = (tokens, hidden)
                    x, res, w = _case(tokens, hidden, dtype, seed, rank)
                    x0, res0 = x.clone(), res.clone()
                    yp, hp = comm.all_reduce_residual_rmsnorm(x, res, w, EPS, algo=algo)
                    y_unfused, h_unfused = _unfused_y(comm, x, res, w, plain)
                    assert _same_bits(hp, h_unfused), f"{case}: residual_out != all_reduce + add"

                    # no residual
                    y0, h0 = _nan(shape, dtype), _nan(shape, dtype)
                    comm.all_reduce_rmsnorm(x, w, EPS, out=y0, residual_out=h0, algo=algo)
                    assert _same_bits(h0, comm.all_reduce(x, algo=plain)), \
                        f"{case}: rmsnorm residual_out != all_reduce"
                    yz, _ = comm.all_reduce_residual_rmsnorm(x, torch.zeros_like(x), w, EPS,
                                                             algo=algo)
                    assert _same_bits(y0, yz), f"{case}: rmsnorm != a zero residual"
                    torch.testing.assert_close(y0, _rms_norm(h0, w, EPS), rtol=TOL[dtype],
                                               atol=TOL[dtype], msg=lambda m: f"{case}: {m}")
                    for t in (y0, h0):
                        assert _same_on_all_ranks(t), f"{case}: rmsnorm ranks differ"

                    # static FP8
                    scale = O.telling_scale(yp.cpu()).cuda()
                    q, h8 = _poison8(shape), _nan(shape, dtype)
                    comm.all_reduce_residual_rmsnorm_fp8(x, res, w, EPS, scale=scale, out=q,
                                                         residual_out=h8, algo=algo)
                    assert _same_bits(h8, hp), f"{case}: fp8 residual_out"
                    _check_static(q, yp, y_unfused, scale, case + " fp8")
                    for t in (q, h8):
                        assert _same_on_all_ranks(t), f"{case}: fp8 ranks differ"
                    # in place: the residual stream updated where it lies
                    r2 = res.clone()
                    q2, _ = comm.all_reduce_residual_rmsnorm_fp8(x, r2, w, EPS, scale=scale,
                                                                 residual_out=r2, algo=algo)
                    assert _same_bits(r2, hp) and _same_bits(q2, q), f"{case}: fp8 in place"

                    if hidden % O.GROUP == 0:
                        for round_scale in (False, True):
                            c = f"{case} per group round_scale={round_scale}"
                            qg, sg = _poison8(shape), _nan((tokens, hidden // O.GROUP))
                            hg = _nan(shape, dtype)
                            comm.all_reduce_residual_rmsnorm_fp8_per_group(
                                x, res, w, EPS, round_scale=round_scale, out=qg, scales_out=sg,
                                residual_out=hg, algo=algo)
                            assert _same_bits(hg, hp), f"{c}: residual_out"
                            _check_group(qg, sg, yp, y_unfused, round_scale, c)
                            for t in (qg, sg, hg):
                                assert _same_on_all_ranks(t), f"{c}: ranks differ"
                    assert torch.equal(x, x0) and torch.equal(res, res0), f"{case}: input changed"
    comm.check()
    comm.close()


def test_variants_match_oracle_and_ranks_agree():
    run_distributed(_sweep_body, 2, backend="nccl", timeout=600)


REPLAYS = 30


def _graph_body(rank, ws):
    """The three joins (auto, and one_shot) and a plain all_reduce captured in one graph; each
    replay with new inputs and a new static scale value (the kernel reads it at every call)."""
    comm = _comm()
    dtype = torch.bfloat16
    shapes = {"small": (7, 7168), "big": (128, 7168)}  # lamport and one-shot under auto
    static = {k: tuple(torch.zeros(s, dtype=dtype, device="cuda") for _ in range(2))
              for k, s in shapes.items()}
    weight = torch.zeros(7168, dtype=dtype, device="cuda")
    scale = torch.ones((), device="cuda")
    outs = {}

    def ops():
        for k, (x, res) in static.items():
            outs[k + "/ar"] = comm.all_reduce(x)
            for algo in ("auto", "one_shot"):
                outs[f"{k}/rmsnorm/{algo}"] = comm.all_reduce_rmsnorm(x, weight, EPS, algo=algo)
                outs[f"{k}/fp8/{algo}"] = comm.all_reduce_residual_rmsnorm_fp8(
                    x, res, weight, EPS, scale=scale, algo=algo)
                outs[f"{k}/group/{algo}"] = comm.all_reduce_residual_rmsnorm_fp8_per_group(
                    x, res, weight, EPS, algo=algo)

    g = capture(ops, 1)                 # compiles outside the capture
    for i in range(REPLAYS):
        cases = {k: _case(*shapes[k], dtype, 20_000 + 2 * i + j, rank)
                 for j, k in enumerate(shapes)}
        weight.copy_(cases["big"][2])
        for k, (x, res, _) in cases.items():
            static[k][0].copy_(x)
            static[k][1].copy_(res)
        yp_big, _ = comm.all_reduce_residual_rmsnorm(cases["big"][0], cases["big"][1], weight,
                                                     EPS)
        scale.copy_(O.telling_scale(yp_big.cpu()))
        for o in outs.values():
            for t in (o if isinstance(o, tuple) else (o,)):
                t.view(torch.uint8).fill_(0xFF)  # poison: NaN patterns
        g.replay()
        for k, (x, res, _) in cases.items():
            case = f"[replay {i} {k}]"
            yp, hp = comm.all_reduce_residual_rmsnorm(x, res, weight, EPS)   # eager, in between
            y_unfused, _ = _unfused_y(comm, x, res, weight, "auto")
            yz, hz = comm.all_reduce_residual_rmsnorm(x, torch.zeros_like(x), weight, EPS)
            for algo in ("auto", "one_shot"):
                y0, h0 = outs[f"{k}/rmsnorm/{algo}"]
                assert _same_bits(y0, yz) and _same_bits(h0, hz), f"{case} rmsnorm {algo}"
                q, h8 = outs[f"{k}/fp8/{algo}"]
                assert _same_bits(h8, hp), f"{case} fp8 {algo}"
                _check_static(q, yp, y_unfused, scale, f"{case} fp8 {algo}")
                qg, sg, hg = outs[f"{k}/group/{algo}"]
                assert _same_bits(hg, hp), f"{case} group {algo}"
                _check_group(qg, sg, yp, y_unfused, False, f"{case} group {algo}")
            assert _same_bits(outs[k + "/ar"], comm.all_reduce(x)), case
    comm.check()
    comm.close()


def test_graph_replay_reads_the_scale_each_time():
    run_distributed(_graph_body, 2, backend="nccl", timeout=300)


TIMEOUT_MS = 200
VARIANT_CALLS = {
    "all_reduce_rmsnorm": lambda c, x, res, w, algo: c.all_reduce_rmsnorm(x, w, algo=algo),
    "all_reduce_residual_rmsnorm_fp8": lambda c, x, res, w, algo:
        c.all_reduce_residual_rmsnorm_fp8(x, res, w, scale=torch.ones((), device="cuda"),
                                          algo=algo),
    "all_reduce_residual_rmsnorm_fp8_per_group": lambda c, x, res, w, algo:
        c.all_reduce_residual_rmsnorm_fp8_per_group(x, res, w, algo=algo),
    "all_reduce_residual_rmsnorm": lambda c, x, res, w, algo:
        c.all_reduce_residual_rmsnorm(x, res, w, algo=algo),
}


def _timeout_body(rank, ws, variant, algo):
    import llcomm
    comm = _comm(timeout_ms=TIMEOUT_MS)
    x, res, w = _case(4, 7168, torch.bfloat16, 1, rank)
    call = VARIANT_CALLS[variant]
    err = absent_peer_error(rank, lambda: call(comm, x, res, w, algo), comm.check, TIMEOUT_MS)
    if err is None:
        return None
    assert err.op == f"{variant}({algo})", err
    with pytest.raises(llcomm.CommBrokenError):
        call(comm, x, res, w, algo)
    return str(err)


@pytest.mark.parametrize("algo", ["lamport", "one_shot"])
@pytest.mark.parametrize("variant", ["all_reduce_rmsnorm", "all_reduce_residual_rmsnorm_fp8",
                                     "all_reduce_residual_rmsnorm_fp8_per_group"])
def test_missing_peer_times_out(variant, algo):
    msgs = run_distributed(_timeout_body, 2, variant, algo, backend="nccl")
    assert "did not arrive" in msgs[0]


def _mismatch_body(rank, ws, variant, algo):
    """Rank 0 calls all_reduce_residual_rmsnorm, rank 1 ``variant``, same shape and dtype."""
    import llcomm
    comm = _comm(timeout_ms=TIMEOUT_MS)
    x, res, w = _case(4, 7168, torch.bfloat16, 2, rank)
    mine = VARIANT_CALLS["all_reduce_residual_rmsnorm" if rank == 0 else variant]
    # both kernels compiled first, in matched rounds (a first launch waits up to 60 s)
    for name in ("all_reduce_residual_rmsnorm", variant):
        VARIANT_CALLS[name](comm, x, res, w, algo)
    comm.check()
    dist.barrier()
    try:
        mine(comm, x, res, w, algo)
        comm.check()
    except (llcomm.CommMismatchError, llcomm.CommTimeoutError) as e:
        outcome = type(e).__name__
    else:
        outcome = "returned a result"
    dist.barrier()
    return outcome


@pytest.mark.parametrize("algo", ["lamport", "one_shot"])
@pytest.mark.parametrize("variant", ["all_reduce_rmsnorm", "all_reduce_residual_rmsnorm_fp8",
                                     "all_reduce_residual_rmsnorm_fp8_per_group"])
def test_different_variants_are_a_mismatch(variant, algo):
    """Lamport: both ranks see the other's tag and report a mismatch; one-shot: at least one
    (the entry flags carry the op code; a rank may time out instead)."""
    outcomes = run_distributed(_mismatch_body, 2, variant, algo, backend="nccl")
    if algo == "lamport":
        assert outcomes == ["CommMismatchError"] * 2, outcomes
    else:
        assert "CommMismatchError" in outcomes and "returned a result" not in outcomes, outcomes
