"""Starting the ranks of a benchmark, and the small collectives by which they agree.

Process layout (``launch``): one process per visible GPU when there are two or more CUDA GPUs
(NCCL, rank r on GPU r), otherwise two CPU processes on gloo (the Communicator then picks its
reference backend), started by ``llcomm.multiproc``. The environment is passed on as the user
set it; with ``multicast_off=True`` (the commands' ``--no-multicast``) every rank first sets
``MULTICAST_OFF_ENV``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .. import multiproc
from ..multiproc import MULTICAST_OFF_ENV

#: Ranks started when there are fewer than two CUDA GPUs (gloo, CPU tensors).
CPU_WORLD_SIZE = 2
#: Characters of an error message kept in a result row.
ERROR_CHARS = 200


def plan(force_cpu: bool = False) -> tuple[int, str]:
    """(world size, torch.distributed backend) that ``launch`` will use on this machine."""
    n = 0 if force_cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    return (n, "nccl") if n >= 2 else (CPU_WORLD_SIZE, "gloo")


class LaunchError(RuntimeError):
    """A spawned rank raised or died; the message holds that rank's traceback."""


def launch(fn: Callable, cfg, *, force_cpu: bool = False, multicast_off: bool = False):
    """Run ``fn(rank, world_size, cfg)`` in every rank (see the module doc); return rank 0's value.

    ``fn`` and ``cfg`` must be picklable (a module-level function, plain data). A rank that
    raises or dies makes the whole launch raise ``LaunchError`` (the others are stopped). No
    bound on the run's length: the group's own waits last ``multiproc.GROUP_TIMEOUT_S``.
    ``multicast_off``: set ``MULTICAST_OFF_ENV`` in every rank before anything else.
    """
    world, backend = plan(force_cpu)
    try:
        return multiproc.run(fn, world, cfg, backend=backend, timeout=None,
                             env=MULTICAST_OFF_ENV if multicast_off else None)[0]
    except multiproc.RankFailed as e:
        raise LaunchError(f"a rank of the {world}-process {backend} job failed:\n{e}") from None


# -- agreement between ranks --------------------------------------------------------------------
def short_error(e: BaseException) -> str:
    """'TypeName: first line of the message', cut to ERROR_CHARS (for a result row)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:ERROR_CHARS]


def attempt(step: Callable[[], object], what: list, device: torch.device) -> bool:
    """Run ``step``; agree with every rank whether all succeeded (a collective). On failure
    ``what[0]`` holds this rank's error, or says another rank failed."""
    try:
        step()
    except Exception as e:  # noqa: BLE001 - becomes the row's error note
        what[0] = short_error(e)
    failed = any_rank(what[0] is not None, device)
    if failed and what[0] is None:
        what[0] = "failed on another rank"
    return not failed


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is true on any rank. A collective."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sum_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
