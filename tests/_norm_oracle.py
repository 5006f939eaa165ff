"""An fp32 oracle of the fused norms, written from their documented arithmetic alone (no llcomm
code): the rank-order sum, the residual add, RMSNorm, and FP8 e4m3 codes by a table of every
e4m3 value (round to nearest even found by search, not by torch's cast or llcomm's bit tricks).

    h = round(x_0 + x_1 + ... (fp32, in rank order) [+ residual])     round: to x's dtype
    y = round(h * (1 / sqrt(mean(h * h) + eps)) * weight)             fp32
    static:    code(float(y) * (1 / scale))                           one fp32 reciprocal
    per-group: scale = amax(|y| over 128 channels) / 448 (1 if 0; optionally a power of two up),
               code(float(y) / scale)

``code`` clamps to +-448 and rounds to the nearest e4m3 value, ties to the even code.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
GROUP = 128


def _e4m3_table() -> torch.Tensor:
    """The 127 finite non-negative float8_e4m3fn values, by code (0..126), from the format's
    definition: exponent bias 7, 3 mantissa bits, subnormals at exponent field 0."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


_TABLE = _e4m3_table()
_MIDS = (_TABLE[1:] + _TABLE[:-1]) / 2


def e4m3_codes(v: torch.Tensor) -> torch.Tensor:
    """uint8 float8_e4m3fn codes of fp32 ``v`` (finite): |v| clamped to 448, the nearest table
    value, a tie going to the even code; the sign bit from v's sign (so -0.0 -> 0x80)."""
    a = v.double().abs().clamp(max=FP8_MAX).reshape(-1)
    lo = torch.searchsorted(_MIDS, a, right=False)           # first midpoint >= a
    tie = (lo < _MIDS.numel()) & (_MIDS[lo.clamp(max=_MIDS.numel() - 1)] == a)
    code = torch.where(tie & (lo % 2 == 1), lo + 1, lo)      # a tie: the even one of lo, lo + 1
    sign = torch.signbit(v.reshape(-1)).to(torch.int64) << 7
    return (code | sign).to(torch.uint8).reshape(v.shape)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of uint8 e4m3 codes (finite ones)."""
    c = codes.to(torch.int64)
    mag = _TABLE[(c & 0x7F).clamp(max=126)]
    return torch.where(c >= 128, -mag, mag)


def rank_order_sum(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        acc = acc + x.float()
    return acc.to(dtype)


def residual_out(xs, residual, dtype) -> torch.Tensor:
    """h: the rank-order sum, rounded, plus the residual in fp32, rounded (no residual: the
    rounded sum)."""
    s = rank_order_sum(xs, dtype)
    return s if residual is None else (s.float() + residual.float()).to(dtype)


def rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y in fp32 (not rounded) of the rounded h."""
    hf = h.float()
    ms = (hf * hf).sum(-1, keepdim=True) / torch.tensor(float(h.shape[-1]))
    return hf * (1.0 / torch.sqrt(ms + eps)) * weight.float()


def static_codes(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes of ``float(y) * (1 / scale)`` (the reciprocal an fp32 division, once)."""
    inv = torch.ones((), dtype=torch.float32) / scale.reshape(()).float()
    return e4m3_codes(y.float() * inv)


def pow2_up(s: torch.Tensor) -> torch.Tensor:
    """fp32 ``s`` > 0 rounded up to a power of two, at least 2**-126 (the smallest normal)."""
    m, e = torch.frexp(s.double())                            # s = m * 2**e, m in [0.5, 1)
    p = torch.where(m == 0.5, s.double(), torch.ldexp(torch.ones_like(m), e))
    return p.clamp(min=2.0 ** -126).float()


def group_codes(y: torch.Tensor, round_scale: bool = False):
    """(codes [..., H] uint8, scales [..., H // 128] fp32) of ``float(y)``."""
    yf = y.float().reshape(*y.shape[:-1], y.shape[-1] // GROUP, GROUP)
    amax = yf.abs().amax(-1)
    scale = torch.where(amax == 0, torch.ones_like(amax),
                        amax / torch.full_like(amax, FP8_MAX))
    if round_scale:
        scale = pow2_up(scale)
    return e4m3_codes(yf / scale.unsqueeze(-1)).reshape(y.shape), scale


def step_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart two uint8 code tensors are (signed codes on one line)."""
    def line(c):
        c = c.to(torch.int64)
        return torch.where(c >= 128, -(c & 0x7F), c)
    return (line(a) - line(b)).abs()


def telling_scale(y: torch.Tensor) -> torch.Tensor:
    """A static scale (fp32, 0-d) at which the largest |y| saturates and at least one element's
    code by ``y * (1 / scale)`` differs from its code by ``y / scale``, so that a test using it
    tells the documented arithmetic from a division. Found by search: scales that put some
    ``|y[i]| / scale`` on a midpoint between two e4m3 values, where the two roundings part. The
    largest |y| over 448 * 0.75 if the search finds none (it always did on random rows)."""
    big = float(y.float().abs().max())
    yf = y.float().reshape(-1)[:256]        # enough to find one (and cheap)
    mids = _MIDS.float()
    mids = mids[(mids > 1) & (mids < FP8_MAX)]
    cands = (yf.abs()[yf != 0][:, None] / mids[None, :]).reshape(-1)
    cands = cands[big / cands > FP8_MAX * 1.01]                 # the largest saturates
    for c in cands.split(2048):
        inv = torch.ones_like(c) / c
        differ = (e4m3_codes(yf[None, :] * inv[:, None])
                  != e4m3_codes(yf[None, :] / c[:, None])).any(1)
        if differ.any():
            return c[differ][0].reshape(())
    return torch.tensor(big / FP8_MAX * 0.75)
