"""pytest setup: tests marked ``gpu`` are skipped, with the reason, on hosts with fewer CUDA
GPUs than they need: two by default (every distributed GPU test runs two ranks, one GPU each),
``@pytest.mark.gpu(gpus=1)`` for a single-GPU test. Run them with ``pytest -m gpu``."""
import pytest
import torch

#: GPUs a ``gpu`` test needs unless its marker says otherwise: one per rank of a 2-rank group.
GPUS_NEEDED = 2


def pytest_collection_modifyitems(config, items):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        mark = item.get_closest_marker("gpu")
        need = mark.kwargs.get("gpus", GPUS_NEEDED) if mark else 0
        if need > have:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} CUDA GPUs, this host has {have}"))
