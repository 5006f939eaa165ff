"""The cases of ``llcomm bench fused``: per fused op, its inputs, the fused call, the unfused
sequence it replaces (llcomm ``all_reduce`` + torch add + torch RMSNorm + torch quantisation) and
the check both must pass.

Checks (outputs poisoned before each run): ``residual_out`` the rank-order fp32 sum rounded (plus
the residual, rounded), bit for bit on the peer backend and within the summation bound on the
reference backend; ``out`` the float64 RMSNorm of the returned ``residual_out`` within two
roundings of the dtype; FP8 codes, dequantised by their scale, that float64 norm within half an
e4m3 step (2**-4 relative, ``scale * 2**-10`` absolute among the subnormals) plus those roundings,
saturated at +-448 scale; per-group scales within 2**-6 of the group's float64 amax / 448.
"""
from __future__ import annotations

import torch

from . import timing, verify
from . import tp as TP

EPS = 1e-6
#: The ops, by their Communicator method (the ``op`` of every result row).
OPS = ("all_reduce_residual_rmsnorm", "all_reduce_rmsnorm", "all_reduce_residual_rmsnorm_fp8",
       "all_reduce_residual_rmsnorm_fp8_per_group")
#: ``out`` may be off its float64 norm by this many dtype epsilons (relative): torch's RMSNorm
#: rounds before the weight multiply, the fused op once.
NORM_EPS_ALLOWED = 2
#: Relative slack for the fp32 arithmetic (mean, rsqrt) inside either implementation.
FP32_SLACK = 1e-5
FP8_MAX = 448.0
GROUP = 128
#: Half an e4m3 step, relative (3 mantissa bits), and among the subnormals in units of the scale.
E4M3_HALF_STEP = 2.0 ** -4
E4M3_SUB_HALF_STEP = 2.0 ** -10
#: Per-group scales may be off amax / 448 of the float64 norm by this much (relative): the norm
#: is rounded to the dtype before its amax is taken.
SCALE_REL_ALLOWED = 2.0 ** -6


def needs_groups(op: str) -> bool:
    return op == "all_reduce_residual_rmsnorm_fp8_per_group"


def _rms_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    fn = getattr(torch.nn.functional, "rms_norm", None)
    if fn is not None:
        return fn(h, (h.shape[-1],), w, EPS)
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype) * w


