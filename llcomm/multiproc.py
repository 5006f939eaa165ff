"""Ranks as local processes: the one launcher of the tests, the examples and the benchmarks.

    from llcomm.multiproc import run

    def body(rank, world_size, n):           # module level, so spawn can pickle it
        ...                                  # torch.distributed is initialised here

    results = run(body, 2, 1000)             # [rank 0's return value, rank 1's]

``run`` starts ``world_size`` fresh processes (``spawn``). The parent hosts the rendezvous: a
``TCPStore`` bound to port 0, so the OS hands it a free port and no other process can take that
port between its choice and its use (picking a port by binding and closing a socket leaves
that window open). Each child connects to it, initialises the default process group (NCCL with
rank r on GPU r, or gloo), runs ``fn(rank, world_size, *args)`` and destroys the group in
``finally``, then leaves at once (``os._exit(0)``: no interpreter finalization, where gloo's
threads can abort a process that has passed; ``interpreter_exit=True`` keeps the finalization
for libraries that must release what they hold there). Each rank reports back over a queue:
its return value, or its exception with the rank's traceback, which ``run`` raises as
``RankFailed``.
Nothing hangs: once any rank fails the others get ``FAILURE_GRACE_S``; past ``timeout`` seconds
every remaining process is killed, and the error names the ranks that never finished.

Fault tests name the ranks that are meant to die: ``expect_exit={1: 17}`` accepts rank 1 leaving
with exit code 17 (``os._exit(17)``; ``-9`` for SIGKILL) without a report (its result is None),
does not start the grace period for it, and then requires every other rank to report and to exit
on its own (exit code 0) within ``KILL_WAIT_S``. ``clean_exit=True`` requires the same of every
rank without naming any that dies.

A run whose process group could not form (``init_process_group`` raised on some rank before
``fn`` ran anywhere: gloo's TCP mesh on the loopback now and then reports "Connection closed by
peer" there) is started again from scratch on a fresh store, up to ``INIT_ATTEMPTS`` times in
all. A failure inside ``fn`` is never retried.

The library never imports this module.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import queue as queue_mod
import sys
import time
import traceback
from typing import Callable

#: The variables that switch NVLink multicast off in NCCL (NVLS), torch symmetric memory and
#: NVSHMEM, with their "off" values (llcomm itself never uses multicast).
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}
#: Seconds the other ranks get to finish after one rank failed (they are usually stuck in a
#: collective waiting for it) before they are killed.
FAILURE_GRACE_S = 5.0
#: Seconds to wait for a process to exit on its own, and for a killed one to go.
KILL_WAIT_S = 5.0
#: How often, in seconds, the parent looks at the processes while it waits for reports.
POLL_S = 0.2
#: The rendezvous address: every rank runs on this host.
HOST = "127.0.0.1"
#: Runs in all when the process group cannot form (module doc).
INIT_ATTEMPTS = 3
#: Seconds the group's own waits (rendezvous, collectives) last where a run has no bound.
GROUP_TIMEOUT_S = 300


class RankFailed(AssertionError):
    """One or more ranks raised, crashed or timed out. The message has every rank's story."""


class GroupNotFormed(RankFailed):
    """``init_process_group`` raised on some rank: ``fn`` never ran with a whole group."""


class RanksSkipped(Exception):
    """A rank called ``pytest.skip`` and none failed; the message is the first skip's reason."""


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """What every child needs to join the group: the parent's store port, the backend, the
    group's timeout (seconds), and environment variables to set before anything else."""
    port: int
    backend: str
    timeout_s: float
    env: tuple = ()
    interpreter_exit: bool = False


