"""The fused joins' part of ``llcomm check``: ``all_reduce_residual_rmsnorm`` (with
``residual_out``), ``all_reduce_rmsnorm``, ``all_reduce_residual_rmsnorm_fp8`` (a static scale)
and ``all_reduce_residual_rmsnorm_fp8_per_group`` (with and without ``round_scale``), every
algorithm, a few shapes, every dtype ``check`` runs.

The oracle is the documented arithmetic in torch, on inputs every rank rebuilds from the seed:
``h`` the fp32 rank-order sum rounded once, plus the residual in fp32, rounded; ``y`` the float64
RMSNorm of the rounded ``h``; FP8 codes by torch's own e4m3 cast. What is checked is what the
docs promise (docs/design.md, "Fused all-reduce + residual + RMSNorm", and the methods' docs):

- ``residual_out``: ``h`` bit for bit on the peer backend, within the summation bound on the
  reference backend;
- ``out`` of the plain joins: within one step of the dtype (plus fp32 noise) of the norm of
  ``h``; ``all_reduce_rmsnorm``'s bit for bit the residual join's with a zero residual (peer);
- FP8 codes (and per-group scales): byte for byte the quantisation of the ``y`` that
  ``all_reduce_residual_rmsnorm`` returns for the same inputs, that ``y`` itself held to the
  norm's bound above;
- on the peer backend every rank holds the same bytes.

Even token rows are scaled down so that ``eps`` weighs in their norm.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..bench import verify

#: (tokens, hidden): one token at DeepSeek-V3's hidden and a few at another. Every hidden a
#: multiple of 128.
SHAPES = ((1, 7168), (5, 4096))
#: The peer backend also runs one past 1 MiB of bf16, where its "auto" switches from Lamport to
#: one-shot (the reference backend has one algorithm, and this size would slow the CPU check).
PEER_SHAPES = SHAPES + ((96, 8192),)
FUSED_ALGOS = ("one_shot", "lamport")
EPS = 1e-5
#: Even rows are scaled by this (exact in every dtype): their mean square is then of the order
#: of EPS, so a norm that mishandles eps is caught.
SMALL_ROW = 2.0 ** -8
#: The static FP8 scale saturates the largest values (their |y| / scale over 448 by this factor
#: at least); failing the search in ``telling_scale``, it is the norm's amax / 512.
SATURATION = 1.01
FALLBACK_SCALE_DIVISOR = 512.0
#: Elements of y that ``telling_scale`` searches, and candidate scales tried at once.
SCALE_SEARCH_ELEMS, SCALE_SEARCH_CHUNK = 256, 2048
FP8_MAX = 448.0
FP8_GROUP = 128
FP8_DTYPE = torch.float8_e4m3fn
#: The code of +448, the largest finite e4m3 value.
FP8_MAX_CODE = 0x7E
#: A NaN in float8_e4m3fn.
FP8_NAN = 0x7F
#: ``out`` may be this many steps of its dtype (relative) off the float64 norm: it is rounded
#: once (half a step), where torch's rms_norm rounds twice.
NORM_STEPS = 0.5
#: Relative slack for the fp32 arithmetic (mean square, rsqrt, products) before that rounding.
FP32_SLACK = 1e-5
SMALLEST_NORMAL_SCALE = 2.0 ** -126


class FusedCase(NamedTuple):
    """One check: ``fn`` runs the join into preallocated outputs, ``reset`` poisons them,
    ``wrong()`` counts wrong elements on this rank, ``same`` must hold the same bytes on every
    rank (empty when the backend does not promise it)."""
    label: str
    shape: str
    fn: Callable[[], object]
    reset: Callable[[], None]
    wrong: Callable[[], int]
    same: list


def max_bytes(dtypes) -> int:
    """The largest ``x`` of these checks, in bytes."""
    return max(t * h for t, h in PEER_SHAPES) * max(d.itemsize for d in dtypes)


def norm64(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    hd = h.double()
    return hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def wrong_norm(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> int:
    """Elements of ``y`` more than half a step of y's dtype (one rounding, plus fp32 noise) off
    the float64 norm of ``h``."""
    want = norm64(h, w)
    fi = torch.finfo(y.dtype)
    return verify.count_wrong(y, want, (NORM_STEPS * fi.eps + FP32_SLACK) * want.abs() + fi.tiny)


def codes_static(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of ``float(y) * (1 / scale)``, the reciprocal one fp32 division, saturated
    (``scale`` one element, or one per row of a 2-D ``y``)."""
    s = scale.float() if scale.dim() == 2 else scale.reshape(()).float()
    inv = torch.ones_like(s) / s
    return (y.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def telling_scale(y: torch.Tensor) -> torch.Tensor:
    """A static scale (fp32, shape (1,), on y's device) at which the largest |y| saturate and
    some element's code by ``y * (1 / scale)`` differs from its code by ``y / scale``, so the
    check tells the documented multiplication from a division: found among the scales that put
    some ``|y[i]|`` on a midpoint between two e4m3 values, where the two roundings part."""
    yf = y.float().cpu().reshape(-1)
    big = float(yf.abs().max())
    vals = torch.arange(FP8_MAX_CODE + 1, dtype=torch.uint8, device="cpu").view(FP8_DTYPE).float()
    mids = ((vals[1:] + vals[:-1]) / 2)
    mids = mids[(mids > 1) & (mids < FP8_MAX)]
    sample = yf[yf != 0][:SCALE_SEARCH_ELEMS]
    cands = (sample.abs()[:, None] / mids[None, :]).reshape(-1)
    cands = cands[big / cands > FP8_MAX * SATURATION]
    for c in cands.split(SCALE_SEARCH_CHUNK):
        by_mul = codes_static(sample[None, :], c[:, None])
        by_div = (sample[None, :] / c[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        differ = (by_mul.view(torch.uint8) != by_div.view(torch.uint8)).any(1)
        if differ.any():
            return c[differ][:1].to(y.device)
    return torch.tensor([big / FALLBACK_SCALE_DIVISOR], dtype=torch.float32, device=y.device)


def pow2_up(s: torch.Tensor) -> torch.Tensor:
    """fp32 ``s`` > 0 up to a power of two (at least the smallest normal), by frexp."""
    m, _ = torch.frexp(s)                       # s = m * 2**e, m in [0.5, 1)
    p = torch.where(m == 0.5, s, s / m)         # s / m = 2**e exactly (an IEEE division)
    return p.clamp(min=SMALLEST_NORMAL_SCALE)


def codes_group(y: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scales) per 128 channels: scale = amax / 448 (1 for an all-zero
    group, optionally up to a power of two), codes of ``float(y) / scale`` (IEEE division)."""
    t, hidden = y.shape
    yf = y.float().view(t, hidden // FP8_GROUP, FP8_GROUP)
    amax = yf.abs().amax(-1)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX))
    if round_scale:
        scale = pow2_up(scale)
    codes = (yf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(t, hidden).to(FP8_DTYPE)
    return codes, scale


def _inputs(world: int, tokens: int, hidden: int, dtype, device, seed: int):
    """(every rank's x ``[world, tokens, hidden]``, residual, weight): residual and weight are
    the same on every rank, as in tensor parallelism."""
    rows = torch.ones(tokens, dtype=torch.float32, device=device)
    rows[::2] = SMALL_ROW
    rows = rows.to(dtype).view(tokens, 1)
    n = tokens * hidden
    xs = verify.all_inputs(world, n, dtype, device, seed).view(world, tokens, hidden) * rows
    res = verify.all_inputs(1, n, dtype, device, seed + 1).view(tokens, hidden) * rows
    w = verify.all_inputs(1, hidden, dtype, device, seed + 2)[0].abs() + 0.5
    return xs, res, w


def _poison8(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(FP8_NAN)


def cases(comm, rank: int, world: int, dtype, device, seed: int, exact: bool):
    """Every ``FusedCase`` at ``dtype``: per shape and algorithm, each join and variant."""
    for si, (tokens, hidden) in enumerate(PEER_SHAPES if comm.backend == "peer" else SHAPES):
        xs, res, w = _inputs(world, tokens, hidden, dtype, device, seed + 10 * si)
        x = xs[rank].clone()
        nbytes = x.numel() * x.element_size()
        algos = ["auto"]
        if comm.backend == "peer":
            algos += [a for a in FUSED_ALGOS if a != "lamport" or nbytes <= comm.lamport_bytes]
        s = verify.rank_order_sum(xs, dtype)
        with_res = (s.float() + res.float()).to(dtype)
        bound_s = None if exact else verify.sum_bound(xs, dtype)
        bound_res = None if exact else verify.sum_bound(torch.cat([xs, res[None]]), dtype)
        scale = telling_scale(norm64(with_res, w).to(dtype))
        for algo in algos:
            yield from _joins(comm, x, res, w, scale, s, bound_s, with_res, bound_res, algo,
                              f"{tokens}x{hidden}", exact)


def _joins(comm, x, res, w, scale, s, bound_s, h_want, bound_h, algo, shape, exact):
    """The cases of one shape and algorithm (``s``: the rounded sum, ``h_want``: plus the
    residual, rounded; their bounds None on the peer backend: bit for bit)."""
    y, h = torch.empty_like(x), torch.empty_like(x)
    q = torch.empty_like(x, dtype=FP8_DTYPE)
    scales = torch.empty(x.shape[0], x.shape[1] // FP8_GROUP, dtype=torch.float32,
                         device=x.device)
    y_ref, h_ref = torch.empty_like(x), torch.empty_like(x)
    zeros = torch.zeros_like(x)

    def reset():
        for t in (y, h, scales, y_ref, h_ref):
            verify.poison_(t)
        _poison8(q)

    def wrong_h(want, bound) -> int:
        return verify.count_wrong(h, want, bound)

    # The norm reads the rounded h: the oracle's on the peer backend (where h must be it), the
    # returned one on the reference backend (whose sum order is NCCL's or gloo's).
    def plain_y() -> int:
        """Run the plain join into (y_ref, h_ref) eagerly; the wrong elements of that y."""
        comm.all_reduce_residual_rmsnorm(x, res, w, EPS, out=y_ref, residual_out=h_ref,
                                         algo=algo)
        return wrong_norm(y_ref, h_want if exact else h_ref, w)

    def plain_wrong() -> int:
        return wrong_h(h_want, bound_h) + wrong_norm(y, h_want if exact else h, w)

    def norm_only_wrong() -> int:
        n = wrong_h(s, bound_s) + wrong_norm(y, s if exact else h, w)
        if exact:   # documented: bit for bit the residual join with a zero residual
            comm.all_reduce_residual_rmsnorm(x, zeros, w, EPS, out=y_ref, residual_out=h_ref,
                                             algo=algo)
            n += verify.count_wrong(y, y_ref)
        return n

    def static_wrong() -> int:
        n = wrong_h(h_want, bound_h) + plain_y()
        return n + verify.count_wrong(q, codes_static(y_ref, scale))

    def group_wrong(round_scale: bool) -> int:
        n = wrong_h(h_want, bound_h) + plain_y()
        want_q, want_s = codes_group(y_ref, round_scale)
        return n + verify.count_wrong(q, want_q) + verify.count_wrong(scales, want_s)

    def same(*ts):
        return list(ts) if exact else []

    yield FusedCase(f"all_reduce_residual_rmsnorm[{algo}]", shape,
                    lambda: comm.all_reduce_residual_rmsnorm(x, res, w, EPS, out=y,
                                                             residual_out=h, algo=algo),
                    reset, plain_wrong, same(y))
    yield FusedCase(f"all_reduce_rmsnorm[{algo}]", shape,
                    lambda: comm.all_reduce_rmsnorm(x, w, EPS, out=y, residual_out=h, algo=algo),
                    reset, norm_only_wrong, same(y))
    yield FusedCase(f"all_reduce_residual_rmsnorm_fp8[{algo}]", shape,
                    lambda: comm.all_reduce_residual_rmsnorm_fp8(
                        x, res, w, EPS, scale=scale, out=q, residual_out=h, algo=algo),
                    reset, static_wrong, same(q))
    for rs in (False, True):
        yield FusedCase(f"all_reduce_residual_rmsnorm_fp8_per_group[{algo}]"
                        + " round_scale" * rs, shape,
                        lambda rs=rs: comm.all_reduce_residual_rmsnorm_fp8_per_group(
                            x, res, w, EPS, round_scale=rs, out=q, scales_out=scales,
                            residual_out=h, algo=algo),
                        reset, lambda rs=rs: group_wrong(rs), same(q, scales))
