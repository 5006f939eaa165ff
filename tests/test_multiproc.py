"""``llcomm.multiproc``, the launcher of the tests, the examples and the benchmarks, on gloo:
return values by rank, the environment it sets in the ranks alone, and a rank's ``pytest.skip``
as the caller's skip. (Failures, deaths, timeouts and retries: tests/test_faults_cpu.py.)"""
from __future__ import annotations

import os

import pytest

from llcomm import multiproc

#: A variable no rank has unless the launcher sets it.
VAR = "LLCOMM_TEST_MULTIPROC_VAR"


def _report(rank, world_size, tag):
    import torch.distributed as dist
    return (rank, world_size, tag, dist.get_world_size(), os.environ.get(VAR))


def _skips(rank, world_size):
    if rank == 1:
        pytest.skip("rank 1 has no use for this host")
    return rank


def test_values_by_rank_and_environment():
    got = multiproc.run(_report, 2, "t", env={VAR: "set"}, timeout=60)
    assert got == [(0, 2, "t", 2, "set"), (1, 2, "t", 2, "set")]
    assert VAR not in os.environ            # set in the ranks, not here


def test_a_ranks_skip_is_reported_as_a_skip():
    with pytest.raises(multiproc.RanksSkipped, match="rank 1 has no use for this host"):
        multiproc.run(_skips, 2, timeout=60)
