"""Two ranks on ONE GPU, for ``tools/one_gpu_check.py`` (a development aid, never the library).

The library refuses this setup on purpose: two contexts on one device are time-sliced, not
concurrent, and a store between them is not a supported peer path. PyTorch's symmetric memory
refuses it too ("allocations from overlapping devices"). ``patch_process()`` lifts both refusals
inside one process: ``llcomm.runtime.backend.peer_support`` says yes, and the workspace becomes
a plain allocation mapped into the other ranks with CUDA IPC. Nothing here says anything about
speed or NVLink ordering; it runs the real kernels and host code.

``worker`` replaces ``tests/_dist.py``'s ``_worker`` for the GPU tests: a run asked for on
``"nccl"`` (rank r on GPU r) runs on gloo with every rank on cuda:0, patched as above.
"""
from __future__ import annotations

import torch

#: What ``peer_support`` reports when patched.
REASON = "tools/one_gpu_check.py: two ranks on one GPU"


class IpcHandle:
    """What llcomm's workspace reads from a symmetric-memory handle: rank, world size, and every
    rank's base address, here from CUDA IPC (the peers' tensors are kept alive with it)."""

    def __init__(self, buffer, group_name=None):
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        shared = [None] * self.world_size
        dist.all_gather_object(shared, reduce_tensor(buffer))
        self._peers = [buffer if r == self.rank else fn(*args)
                       for r, (fn, args) in enumerate(shared)]
        self.buffer_ptrs = [t.data_ptr() for t in self._peers]


def patch_process() -> None:
    """Use cuda:0, accept it as a peer path, and share workspaces by CUDA IPC (one group: the
    world)."""
    import torch.distributed._symmetric_memory as symm_mem

    import llcomm.runtime.backend as backend
    torch.cuda.set_device(0)
    backend.peer_support = lambda places: (True, REASON)
    symm_mem.empty = lambda n, dtype, device: torch.empty(n, dtype=dtype, device=device)
    symm_mem.rendezvous = lambda buffer, group_name: IpcHandle(buffer)


def worker(fn, rank, world_size, rdv, args, results) -> None:
    """``_dist._worker`` with a ``"nccl"`` run moved onto gloo and cuda:0 (module doc)."""
    import dataclasses

    import _dist
    if rdv.backend == "nccl":
        patch_process()
        rdv = dataclasses.replace(rdv, backend="gloo")
    _dist._worker(fn, rank, world_size, rdv, args, results)  # a fresh process: its _dist is
    # not patched


class PytestPlugin:
    """Collect the ``gpu`` tests as if the host had two GPUs and run their ranks through
    ``worker``. The children are fresh processes: the device count is only faked here, in the
    pytest process, while the skip markers are decided (collection); the tests then see the
    real count, so a one-GPU test (``gpu(gpus=1)``) runs in this process as on its own."""

    def pytest_configure(self, config):
        import _dist
        _dist._worker = worker
        self._device_count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 2

    def pytest_collection_finish(self, session):
        torch.cuda.device_count = self._device_count
