"""The spawn helper of every distributed test: ``llcomm.multiproc.run`` under pytest.

    from _dist import run_distributed

    def _body(rank, world_size, n):          # module level, so spawn can pickle it
        ...                                  # torch.distributed is initialised here

    def test_something():
        run_distributed(_body, 2, 1000)      # raises in pytest if any rank raised

``llcomm.multiproc`` says what a run does (a store on a port the OS picked for this call only,
every rank's traceback in the report, a timeout after which every rank is killed, ranks that
are meant to die, retries where the group did not form). Here a rank's ``pytest.skip`` becomes
the test's skip, and NCCL runs switch NVLink multicast off (``GPU_ENV``), so that what the
tests exercise does not depend on whether a host offers it.
"""
from __future__ import annotations

from llcomm import multiproc
from llcomm.multiproc import RankFailed  # noqa: F401  (the tests' name for a failed run)

#: Environment of every rank of a GPU (NCCL) run.
GPU_ENV = multiproc.MULTICAST_OFF_ENV
#: What each child runs (tools/_one_gpu.py replaces it to move NCCL runs onto one GPU).
_worker = multiproc.rank_main


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120,
                    expect_exit: dict[int, int] | None = None, clean_exit: bool = False):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; the ranks'
    return values by rank (``llcomm.multiproc.run``, whose arguments these are). Calls
    ``pytest.skip`` when a rank skipped and none failed.

    backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank r uses GPU r, with ``GPU_ENV``).
    """
    __tracebackhide__ = True
    try:
        return multiproc.run(fn, world_size, *args, backend=backend, timeout=timeout,
                             env=GPU_ENV if backend == "nccl" else None,
                             expect_exit=expect_exit, clean_exit=clean_exit, worker=_worker)
    except multiproc.RanksSkipped as e:
        import pytest
        pytest.skip(str(e))


def absent_peer_error(rank: int, call, check, timeout_ms: int, *, absent: int = 1):
    """Inside a distributed test body: every rank runs ``call()`` once and ``check()`` (a
    kernel's first, compiling launch waits up to ``launch.FIRST_LAUNCH_TIMEOUT_US`` for its
    peers, as an engine's warm-up would), then rank ``absent`` skips the next ``call()``.

    Returns None on ``absent``; on the other ranks ``check()`` must raise CommTimeoutError within
    ``timeout_ms`` + 1 s of the call, and the error is returned for the caller's own asserts.
    """
    import time

    import pytest
    import torch.distributed as dist

    import llcomm

    call()
    check()
    dist.barrier()
    if rank == absent:
        dist.barrier()
        return None
    t0 = time.monotonic()
    call()
    with pytest.raises(llcomm.CommTimeoutError) as info:
        check()
    elapsed = time.monotonic() - t0
    dist.barrier()
    assert elapsed < timeout_ms / 1000 + 1.0, elapsed
    assert info.value.ranks == (absent,), info.value
    return info.value
