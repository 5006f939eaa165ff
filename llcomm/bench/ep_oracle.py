"""The expected results of ``llcomm bench ep``, from every rank's inputs (the correctness part of
``llcomm.bench.ep``'s module doc): uniform routing, the stand-in experts, an FP8 quantiser written
independently of ``llcomm.runtime.fp8_format``, and ``Expected``, what each rank's dispatch and
combine must return.
"""
from __future__ import annotations

import torch

from . import verify

#: Channels per FP8 scale (docs/ep.md).
FP8_BLOCK = 128


def uniform_routing(n: int, experts: int, topk: int, gen: torch.Generator, device):
    """``(topk_idx [n, topk] int64, topk_weights [n, topk] fp32)``: distinct uniform experts per
    token, uniform weights summing to 1."""
    idx = torch.rand(n, experts, generator=gen, device=device,
                     dtype=torch.float32).topk(topk, dim=1).indices
    w = torch.rand(n, topk, generator=gen, device=device, dtype=torch.float32) + 0.01
    return idx.contiguous(), (w / w.sum(1, keepdim=True)).contiguous()


def expert_affine(experts: int, device):
    """fp32 ``(scale, bias)`` of the stand-in expert of each global expert id."""
    g = torch.arange(experts, device=device, dtype=torch.float32)
    return 1 + (g % 7) / 8, (g % 5) / 4 - 0.5


def run_experts(recv_x, recv_count, scale, bias, rank: int) -> torch.Tensor:
    """``expert_out`` for ``recv_x [L, W*T, H]``: ``x * scale[g] + bias[g]`` (fp32, rounded) on the
    filled rows, zeros elsewhere."""
    L = recv_x.shape[0]
    out = torch.zeros_like(recv_x)
    m = int(recv_count.max()) if L else 0
    s = scale[rank * L:(rank + 1) * L].view(L, 1, 1)
    b = bias[rank * L:(rank + 1) * L].view(L, 1, 1)
    out[:, :m] = (recv_x[:, :m].float() * s + b).to(recv_x.dtype)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


#: The e4m3 maximum of ``use_fp8=True`` (docs/ep.md) and the smallest normal fp32 scale (a
#: smaller one is raised to it).
FP8_MAX, MIN_NORMAL_SCALE = 448.0, 2.0 ** -126