def _norm64(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    hd = h.double()
    return hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def _wrong_norm(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> int:
    want = _norm64(h, w)
    fi = torch.finfo(y.dtype)
    bound = (NORM_EPS_ALLOWED * fi.eps + FP32_SLACK) * want.abs() + fi.tiny
    return verify.count_wrong(y, want, bound)


def _wrong_fp8(q: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> int:
    """Codes ``q`` whose ``float(q) * scale`` (``scale`` broadcast over q) is not the float64
    norm of ``h`` saturated at +-448 scale, within half an e4m3 step and the dtype's roundings."""
    s = scale.double().expand(q.shape) if scale.dim() == 0 else scale.double()
    want = torch.maximum(torch.minimum(_norm64(h, w), FP8_MAX * s), -FP8_MAX * s)
    fi = torch.finfo(h.dtype)
    bound = ((E4M3_HALF_STEP + NORM_EPS_ALLOWED * fi.eps + FP32_SLACK) * want.abs()
             + E4M3_SUB_HALF_STEP * s)
    return verify.count_wrong(q.double() * s, want, bound)


def _wrong_scales(scales: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> int:
    t, hidden = h.shape
    amax = _norm64(h, w).abs().view(t, hidden // GROUP, GROUP).amax(-1)
    want = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    return verify.count_wrong(scales, want, SCALE_REL_ALLOWED * want)


def _torch_group_quant(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """The unfused per-group quantisation, in torch: scale = amax / 448 per 128 channels."""
    t, hidden = y.shape
    yf = y.float().view(t, hidden // GROUP, GROUP)
    amax = yf.abs().amax(-1)
    sc = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    s.copy_(sc)
    q.copy_((yf / sc.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(t, hidden)
            .to(torch.float8_e4m3fn))


def impls(R: TP.Rank, op: str, tokens: int, hidden: int) -> list[timing.Impl]:
    """The fused op and its unfused sequence on the same fresh inputs, each with its check."""
    comm = R.comm
    x = R.rand(tokens, hidden)
    g = torch.Generator(device=R.device)
    g.manual_seed(R.cfg.seed * 1_000_003 + 7919 * tokens + hidden)  # no rank: the same everywhere
    res = torch.randn(tokens, hidden, dtype=R.dtype, device=R.device, generator=g)
    w = torch.rand(hidden, dtype=R.dtype, device=R.device, generator=g) + 0.5
    residual = op != "all_reduce_rmsnorm"
    stack = torch.cat([verify.gather_inputs(x), res[None]]) if residual else \
        verify.gather_inputs(x)
    parts = stack[:-1] if residual else stack
    if R.exact:
        s = verify.rank_order_sum(parts, R.dtype)
        h_want, h_bound = ((s.float() + res.float()).to(R.dtype) if residual else s), None
    else:
        h_want, h_bound = stack.double().sum(0), verify.sum_bound(stack, R.dtype)
    # a static scale at which the largest values saturate: the float64 norm's amax / 512
    scale = (_norm64(h_want, w).abs().max() / 512).float().to(R.device)
    extra = {"tokens": tokens, "hidden": hidden}
    out = []
    for name in ("fused", "unfused"):
        y = torch.empty_like(x) if op in OPS[:2] else \
            torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=R.device)
        h = torch.empty_like(x)
        sc = (torch.empty(tokens, hidden // GROUP, device=R.device, dtype=torch.float32) if
              needs_groups(op) else None)
        if name == "fused":
            fn = _fused_fn(comm, op, x, res, w, scale, y, h, sc)
            impl, algo = R.llcomm_name, comm.choose_fused_algo(x.numel() * R.itemsize)
        else:
            fn = _unfused_fn(comm, op, x, res, w, scale, y, h, sc)
            impl = "unfused"
            algo = (comm.choose_algo(x.numel() * R.itemsize) if comm.backend == "peer"
                    else "reference")

        def reset(y=y, h=h, sc=sc):
            y.view(torch.uint8).fill_(0xFF)     # NaN in every float format
            verify.poison_(h)
            if sc is not None:
                verify.poison_(sc)

        def check(y=y, h=h, sc=sc):
            wrong = verify.count_wrong(h, h_want, h_bound)
            if op in OPS[:2]:
                return wrong + _wrong_norm(y, h, w)
            if sc is None:
                return wrong + _wrong_fp8(y.float(), scale, h, w)
            per_elem = sc.repeat_interleave(GROUP, dim=-1)
            return wrong + _wrong_scales(sc, h, w) + _wrong_fp8(y.float(), per_elem, h, w)
        out.append(timing.Impl(impl, algo, fn, reset=reset, check=check,
                               raise_errors=comm.check,
                               extra={**extra, "requested_algo": "auto",
                                      "backend": comm.backend}))
    return out


def _fused_fn(comm, op, x, res, w, scale, y, h, sc):
    if op == "all_reduce_residual_rmsnorm":
        return lambda: comm.all_reduce_residual_rmsnorm(x, res, w, EPS, out=y, residual_out=h)
    if op == "all_reduce_rmsnorm":
        return lambda: comm.all_reduce_rmsnorm(x, w, EPS, out=y, residual_out=h)
    if op == "all_reduce_residual_rmsnorm_fp8":
        return lambda: comm.all_reduce_residual_rmsnorm_fp8(x, res, w, EPS, scale=scale, out=y,
                                                             residual_out=h)
    return lambda: comm.all_reduce_residual_rmsnorm_fp8_per_group(
        x, res, w, EPS, out=y, scales_out=sc, residual_out=h)


def _unfused_fn(comm, op, x, res, w, scale, y, h, sc):
    """llcomm all_reduce, then torch: add, RMSNorm, quantisation (as an engine without the
    fused op runs them)."""
    ar = torch.empty_like(x)

    def fn():
        if op == "all_reduce_rmsnorm":
            comm.all_reduce(x, out=h)
            y.copy_(_rms_norm(h, w))
            return
        comm.all_reduce(x, out=ar)
        torch.add(ar, res, out=h)
        yn = _rms_norm(h, w)
        if op == "all_reduce_residual_rmsnorm":
            y.copy_(yn)
        elif op == "all_reduce_residual_rmsnorm_fp8":
            y.copy_((yn.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        else:
            _torch_group_quant(yn, y, sc)
    return fn
