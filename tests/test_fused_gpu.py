"""GPU tests of ``all_reduce_residual_rmsnorm`` on the peer backend (2 GPUs, NCCL group).

Against the unfused sequence on the same communicator (llcomm ``all_reduce`` + torch add +
RMSNorm): ``residual_out`` bit for bit (the fused kernel rounds the sum, then the sum plus the
residual, exactly as the unfused ops do), ``out`` within bf16 / fp16 / fp32 tolerance of torch's
RMSNorm and within one rounding of the fp32 norm of ``residual_out``. Both outputs bitwise equal
across ranks. Fresh random inputs per case, outputs poisoned first, plain all_reduce calls of every
algorithm interleaved (they share halves and op counters), CUDA-graph capture and replay, and a
peer that never arrives. Run on a 2-GPU host:
``python -m pytest -m gpu -q tests/test_fused_gpu.py``.
"""

import pytest
import torch
import torch.distributed as dist

from _dist import absent_peer_error, run_distributed
from llcomm.bench.timing import capture

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOKENS = (1, 7, 64, 128)
HIDDENS = (8192, 4099)  # a model's hidden and an odd one (rows not 16-byte aligned)
MAX_BYTES = 4 << 20     # 128 x 8192 fp32
LAMPORT_MAX = 1 << 20
EPS = 1e-6
#: Tolerance of ``out`` against torch's RMSNorm (which rounds before the weight multiply).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _comm(**kw):
    import llcomm
    return llcomm.Communicator(max_bytes=kw.pop("max_bytes", MAX_BYTES), backend="peer", **kw)


def _rand(shape, dtype, seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _case(tokens, hidden, dtype, seed, rank):
    """This rank's x; residual and weight shared by every rank (same seed)."""
    x = _rand((tokens, hidden), dtype, seed * 1009 + rank)
    res = _rand((tokens, hidden), dtype, seed * 1009 + 997)
    w = (_rand((hidden,), dtype, seed * 1009 + 998).abs() + 0.5).to(dtype)
    return x, res, w


def _rms_norm(h, w, eps):
    fn = getattr(torch.nn.functional, "rms_norm", None)
    if fn is not None:
        return fn(h, (h.shape[-1],), w, eps)
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * w


def _unfused(comm, x, res, w, algo):
    """The sequence the fused op replaces: llcomm all_reduce, torch add, torch RMSNorm."""
    ar = comm.all_reduce(x, algo=algo)
    h = ar + res
    return _rms_norm(h, w, EPS), h


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _same_on_all_ranks(t):
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(_bits(g), _bits(got[0])) for g in got)


def _check(y, h, x, res, w, comm, plain_algo, case):
    y_ref, h_ref = _unfused(comm, x, res, w, plain_algo)
    assert torch.equal(_bits(h), _bits(h_ref)), \
        f"{case}: residual_out differs from all_reduce + add"
    tol = TOL[y.dtype]
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol, msg=lambda m: f"{case}: {m}")
    hf = h.double()
    exact = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    fi = torch.finfo(y.dtype)
    assert ((y.double() - exact).abs() <= fi.eps * exact.abs() + 1e-5 * exact.abs()
            + fi.tiny).all(), f"{case}: out is not the fp32 norm of residual_out rounded once"
    assert _same_on_all_ranks(y) and _same_on_all_ranks(h), f"{case}: ranks differ"


