"""Correctness counting of the benchmarks and ``llcomm check``: seeded inputs any rank can
rebuild, or every rank's inputs gathered by torch.distributed; sums in rank order, error bounds,
wrong elements, bytes that differ between ranks, NaN poison."""
from __future__ import annotations

import torch
import torch.distributed as dist

#: Integer views used to compare results bit for bit, by element size.
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather_inputs(x: torch.Tensor) -> torch.Tensor:
    """``[world_size, *x.shape]``: every rank's ``x``, by torch.distributed all_gather (a list
    all_gather, which every backend has). A collective."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.stack(parts)


def gather_bytes(t: torch.Tensor) -> torch.Tensor:
    """``gather_inputs`` moving raw bytes (gloo moves no 16-bit types). A collective."""
    return gather_inputs(t.contiguous().view(torch.uint8)).view(t.dtype)


def all_inputs(world: int, n: int, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """``[world, n]``: rank r's input is drawn from seed (seed, r), so any rank can rebuild all."""
    g = torch.Generator(device=device)
    rows = []
    for r in range(world):
        g.manual_seed(seed * 64 + r)
        rows.append(torch.randn(n, dtype=dtype, device=device, generator=g))
    return torch.stack(rows)


def rank_order_sum(stack: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum over dim 0 in fp32, rank 0 first, rounded once to ``dtype``: the peer backend's
    reduction, so its results must match this bit for bit."""
    acc = stack[0].float().clone()
    for r in range(1, stack.shape[0]):
        acc += stack[r].float()
    return acc.to(dtype)


def sum_bound(stack: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise error bound of any summation order of ``stack`` rounded to ``dtype``:
    ``(W + 1) * eps * sum |x_r|`` plus the smallest normal (for the reference backend, whose
    reduction order is NCCL's or gloo's own)."""
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    return (stack.shape[0] + 1) * eps * stack.double().abs().sum(0) + tiny


def count_wrong(out: torch.Tensor, expected: torch.Tensor,
                bound: torch.Tensor | None = None) -> int:
    """Elements of ``out`` that differ from ``expected``: bit for bit when ``bound`` is None,
    else by more than ``bound`` from ``expected`` (the exact sum, any float dtype). NaN (the
    poison) is always wrong."""
    if bound is None:
        iv = INT_VIEW[out.element_size()]
        return int((out.reshape(-1).view(iv) != expected.reshape(-1).view(iv)).sum().item())
    err = (out.double() - expected.double()).abs()
    return int((~(err <= bound)).sum().item())


def rank_differences(ts: list[torch.Tensor]) -> int:
    """Bytes of ``ts`` on this rank that differ from rank 0's. A collective: every rank must
    call it with tensors of the same shapes, whatever happened before."""
    mine = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in ts])
    return int((gather_inputs(mine)[0] != mine).sum().item())


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN, so a result that was never written is counted wrong."""
    return t.fill_(float("nan"))