def _e4m3_magnitudes() -> torch.Tensor:
    """float64 values of the non-negative finite e4m3 codes 0 .. 126, decoded from the bits
    (ascending in the code)."""
    vals = []
    for code in range(127):
        exp, man = code >> 3, code & 7
        vals.append(man * 2.0 ** -9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor(vals, dtype=torch.float64, device="cpu")


def fp8_oracle(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H]`` -> ``(codes [..., H] uint8, scales [..., H / 128] float32)`` by the
    documented FP8 arithmetic, without torch's float8 cast: each ``x / scale`` goes to the
    nearest e4m3 value of the table (ties to the even code, the sign bit kept for zeros)."""
    H = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], H // FP8_BLOCK, FP8_BLOCK)
    amax = xf.abs().amax(-1)
    # a tensor divisor: CUDA torch multiplies by the (inexact) reciprocal of a Python scalar
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX))
    if round_scale:
        mant, exp = torch.frexp(scale)                # scale = mant * 2 ** exp, mant in [0.5, 1)
        up = torch.where(mant == 0.5, scale, torch.ldexp(torch.ones_like(scale), exp))
        scale = torch.where(scale < MIN_NORMAL_SCALE, torch.full_like(scale, MIN_NORMAL_SCALE),
                            up).float()
    v = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    mags = _e4m3_magnitudes().to(v.device)
    a = v.abs().double().reshape(-1)
    hi = torch.searchsorted(mags, a).clamp(1, mags.numel() - 1)   # mags[hi - 1] < a <= mags[hi]
    lo = hi - 1
    d_lo, d_hi = a - mags[lo], mags[hi] - a
    code = torch.where(d_hi < d_lo, hi, torch.where(d_lo < d_hi, lo, torch.where(hi % 2 == 0,
                                                                                   hi, lo)))
    code = code + 128 * torch.signbit(v.reshape(-1)).to(code.dtype)
    return code.to(torch.uint8).reshape(x.shape), scale


class Expected:
    """What this rank's dispatch and combine must return, from every rank's inputs."""

    def __init__(self, x, idx, w, rank: int, world: int, max_tokens: int, scale, bias,
                 ranks_per_host: int = 0):
        L = scale.shape[0] // world
        n, K = idx.shape
        xs = verify.gather_bytes(x).reshape(world * n, -1)            # pair p = s * n + t
        ids = verify.gather_inputs(idx).reshape(world * n, K)
        mine = torch.arange(rank * L, (rank + 1) * L, device=idx.device, dtype=torch.int64)
        hit = (ids.unsqueeze(-1) == mine).any(1).T                   # [L, W * n]
        self.count = hit.sum(1).to(torch.int32)
        self.e, self.p = hit.nonzero(as_tuple=True)                  # expert-major, then pair
        self.row = (hit.cumsum(1) - 1)[self.e, self.p]
        self.rows = xs[self.p]
        self.src = ((self.p // n) * max_tokens + self.p % n).to(torch.int32)
        self.combine = self._combine(x, idx, w, world, L, scale, bias, ranks_per_host)
        self._fp8: dict = {}

    @staticmethod
    def _combine(x, idx, w, world, L, scale, bias, ranks_per_host: int = 0):
        """The documented order: per expert rank the k-order fold, rounded; per host (of
        ``ranks_per_host`` ranks; 0: one host) the fold of its ranks' partials in rank order,
        rounded; then the hosts in order, rounded (with one host: the single-level order, bit
        for bit; docs/multihost.md)."""
        ranks_per_host = ranks_per_host or world
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        owner = idx // L
        for first in range(0, world, ranks_per_host):
            host_acc = torch.zeros_like(total)
            hit = torch.zeros((x.shape[0], 1), dtype=torch.bool, device=x.device)
            for q in range(first, first + ranks_per_host):
                acc = torch.zeros_like(total)
                for k in range(idx.shape[1]):
                    g = idx[:, k]
                    y = (x.float() * scale[g].unsqueeze(1) + bias[g].unsqueeze(1)).to(x.dtype)
                    acc = torch.where((owner[:, k] == q).unsqueeze(1),
                                      acc + w[:, k:k + 1] * y.float(), acc)
                went = (owner == q).any(1, keepdim=True)
                host_acc = torch.where(went, host_acc + acc.to(x.dtype).float(), host_acc)
                hit |= went
            total = torch.where(hit, total + host_acc.to(x.dtype).float(), total)
        return total.to(x.dtype)

    def dispatch_wrong(self, recv_x, recv_count, handle) -> int:
        bad = int((recv_count != self.count).sum())
        got = recv_x[self.e, self.row]
        bad += int((_bits(got) != _bits(self.rows)).sum())
        bad += int((handle.src_info[self.e, self.row] != self.src).sum())
        return bad

    def dispatch_fp8_wrong(self, recv, recv_count, handle, round_scale: bool) -> int:
        """Wrong elements of an FP8 dispatch result ``recv = (codes, scales)``: counts,
        ``src_info``, codes and scales, each byte for byte against ``fp8_oracle``."""
        if round_scale not in self._fp8:
            self._fp8[round_scale] = fp8_oracle(self.rows, round_scale)
        codes, scales = self._fp8[round_scale]
        bad = int((recv_count != self.count).sum())
        bad += int((recv[0].view(torch.uint8)[self.e, self.row] != codes).sum())
        bad += int((_bits(recv[1][self.e, self.row]) != _bits(scales)).sum())
        bad += int((handle.src_info[self.e, self.row] != self.src).sum())
        return bad
