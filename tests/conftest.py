"""pytest setup: tests marked ``gpu`` are skipped, with the reason, on hosts with fewer than two
CUDA GPUs (every GPU test runs two ranks, one GPU each). Run them with ``pytest -m gpu``."""
import pytest
import torch

#: GPUs a ``gpu`` test needs: one per rank of a 2-rank group.
GPUS_NEEDED = 2


def pytest_collection_modifyitems(config, items):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= GPUS_NEEDED:
        return
    skip = pytest.mark.skip(reason=f"needs {GPUS_NEEDED} CUDA GPUs, this host has {have}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