def _sweep_body(rank, ws):
    comm = _comm()
    seed = 0
    for dtype in DTYPES:
        for hidden in HIDDENS:
            for tokens in TOKENS:
                nbytes = tokens * hidden * torch.empty(0, dtype=dtype).element_size()
                algos = ["auto", "one_shot"] + (["lamport"] if nbytes <= LAMPORT_MAX else [])
                for algo in algos:
                    seed += 1
                    case = f"[{str(dtype)[6:]} {tokens}x{hidden} {algo}]"
                    x, res, w = _case(tokens, hidden, dtype, seed, rank)
                    x0, res0 = x.clone(), res.clone()
                    y = torch.full_like(x, float("nan"))
                    h = torch.full_like(x, float("nan"))
                    comm.all_reduce_residual_rmsnorm(x, res, w, EPS, out=y, residual_out=h,
                                                     algo=algo)
                    assert torch.equal(x, x0) and torch.equal(res, res0), f"{case}: input changed"
                    # the plain all_reduce in the check alternates with the fused calls
                    plain = "lamport" if nbytes <= LAMPORT_MAX else "one_shot"
                    _check(y, h, x, res, w, comm, plain, case)
                    # in place: norm over x, residual stream updated where it lies
                    comm.all_reduce_residual_rmsnorm(x, res, w, EPS, out=x, residual_out=res,
                                                     algo=algo)
                    assert torch.equal(_bits(x), _bits(y)) and torch.equal(_bits(res), _bits(h)), \
                        f"{case}: in place differs"
    comm.check()
    comm.close()


def test_fused_matches_unfused_and_ranks_agree():
    run_distributed(_sweep_body, 2, backend="nccl", timeout=600)


REPLAYS = 50


def _graph_body(rank, ws):
    comm = _comm()
    dtype = torch.bfloat16
    shapes = {"small": (7, 8192), "big": (128, 8192)}  # lamport and one-shot under auto
    static = {k: tuple(torch.zeros(s, dtype=dtype, device="cuda") for _ in range(2))
              for k, s in shapes.items()}
    weight = torch.zeros(8192, dtype=dtype, device="cuda")
    outs = {}

    def ops():
        for k, (x, res) in static.items():
            outs[k + "/ar"] = comm.all_reduce(x, algo="auto")
            outs[k] = comm.all_reduce_residual_rmsnorm(x, res, weight, EPS)
            outs[k + "/one_shot"] = comm.all_reduce_residual_rmsnorm(x, res, weight, EPS,
                                                                     algo="one_shot")

    g = capture(ops, 1)                 # compiles outside the capture
    for i in range(REPLAYS):
        cases = {k: _case(*shapes[k], dtype, 10_000 + 2 * i + j, rank)
                 for j, k in enumerate(shapes)}
        weight.copy_(cases["big"][2])
        for k, (x, res, _) in cases.items():
            static[k][0].copy_(x)
            static[k][1].copy_(res)
        for o in outs.values():
            for t in (o if isinstance(o, tuple) else (o,)):
                t.view(torch.uint8).fill_(0xFF)  # poison: NaN patterns
        g.replay()
        for k, (x, res, _) in cases.items():
            case = f"[replay {i} {k}]"
            for key in (k, k + "/one_shot"):
                y, h = outs[key]
                _check(y, h, x, res, weight, comm, "auto", case + key)  # eager calls in between
            assert torch.equal(_bits(outs[k + "/ar"]), _bits(comm.all_reduce(x))), case
    comm.check()
    comm.close()


def test_graph_replay_mixed_with_all_reduce():
    run_distributed(_graph_body, 2, backend="nccl", timeout=300)


TIMEOUT_MS = 200


def _timeout_body(rank, ws, algo):
    import llcomm
    comm = _comm(timeout_ms=TIMEOUT_MS)
    x, res, w = _case(4, 8192, torch.bfloat16, 1, rank)
    err = absent_peer_error(
        rank, lambda: comm.all_reduce_residual_rmsnorm(x, res, w, algo=algo), comm.check,
        TIMEOUT_MS)
    if err is None:
        return None
    assert "rmsnorm" in err.op and algo in err.op, err
    with pytest.raises(llcomm.CommBrokenError):
        comm.all_reduce_residual_rmsnorm(x, res, w)
    return str(err)


@pytest.mark.parametrize("algo", ["lamport", "one_shot"])
def test_missing_peer_times_out(algo):
    msgs = run_distributed(_timeout_body, 2, algo, backend="nccl")
    assert "did not arrive" in msgs[0]
