"""Starting the ranks of a benchmark, and the small collectives by which they agree.

Process layout (``launch``): one process per visible GPU when there are two or more CUDA GPUs
(NCCL, ``torch.cuda.set_device(rank)``), otherwise two CPU processes on gloo (the Communicator
then picks its reference backend). The environment is passed on as the user set it; with
``multicast_off=True`` (the commands' ``--no-multicast``) every rank first sets
``MULTICAST_OFF_ENV``.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
from typing import Callable

import torch
import torch.distributed as dist

#: The variables that switch NVLink multicast off in NCCL (NVLS), torch symmetric memory and
#: NVSHMEM, with their "off" values.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}
#: Ranks started when there are fewer than two CUDA GPUs (gloo, CPU tensors).
CPU_WORLD_SIZE = 2
#: Seconds a rank waits for the others in init and in gloo collectives.
DIST_TIMEOUT_S = 300
#: Characters of an error message kept in a result row.
ERROR_CHARS = 200


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan(force_cpu: bool = False) -> tuple[int, str]:
    """(world size, torch.distributed backend) that ``launch`` will use on this machine."""
    n = 0 if force_cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    return (n, "nccl") if n >= 2 else (CPU_WORLD_SIZE, "gloo")


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, cfg, out_path: str,
           multicast_off: bool):
    if multicast_off:
        os.environ.update(MULTICAST_OFF_ENV)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S), **kwargs)
    try:
        result = fn(rank, world, cfg)
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


class LaunchError(RuntimeError):
    """A spawned rank raised or died; the message holds that rank's traceback."""


def launch(fn: Callable, cfg, *, force_cpu: bool = False, multicast_off: bool = False):
    """Run ``fn(rank, world_size, cfg)`` in every rank (see the module doc); return rank 0's value.

    ``fn`` and ``cfg`` must be picklable (a module-level function, plain data). A rank that
    raises or dies makes the whole launch raise ``LaunchError`` (torch.multiprocessing terminates
    the others). ``multicast_off``: set ``MULTICAST_OFF_ENV`` in every rank before anything else.
    """
    import torch.multiprocessing as mp

    world, backend = plan(force_cpu)
    fd, out_path = tempfile.mkstemp(prefix="llcomm-", suffix=".pkl")
    os.close(fd)
    try:
        mp.spawn(_entry, args=(world, free_port(), backend, fn, cfg, out_path, multicast_off),
                 nprocs=world, join=True)
        with open(out_path, "rb") as f:
            return pickle.load(f)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise LaunchError(f"a rank of the {world}-process {backend} job failed:\n{e}") from None
    finally:
        os.unlink(out_path)


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
