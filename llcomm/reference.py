"""The reference backend: every op on plain torch.distributed collectives.

It is the oracle of every test, the backend on machines without peer-reachable GPUs (gloo on
CPU) and the multi-host path (NCCL). It shares no code with the peer kernels it checks. The
``Communicator`` validates arguments and allocates outputs before calling in here, so this
module only moves data.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives (the old names still work but warn).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ReferenceBackend:
    """TP ops on torch.distributed collectives of ``group``."""

    name = "reference"

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor, algo: str) -> torch.Tensor:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, out, res_out, algo):
        # Same arithmetic as the peer kernel (round the sum, add in fp32, round, normalise the
        # rounded h in fp32, round once); only the all-reduce itself is the library's.
        s = x.clone()
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=self.group)
        h = (s.float() + residual.float()).to(x.dtype)
        hf = h.float()
        inv = torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
        out.copy_(hf * inv * weight.float())
        res_out.copy_(h)
        return out, res_out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(x, src=dist.get_global_rank(self.group, src), group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # Flat views: gloo wants the output to be world_size chunks shaped exactly like the
        # input, which a 0-d x (out [world_size]) or a stacked output would not be.
        _all_gather_flat(out.view(-1), x.reshape(-1), group=self.group)
        return out

    def all_gather_2d(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        tokens, part = x.shape
        stacked = torch.empty(self.world_size * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather_flat(stacked, x.reshape(-1), group=self.group)
        out.view(tokens, self.world_size, part).copy_(
            stacked.view(self.world_size, tokens, part).transpose(0, 1))
        return out

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":  # gloo has no reduce_scatter_tensor
            full = x.clone()
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group)
            out.copy_(full.view(self.world_size, *out.shape)[self.rank])
            return out
        _reduce_scatter_flat(out.view(-1), x.view(-1), op=dist.ReduceOp.SUM, group=self.group)
        return out

    def check(self) -> None:
        """Nothing to surface: torch.distributed raises its own errors."""

    def close(self) -> None:
        pass
