"""The reference backend of ``Communicator``: every TP op on plain torch.distributed collectives.

It is the oracle of every test, the backend on machines without peer-reachable GPUs (gloo on
CPU) and the multi-host path (NCCL). It shares no code with the peer kernels it checks. The
``Communicator`` validates arguments and allocates outputs before calling in here, so this
module only moves data, through ``runtime.bounded.BoundedCalls`` (bounded waits on gloo and the
call check that makes ranks agree before any payload moves).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import fp8_format as F8
from ..runtime.bounded import BoundedCalls

# torch 2.13 renamed the single-tensor collectives (the old names still work but warn).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage as flat uint8: the movement ops send these, so any dtype moves byte-exact
    on gloo and NCCL, which take only some dtypes (gloo refuses int16, uint16 / 32 / 64, float8
    and float4 with "Invalid scalar type"; NCCL has a list of its own). ``t`` is contiguous (the
    Communicator checked)."""
    return t.view(-1).view(torch.uint8)


class ReferenceBackend:
    """TP ops on torch.distributed collectives of ``group``."""

    name = "reference"

    def __init__(self, group: dist.ProcessGroup, timeout_ms: int, *, device: torch.device,
                 check_calls: bool):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.calls = BoundedCalls(group, timeout_ms, "communicator", device=device,
                                  checked=check_calls)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor, algo: str) -> torch.Tensor:
        self.calls.agree("all_reduce", x.dtype, x.numel())
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        self.calls.run("all_reduce", lambda a: dist.all_reduce(
            out, op=dist.ReduceOp.SUM, group=self.group, async_op=a))
        return out

    def all_reduce_call(self, algo: str, n: int, dtype: torch.dtype):
        """``all_reduce`` bound: ``f(x, out) -> out`` (NCCL's or gloo's own algorithm)."""
        return lambda x, out: self.all_reduce(x, out, algo)

    def fused_call(self, variant: str, algo: str, tokens: int, hidden: int, dtype: torch.dtype,
                   wdtype: torch.dtype, eps: float, round_scale: bool = False):
        """The fused norm ``variant`` bound: ``f(x, residual, weight, out, res_out,
        qscale=None)`` (as ``PeerBackend.fused_call``)."""
        return lambda x, r, w, o, ro, q=None: self.fused(variant, x, r, w, eps, o, ro, q,
                                                         round_scale)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, out, res_out, algo):
        self.fused("all_reduce_residual_rmsnorm", x, residual, weight, eps, out, res_out)
        return out, res_out

    def fused(self, variant: str, x, residual, weight, eps, out, res_out, qscale=None,
              round_scale=False) -> None:
        """Every fused norm (``variant``: the Communicator method). The peer kernels'
        arithmetic (round the sum, add the residual in fp32 and round, normalise the rounded h
        in fp32, round y, quantise the rounded y by ``llcomm/runtime/fp8_format.py``); only the
        all-reduce itself is the library's."""
        self.calls.agree(variant, x.dtype, *x.shape)
        s = x.clone()
        self.calls.run(variant, lambda a: dist.all_reduce(
            s, op=dist.ReduceOp.SUM, group=self.group, async_op=a))
        h = s if residual is None else (s.float() + residual.float()).to(x.dtype)
        hf = h.float()
        inv = torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
        y = hf * inv * weight.float()
        if variant == "all_reduce_residual_rmsnorm_fp8":
            out.copy_(F8.quantize_static(y.to(x.dtype), qscale))
        elif variant == "all_reduce_residual_rmsnorm_fp8_per_group":
            q, scales = F8.quantize(y.to(x.dtype), round_scale)
            out.copy_(q)
            qscale.copy_(scales)
        else:
            out.copy_(y)
        res_out.copy_(h)

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        self.calls.agree("broadcast", x.dtype, x.numel(), src)
        src = dist.get_global_rank(self.group, src)
        xb = _bytes(x)
        self.calls.run("broadcast", lambda a: dist.broadcast(xb, src=src, group=self.group,
                                                             async_op=a))
        return x

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # Flat views: gloo wants the output to be world_size chunks shaped exactly like the
        # input, which a 0-d x (out [world_size]) or a stacked output would not be.
        self.calls.agree("all_gather", x.dtype, x.numel())
        self.calls.run("all_gather", lambda a: _all_gather_flat(
            _bytes(out), _bytes(x), group=self.group, async_op=a))
        return out

    def all_gather_2d(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        tokens, part = x.shape
        self.calls.agree("all_gather_2d", x.dtype, tokens, part)
        xb = _bytes(x)
        row = part * x.element_size()           # bytes of one token's part
        stacked = torch.empty(self.world_size * xb.numel(), dtype=torch.uint8, device=x.device)
        self.calls.run("all_gather_2d", lambda a: _all_gather_flat(
            stacked, xb, group=self.group, async_op=a))
        _bytes(out).view(tokens, self.world_size, row).copy_(
            stacked.view(self.world_size, tokens, row).transpose(0, 1))
        return out

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.calls.agree("reduce_scatter", x.dtype, x.numel())
        if x.device.type == "cpu":  # gloo has no reduce_scatter_tensor
            full = x.clone()
            self.calls.run("reduce_scatter", lambda a: dist.all_reduce(
                full, op=dist.ReduceOp.SUM, group=self.group, async_op=a))
            out.copy_(full.view(self.world_size, *out.shape)[self.rank])
            return out
        self.calls.run("reduce_scatter", lambda a: _reduce_scatter_flat(
            out.view(-1), x.view(-1), op=dist.ReduceOp.SUM, group=self.group, async_op=a))
        return out

    def check(self) -> None:
        """Raise CommBrokenError if an earlier call failed (the calls raise their own errors)."""
        self.calls.check()

    def close(self) -> None:
        pass
