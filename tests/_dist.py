"""The one spawn helper of every distributed test.

    from _dist import run_distributed

    def _body(rank, world_size, n):          # module level, so spawn can pickle it
        ...                                  # torch.distributed is initialised here

    def test_something():
        run_distributed(_body, 2, 1000)      # raises in pytest if any rank raised

``run_distributed`` starts ``world_size`` fresh processes (``spawn``), gives them a TCP store on
a port the OS picked for this call only, initialises the default process group in each, runs
``fn(rank, world_size, *args)`` and destroys the group in ``finally``. Each rank reports back over
a queue: its return value, or its exception with the rank's traceback, which is then raised in
the pytest process. Nothing can hang: once any rank fails, the others get a short grace period;
past ``timeout`` seconds every remaining process is killed and the test fails, naming the ranks
that never finished.

Fault tests name the ranks that are meant to die: ``run_distributed(fn, 2, expect_exit={1: 17})``
accepts rank 1 leaving with exit code 17 (``os._exit(17)``; ``-9`` for SIGKILL) without a report
(its result is None), does not start the failure grace period for it, and then requires every
other rank to report and to exit on its own (exit code 0) within ``KILL_WAIT_S``.
``clean_exit=True`` requires the same of every rank without naming any that dies (a test that a
library call never aborts the process, even after its report).

A run whose process group could not form (``init_process_group`` raised on some rank, before
``fn`` ran anywhere: gloo's TCP mesh on the loopback now and then reports "Connection closed
by peer" there, about once in four CI runs) is started again from scratch, on a fresh
port, up to ``INIT_ATTEMPTS`` times in all. A failure inside ``fn`` is never retried.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import time
import traceback

import torch.multiprocessing as mp

#: Environment for GPU (NCCL) runs: NVLink multicast (NVLS) off, so that what the tests exercise
#: does not depend on whether a host offers it (llcomm itself never uses it).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
#: Seconds the other ranks get to finish after one rank failed (they are usually stuck in a
#: collective waiting for it) before they are killed.
FAILURE_GRACE_S = 5.0
#: Seconds to wait for a killed process to go.
KILL_WAIT_S = 5.0
#: How often, in seconds, the parent looks at the processes while it waits for reports.
POLL_S = 0.2
HOST = "127.0.0.1"
#: Runs in all when the process group cannot form (module doc).
INIT_ATTEMPTS = 3


class RankFailed(AssertionError):
    """One or more ranks raised, crashed or timed out. The message has every rank's story."""


class _GroupNotFormed(RankFailed):
    """``init_process_group`` raised on some rank: ``fn`` never ran with a whole group."""


