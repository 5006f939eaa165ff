"""Replace an engine's tensor-parallel all-reduce with llcomm (docs/integration.md).

An engine's row-parallel layers end in one call, here ``tensor_model_parallel_all_reduce(x)``,
which asks a custom all-reduce object whether it takes ``x`` (``should_custom_ar``) and else falls
back to ``torch.distributed``. ``LLCommAllReduce`` is that object on llcomm; it calls the op
through ``llcomm.ops`` so the layer also compiles with ``torch.compile(fullgraph=True)``.

    python examples/tp_all_reduce.py         # 2 local processes (GPUs if there are two, else CPU)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import llcomm
import llcomm.ops
from _launch import device, launch

SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


class LLCommAllReduce:
    """The engine's custom all-reduce, on an ``llcomm.Communicator``.

    Create it where the engine creates its TP group (a collective: every rank of ``group``), with
    ``max_bytes`` at least the largest activation the decode step all-reduces.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, max_bytes: int = 8 << 20):
        self.comm = llcomm.Communicator(group, max_bytes=max_bytes)

    def should_custom_ar(self, x: torch.Tensor) -> bool:
        """Can llcomm take ``x``? Otherwise the caller falls back to torch.distributed."""
        return (x.dtype in SUPPORTED and x.is_contiguous() and x.device == self.comm.device
                and x.numel() * x.element_size() <= self.comm.max_bytes)

    def custom_all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """A new tensor with the sum of ``x`` over the group, or None where llcomm cannot."""
        if not self.should_custom_ar(x):
            return None
        return llcomm.ops.all_reduce(self.comm, x)

    def close(self) -> None:
        self.comm.close()


_custom_ar: LLCommAllReduce | None = None


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """What the model calls: llcomm where it can, torch.distributed otherwise (out of place)."""
    if _custom_ar is not None and _custom_ar.should_custom_ar(x):
        return _custom_ar.custom_all_reduce(x)
    y = x.clone()
    dist.all_reduce(y)
    return y


class RowParallelLinear(torch.nn.Module):
    """``y = x @ W.T`` with W's input columns split over ranks: each rank multiplies its slice of
    x by its slice of W, and the all-reduce sums the partial products."""

    def __init__(self, weight: torch.Tensor, rank: int, world_size: int):
        super().__init__()
        part = weight.shape[1] // world_size
        self.cols = slice(rank * part, (rank + 1) * part)
        self.weight = torch.nn.Parameter(weight[:, self.cols].contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(x[:, self.cols] @ self.weight.T)


def main():
    global _custom_ar
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = device()
    _custom_ar = LLCommAllReduce(max_bytes=1 << 20)

    g = torch.Generator().manual_seed(0)                      # same weights and input everywhere
    weight = torch.randn(512, 1024, generator=g).to(dev)
    x = torch.randn(8, 1024, generator=g).to(dev)
    layer = RowParallelLinear(weight, rank, ws)
    want = x @ weight.T

    y = layer(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-3)
    big = torch.ones(1 << 19, device=dev)                     # 2 MiB > max_bytes: the fallback
    assert torch.all(tensor_model_parallel_all_reduce(big) == ws)

    # The same layer compiled: llcomm.ops.all_reduce is a torch.library custom op.
    compiled = torch.compile(layer, fullgraph=True,
                             backend="inductor" if dev.type == "cuda" else "aot_eager")
    torch.testing.assert_close(compiled(x), y, rtol=1e-4, atol=1e-3)
    _custom_ar.comm.check()
    _custom_ar.close()
    if rank == 0:
        print(f"tp_all_reduce: ok (backend={_custom_ar.comm.backend})")


if __name__ == "__main__":
    launch(main)
