"""The symmetric workspace: one peer-mapped allocation per communicator, carved into regions.

Made with PyTorch symmetric memory (``empty`` + ``rendezvous``), which maps every rank's
allocation into every other rank's address space over NVLink. Only the ranks of the given process
group take part; the handles travel over that group's store (docs/design.md, "Trust model").
"""
from __future__ import annotations

import torch
import torch.distributed as dist

#: Regions start on this boundary so 16-byte vector loads and stores stay aligned.
REGION_ALIGN = 256


def _align(n: int, a: int = REGION_ALIGN) -> int:
    return (n + a - 1) // a * a


class SymmetricWorkspace:
    """One symmetric allocation split into named byte regions.

    This is a collective and host-blocking (it exchanges memory handles with every rank of
    ``group``): create it once, up front. ``regions`` maps a name to its size in bytes; every
    rank must pass the same regions. Contents are zeroed (or set as ``fill`` says) and every rank
    has finished before the constructor returns.
    """

    def __init__(self, group: dist.ProcessGroup, regions: dict[str, int], device: torch.device,
                 fill: dict[str, list[tuple[int, int, int]]] | None = None):
        """``fill``: region name -> ``(start, end, byte)`` ranges (bytes within the region) that
        hold ``byte`` instead of 0, set before the closing barrier like the zeros."""
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.device = device
        self.offsets: dict[str, int] = {}
        self.sizes: dict[str, int] = dict(regions)
        total = 0
        for name, size in regions.items():
            self.offsets[name] = total
            total += _align(max(size, 1))
        self.nbytes = total
        self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        self.buffer.zero_()
        for name, ranges in (fill or {}).items():
            region = self.local(name)
            for start, end, byte in ranges:
                region[start:end].fill_(byte)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank = self.handle.rank
        self.world_size = self.handle.world_size
        bases = list(self.handle.buffer_ptrs)
        self._tables = {
            name: torch.tensor([b + off for b in bases], dtype=torch.int64, device=device)
            for name, off in self.offsets.items()
        }
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def local(self, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """This rank's part of region ``name`` as a flat tensor of ``dtype``."""
        off, size = self.offsets[name], self.sizes[name]
        return self.buffer[off:off + size].view(dtype)

    def table(self, name: str) -> torch.Tensor:
        """int64 device tensor ``[world_size]``: region ``name``'s address on every rank."""
        return self._tables[name]

    def close(self) -> None:
        """Drain every rank, then release the allocation. A collective."""
        if self.buffer is None:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._tables.clear()
        self.handle = None
        self.buffer = None