def _worker(fn, rank, world_size, port, backend, timeout, args, results) -> None:
    import torch
    import torch.distributed as dist

    status, payload = "ok", None
    try:
        torch.set_num_threads(1)  # world_size processes share few cores: no oversubscription
        if backend == "nccl":
            torch.cuda.set_device(rank)
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(HOST, port, world_size=None, is_master=False, timeout=td)
        status = "init-error"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=td)
        status = "ok"
        payload = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001  (report everything, pytest's skip included)
        if type(e).__name__ == "Skipped":  # pytest.skip() inside a rank
            status, payload = "skip", str(e)
        else:   # "init-error" if the process group did not form
            status = "init-error" if status == "init-error" else "error"
            payload = "".join(traceback.format_exception(e))
    # Report before tearing the group down: a rank that raised while its peers wait in an NCCL
    # collective would otherwise block in destroy_process_group and never say why.
    try:
        results.put((rank, status, payload))
    except Exception:  # an unpicklable return value: say so instead of vanishing
        results.put((rank, "error", f"rank {rank}: could not send its return value back:\n"
                                    + traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120,
                    expect_exit: dict[int, int] | None = None, clean_exit: bool = False):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` and ``args`` must be picklable (define ``fn`` at module level). Returns the list of
    the ranks' return values, by rank. Raises ``RankFailed`` (an AssertionError) with the
    traceback of every rank that raised, the exit code of every rank that died without a word,
    and the ranks still running when ``timeout`` seconds ran out; calls ``pytest.skip`` when a
    rank skipped and none failed.

    backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank r uses GPU r; multicast is switched off
    through the environment before the processes start, see ``GPU_ENV``).
    expect_exit: ``{rank: exit code}`` of ranks that are meant to die (see the module doc).
    clean_exit: every rank must also exit with code 0 after its report (implied by expect_exit).
    A run whose process group did not form is started again (module doc).
    """
    __tracebackhide__ = True
    for attempt in range(INIT_ATTEMPTS):
        try:
            return _run_once(fn, world_size, *args, backend=backend, timeout=timeout,
                             expect_exit=expect_exit, clean_exit=clean_exit)
        except _GroupNotFormed:
            if attempt == INIT_ATTEMPTS - 1:
                raise


def _run_once(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120,
              expect_exit: dict[int, int] | None = None, clean_exit: bool = False):
    """One run of ``run_distributed``: spawn, rendezvous, ``fn``, reports."""
    import torch.distributed as dist

    __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this helper's frames
    if backend == "nccl":
        os.environ.update(GPU_ENV)
    # The parent hosts the rendezvous store on a port the OS picks now (port 0): a fresh free
    # port per call, with no window in which another process could take it.
    td = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(HOST, 0, world_size=None, is_master=True, timeout=td,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, name=f"llcomm-test-rank{r}", daemon=True,
                         args=(fn, r, world_size, store.port, backend, timeout, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()

    expect_exit = dict(expect_exit or {})
    reports: dict[int, tuple[str, object]] = {}
    not_exited: dict[int, int | None] = {}  # rank -> exit code (None: still running)
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while len(reports) < world_size:
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + FAILURE_GRACE_S):
                break
            try:
                rank, status, payload = results.get(timeout=POLL_S)
                if rank in expect_exit:
                    status, payload = "error", (f"rank {rank} was expected to die with exit code "
                                                f"{expect_exit[rank]} but reported {status}:\n"
                                                f"{payload}")
                reports[rank] = (status, payload)
                if status in ("error", "init-error") and failed_at is None:
                    failed_at = time.monotonic()
                continue
            except queue_mod.Empty:
                pass
            # A process that died without reporting (segfault, os._exit, killed) never will.
            dead = [r for r, p in enumerate(procs)
                    if r not in reports and p.exitcode is not None]
            if dead:
                time.sleep(POLL_S)  # its report may still be in the pipe
                while True:
                    try:
                        rank, status, payload = results.get_nowait()
                    except queue_mod.Empty:
                        break
                    reports[rank] = (status, payload)
                unexpected = False
                for r in dead:
                    if r in reports:
                        continue
                    if expect_exit.get(r) == procs[r].exitcode:
                        reports[r] = ("died", None)  # as planned: not a failure
                        continue
                    unexpected = True
                    reports[r] = ("error", f"rank {r} died with exit code {procs[r].exitcode} "
                                           "and reported nothing" + (
                                               f" (expected exit code {expect_exit[r]})"
                                               if r in expect_exit else ""))
                if unexpected and failed_at is None:
                    failed_at = time.monotonic()
    finally:
        if len(reports) == world_size:  # all reported: let them exit on their own first
            for p in procs:
                p.join(timeout=KILL_WAIT_S)
            if expect_exit or clean_exit:  # fault tests: the survivors must also exit cleanly
                not_exited = {r: p.exitcode for r, p in enumerate(procs)
                              if r not in expect_exit and p.exitcode != 0}
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=KILL_WAIT_S)
        results.close()
        del store

    # Reports in arrival order: the first rank to fail is usually the cause, the others often
    # fail in a collective because of it.
    errors = [(r, payload) for r, (status, payload) in reports.items()
              if status in ("error", "init-error")]
    missing = [r for r in range(world_size) if r not in reports]
    if not errors and not missing and not_exited:
        errors = [(r, f"rank {r} reported but did not exit cleanly within {KILL_WAIT_S}s "
                      f"({'still running, killed' if code is None else f'exit code {code}'})")
                  for r, code in not_exited.items()]
    if errors or missing:
        parts = [f"--- rank {r} of {world_size} raised{' first' if i == 0 and len(errors) > 1 else ''}"
                 f" ---\n{tb}" for i, (r, tb) in enumerate(errors)]
        if missing:
            why = ("after another rank failed" if errors else f"within timeout={timeout}s")
            parts.append(f"--- ranks {missing} did not finish {why}; killed ---")
        not_formed = any(status == "init-error" for status, _ in reports.values())
        raise (_GroupNotFormed if not_formed else RankFailed)(
            f"{getattr(fn, '__name__', fn)} failed on {world_size} ranks"
            + (" (the process group did not form)" if not_formed else "") + ":\n"
            + "\n".join(parts))
    skips = [payload for status, payload in reports.values() if status == "skip"]
    if skips:
        import pytest
        pytest.skip(skips[0])
    return [reports[r][1] for r in range(world_size)]


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
