"""``llcomm.multiproc``, the launcher of the tests, the examples and the benchmarks, on gloo:
return values by rank, the environment it sets in the ranks alone, a rank's ``pytest.skip``
as the caller's skip, and how a rank leaves (at once, or through the interpreter's
finalization). (Failures, deaths, timeouts and retries: tests/test_faults_cpu.py.)"""
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


def _leaves_a_mark(rank, world_size, folder):
    import atexit
    import pathlib
    atexit.register(pathlib.Path(folder, f"rank{rank}").write_text, "finalized")
    return rank


@pytest.mark.parametrize("interpreter_exit", [False, True])
def test_a_rank_leaves_at_once_or_through_finalization(tmp_path, interpreter_exit):
    """By default a rank leaves with os._exit: its atexit handlers never run. With
    ``interpreter_exit`` they do (what NVSHMEM's PEs in tools/shmem_check.py need)."""
    got = multiproc.run(_leaves_a_mark, 2, str(tmp_path), timeout=60,
                        interpreter_exit=interpreter_exit)
    assert got == [0, 1]
    marks = sorted(p.name for p in tmp_path.iterdir())
    assert marks == (["rank0", "rank1"] if interpreter_exit else [])
