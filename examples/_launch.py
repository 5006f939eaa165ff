"""Start an example on every rank: ``launch(main)`` at the bottom of each example.

- Under ``torchrun --nproc-per-node N examples/X.py`` each process initialises torch.distributed
  from the environment: NCCL with GPU ``LOCAL_RANK`` when CUDA is available, gloo otherwise.
- Run as ``python examples/X.py``, it starts ``world_size`` local processes itself (gloo on the
  CPU with ``--cpu`` or without two GPUs, else NCCL), which is how CI runs the examples.

``main()`` then runs on every rank with the default process group initialised and returns
nothing; a rank that raises makes the whole run exit non-zero.
"""
from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run(rank: int, world_size: int, backend: str, port: int, main) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    _init_and_run(backend, main)
    # Done and torn down: leave without the interpreter's finalization, where a worker thread
    # of the group's C++ side can still be joined and abort ("terminate called without an
    # active exception", once in a CI run of tp_all_reduce.py after it had printed ok). A rank
    # that raised never gets here and exits non-zero as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init_and_run(backend: str, main) -> None:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        main()
        # Every rank done before any tears down: rank 0 hosts the group's store, and a peer
        # still using the group when it goes has aborted at exit on a busy 2-core CI machine.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(main, world_size: int = 2) -> None:
    """Run ``main()`` on every rank (see the module docstring)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "RANK" in os.environ:                                  # torchrun started us
        _init_and_run("nccl" if gpus else "gloo", main)
        return
    backend = "nccl" if gpus >= world_size and "--cpu" not in sys.argv else "gloo"
    mp.start_processes(_run, args=(world_size, backend, _free_port(), main), nprocs=world_size,
                       start_method="spawn")