def rank_main(fn, rank: int, world_size: int, rdv: Rendezvous, args: tuple, results) -> None:
    """A child's life: environment, device, group, ``fn``, report, teardown."""
    import torch
    import torch.distributed as dist

    status, payload = "ok", None
    try:
        os.environ.update(dict(rdv.env))
        torch.set_num_threads(1)  # world_size processes share few cores: no oversubscription
        kwargs = {}
        if rdv.backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        td = datetime.timedelta(seconds=rdv.timeout_s)
        status = "init-error"
        store = dist.TCPStore(HOST, rdv.port, world_size=None, is_master=False, timeout=td)
        dist.init_process_group(rdv.backend, store=store, rank=rank, world_size=world_size,
                                timeout=td, **kwargs)
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
    except Exception:  # noqa: BLE001  (an unpicklable return value: say so, do not vanish)
        results.put((rank, "error", f"rank {rank}: could not send its return value back:\n"
                                    + traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()
    # Reported and torn down: leave without the interpreter's finalization, where a gloo worker
    # thread can still release a tensor and abort the process ("terminate called without an
    # active exception", exit code -6) after everything has passed. A hang or an abort in fn or
    # in the teardown above still shows. The report is flushed to the pipe first.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    if not rdv.interpreter_exit:
        os._exit(0)


def run(fn: Callable, world_size: int, *args, backend: str = "gloo",
        timeout: float | None = 120, env: dict | None = None,
        expect_exit: dict[int, int] | None = None, clean_exit: bool = False,
        worker: Callable = rank_main, interpreter_exit: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes (module doc).

    ``fn`` and ``args`` must be picklable (define ``fn`` at module level). Returns the ranks'
    return values, by rank. Raises ``RankFailed`` with the traceback of every rank that raised,
    the exit code of every rank that died without a word, and the ranks still running when
    ``timeout`` seconds ran out (None: no bound; the group's waits then last
    ``GROUP_TIMEOUT_S``); ``RanksSkipped`` when a rank skipped and none failed.

    backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank r on GPU r). env: variables every rank sets
    first (``MULTICAST_OFF_ENV``, say). expect_exit, clean_exit: module doc. worker: what each
    child runs, ``rank_main``'s arguments (a tool may wrap it to set a process up first).
    interpreter_exit: a rank leaves through the interpreter's finalization, where libraries
    release what they hold (NVSHMEM's PEs), instead of ``os._exit(0)``.
    """
    __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this helper's frames
    for attempt in range(1, INIT_ATTEMPTS + 1):
        try:
            return _run_once(fn, world_size, args, backend, timeout, dict(env or {}),
                             dict(expect_exit or {}), clean_exit, worker, interpreter_exit)
        except GroupNotFormed:
            if attempt == INIT_ATTEMPTS:
                raise


def _run_once(fn, world_size: int, args: tuple, backend: str, timeout: float | None, env: dict,
              expect_exit: dict[int, int], clean_exit: bool, worker,
              interpreter_exit: bool = False) -> list:
    """One run of ``run``: store, spawn, ``fn``, reports."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    __tracebackhide__ = True
    group_s = GROUP_TIMEOUT_S if timeout is None else timeout
    store = dist.TCPStore(HOST, 0, world_size=None, is_master=True,
                          timeout=datetime.timedelta(seconds=group_s), wait_for_workers=False)
    rdv = Rendezvous(store.port, backend, group_s, tuple(env.items()), interpreter_exit)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, name=f"llcomm-rank{r}", daemon=True,
                         args=(fn, r, world_size, rdv, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, object]] = {}
    not_exited: dict[int, int | None] = {}  # rank -> exit code (None: still running)
    try:
        _collect(procs, results, reports, expect_exit, timeout)
    finally:
        if len(reports) == world_size:  # all reported: let them exit on their own first
            for p in procs:
                p.join(timeout=KILL_WAIT_S)
            if expect_exit or clean_exit:  # the survivors must also exit cleanly
                not_exited = {r: p.exitcode for r, p in enumerate(procs)
                              if r not in expect_exit and p.exitcode != 0}
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=KILL_WAIT_S)
        results.close()
        del store
    return _verdict(fn, world_size, timeout, reports, not_exited)


def _collect(procs, results, reports: dict, expect_exit: dict, timeout: float | None) -> None:
    """Wait for every rank's report, a death, the failure grace period, or ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at = None
    while len(reports) < len(procs):
        now = time.monotonic()
        if (deadline is not None and now > deadline) or (
                failed_at is not None and now > failed_at + FAILURE_GRACE_S):
            return
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
        dead = [r for r, p in enumerate(procs) if r not in reports and p.exitcode is not None]
        if not dead:
            continue
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
            reports[r] = ("error", f"rank {r} died with exit code {procs[r].exitcode} and "
                                   "reported nothing" + (f" (expected exit code {expect_exit[r]})"
                                                         if r in expect_exit else ""))
        if unexpected and failed_at is None:
            failed_at = time.monotonic()


def _verdict(fn, world_size: int, timeout: float | None, reports: dict,
             not_exited: dict) -> list:
    """The ranks' return values, or the error that tells every rank's story."""
    __tracebackhide__ = True
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
        first = len(errors) > 1
        parts = [f"--- rank {r} of {world_size} raised{' first' if i == 0 and first else ''}"
                 f" ---\n{tb}" for i, (r, tb) in enumerate(errors)]
        if missing:
            why = "after another rank failed" if errors else f"within timeout={timeout}s"
            parts.append(f"--- ranks {missing} did not finish {why}; killed ---")
        not_formed = any(status == "init-error" for status, _ in reports.values())
        raise (GroupNotFormed if not_formed else RankFailed)(
            f"{getattr(fn, '__name__', fn)} failed on {world_size} ranks"
            + (" (the process group did not form)" if not_formed else "") + ":\n"
            + "\n".join(parts))
    skips = [payload for status, payload in reports.values() if status == "skip"]
    if skips:
        raise RanksSkipped(skips[0])
    return [reports[r][1] for r in range(world_size)]
