"""Start an example on every rank: ``launch(main)`` at the bottom of each example.

- Under ``torchrun --nproc-per-node N examples/X.py`` each process initialises torch.distributed
  from the environment: NCCL with GPU ``LOCAL_RANK`` when CUDA is available, gloo otherwise.
- Run as ``python examples/X.py``, it starts ``world_size`` local processes itself through
  ``llcomm.multiproc`` (gloo on the CPU with ``--cpu`` or without two GPUs, else NCCL with rank
  r on GPU r), which is how CI runs the examples.

``main()`` then runs on every rank with the default process group initialised and returns
nothing; a rank that raises makes the whole run exit non-zero with that rank's traceback.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from llcomm import multiproc


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rank_main(rank: int, world_size: int, main) -> None:
    main()
    dist.barrier()      # every rank done before any tears the group down


def launch(main, world_size: int = 2) -> None:
    """Run ``main()`` on every rank (see the module docstring)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "RANK" in os.environ:                                  # torchrun started us
        if gpus:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if gpus else "gloo")
        try:
            _rank_main(dist.get_rank(), dist.get_world_size(), main)
        finally:
            dist.destroy_process_group()
        return
    backend = "nccl" if gpus >= world_size and "--cpu" not in sys.argv else "gloo"
    multiproc.run(_rank_main, world_size, main, backend=backend, timeout=None)
