"""What every llcomm benchmark shares: arguments, spawning ranks, timing, correctness oracles,
result files and tables (plots: ``llcomm.bench.plot``).

Process layout (``launch``): one process per visible GPU when there are two or more CUDA GPUs
(NCCL, ``torch.cuda.set_device(rank)``), otherwise two CPU processes on gloo (the Communicator
then picks its reference backend). NVLink multicast is switched off in the environment before
anything is spawned.

Timing (``time_graph`` / ``time_eager``), per the measuring rules of docs/DESIGN "How we measure"::

    warm-up -> synchronize -> barrier (ranks lined up) -> iters x [event, work, event] -> sync
    per-iteration times -> all_reduce MAX over ranks (the slowest rank of each iteration)
    -> median, p10, p90 over iterations; every time is divided by the ops per iteration.

A graph iteration is one replay of a CUDA graph holding ``ops`` back-to-back calls; an eager
iteration is the same ``ops`` calls launched from Python. On CPU an iteration is timed with
``time.perf_counter`` after a barrier.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..runtime.settings import BenchSettings

#: Multicast stays off in every process we start (NVLS / multimem are not to be used here).
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}
#: Ranks started when there are fewer than two CUDA GPUs (gloo, CPU tensors).
CPU_WORLD_SIZE = 2
#: Ops captured back to back in one CUDA graph; one replay is one timed iteration.
GRAPH_OPS = 20
#: Seconds a rank waits for the others in init and in gloo collectives.
DIST_TIMEOUT_S = 300
#: Seconds allowed to ``git`` and ``nvidia-smi`` calls.
TOOL_TIMEOUT_S = 10
#: Characters of an error message kept in a result row.
ERROR_CHARS = 200

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
          "fp32": torch.float32, "float": torch.float32}
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
#: Integer views used to compare results bit for bit, by element size.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# -- arguments --------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'8' -> 8, '64K' -> 65536, '16M' -> 16777216 (binary suffixes K, M, G; optional 'B')."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", text.upper())
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"size {text!r}: expected a positive number of bytes with an optional "
                         "K/M/G suffix, e.g. 8, 64K, 16M")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def parse_sizes(text: str | None, lo: int = 8, hi: int = 16 << 20) -> list[int]:
    """A comma list of sizes, or every power of two from ``lo`` to ``hi`` when ``text`` is None."""
    if text is None:
        return [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]
    return [parse_size(t) for t in text.split(",") if t.strip()]


def parse_ints(text: str, what: str) -> list[int]:
    """'1,32,128' -> [1, 32, 128]; every entry a positive integer (``what`` names the option)."""
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{what} {text!r}: expected a comma list of positive integers")
    return vals


def parse_dtype(text: str) -> torch.dtype:
    if text.lower() not in DTYPES:
        raise ValueError(f"dtype {text!r}: expected one of bfloat16, float16, float32")
    return DTYPES[text.lower()]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def add_run_arguments(p, *, iters: int, warmup: int) -> None:
    """The options every benchmark has: iterations, seed, output files, CPU, progress bar."""
    p.add_argument("--iters", type=int, default=iters,
                   help=f"timed iterations per case (default {iters})")
    p.add_argument("--warmup", type=int, default=warmup,
                   help=f"untimed iterations first (default {warmup})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", metavar="PATH",
                   help="write the run as a result file (bench/README.md)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the results")
    p.add_argument("--cpu", action="store_true",
                   help="run on CPU (2 gloo processes) even where GPUs are present")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def check_run_arguments(a, problems: list[str]) -> None:
    """Append a message to ``problems`` for each bad option of ``add_run_arguments``."""
    if a.iters < 1:
        problems.append("--iters must be at least 1")
    if a.warmup < 0:
        problems.append("--warmup must not be negative")


def write_outputs(result: dict, a) -> None:
    """Write ``--json`` and ``--plot`` where they were asked for, saying so."""
    if a.json:
        write_json(a.json, result)
        print(f"wrote {a.json}")
    if a.plot:
        from .plot import plot_results
        plot_results(result, a.plot)
        print(f"wrote {a.plot}")


def fmt_bytes(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# -- spawning -----------------------------------------------------------------------------------
def multicast_off() -> None:
    """Set the multicast-off variables in this process's environment (children inherit it)."""
    os.environ.update(MULTICAST_OFF_ENV)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan(force_cpu: bool = False) -> tuple[int, str]:
    """(world size, torch.distributed backend) that ``launch`` will use on this machine."""
    n = 0 if force_cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    return (n, "nccl") if n >= 2 else (CPU_WORLD_SIZE, "gloo")


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, cfg, out_path: str):
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


def launch(fn: Callable, cfg, *, force_cpu: bool = False):
    """Run ``fn(rank, world_size, cfg)`` in every rank (see the module doc); return rank 0's value.

    ``fn`` and ``cfg`` must be picklable (a module-level function, plain data). A rank that
    raises or dies makes the whole launch raise ``LaunchError`` (torch.multiprocessing terminates
    the others).
    """
    import torch.multiprocessing as mp

    multicast_off()
    world, backend = plan(force_cpu)
    fd, out_path = tempfile.mkstemp(prefix="llcomm-", suffix=".pkl")
    os.close(fd)
    try:
        mp.spawn(_entry, args=(world, free_port(), backend, fn, cfg, out_path), nprocs=world,
                 join=True)
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


def torch_symm_buffer(count: int, dtype: torch.dtype, device: torch.device):
    """A torch symmetric-memory buffer of ``count`` elements for torch's all-reduce ops
    (``symm_mem.empty`` + ``rendezvous`` on the world group; a collective).

    Returns ``(buffer, group_name, None)``, or ``(None, None, why)`` where this torch or any rank
    cannot make one (the caller reports it in place of the torch rows).
    """
    buf, name, why = None, None, None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        name = dist.group.WORLD.group_name
        buf = symm_mem.empty(count, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, name)
        for op in ("one_shot_all_reduce", "two_shot_all_reduce_"):
            getattr(torch.ops.symm_mem, op)  # raises where this torch lacks the op
    except Exception as e:  # noqa: BLE001 - reported as a row note, not fatal
        buf, why = None, short_error(e)
    if any_rank(buf is None, device):
        return None, None, why or "failed on another rank"
    return buf, name, None


# -- timing -------------------------------------------------------------------------------------
@dataclass
class Timing:
    """How to time: ``iters`` timed iterations after ``warmup`` of ``ops`` calls each."""
    device: torch.device
    iters: int
    warmup: int
    ops: int = GRAPH_OPS


@dataclass
class Stats:
    median_us: float
    p10_us: float
    p90_us: float


def slowest_rank_stats(per_iter_us: list[float], device: torch.device) -> Stats:
    """Max over ranks of each iteration's time, then median / p10 / p90. A collective."""
    t = torch.tensor(per_iter_us, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    a = t.cpu().numpy()
    return Stats(float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90)))


def time_eager(fn: Callable[[], object], t: Timing) -> Stats:
    """Per-op time of ``fn`` launched from Python, ``t.ops`` calls per iteration. A collective."""
    for _ in range(t.warmup * t.ops):
        fn()
    barrier(t.device)
    per: list[float] = []
    if t.device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(t.iters)]
        for start, end in events:
            start.record()
            for _ in range(t.ops):
                fn()
            end.record()
        torch.cuda.synchronize(t.device)
        per = [s.elapsed_time(e) * 1e3 / t.ops for s, e in events]
    else:
        for _ in range(t.iters):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(t.ops):
                fn()
            per.append((time.perf_counter() - t0) * 1e6 / t.ops)
    return slowest_rank_stats(per, t.device)


def capture(fn: Callable[[], object], ops: int) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``ops`` back-to-back calls of ``fn`` (warmed up on the capture stream
    first, so no compilation or lazy initialisation happens inside the capture). Not a collective
    by itself, but ``fn`` is: every rank calls it once here."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn()
    torch.cuda.synchronize()
    return graph


def time_graph(graph: "torch.cuda.CUDAGraph", t: Timing) -> Stats:
    """Per-op time of replays of ``graph`` (which holds ``t.ops`` ops). A collective."""
    for _ in range(t.warmup):
        graph.replay()
    barrier(t.device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(t.iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(t.device)
    return slowest_rank_stats([s.elapsed_time(e) * 1e3 / t.ops for s, e in events], t.device)


# -- one thing to time, in each of its modes -----------------------------------------------------
@dataclass
class Impl:
    """One implementation to time in one case. ``fn`` runs it once (a collective: every rank
    calls it; one op, or one whole decode step)."""
    impl: str                                    # llcomm, reference, nccl, torch_one_shot, ...
    algo: str                                    # the algorithm that runs
    fn: Callable[[], object] | None
    reset: Callable[[], object] | None = None    # restore inputs, poison outputs
    check: Callable[[], int] | None = None       # wrong elements in the current result
    raise_errors: Callable[[], object] | None = None  # raise what the device reported (.check())
    modes: tuple = ("graph", "eager")
    error: str | None = None                     # set: not runnable here, report why
    extra: dict = field(default_factory=dict)    # keys added to every row of this impl


def time_impl(impl: Impl, row: dict, t: Timing) -> list[dict]:
    """Time ``impl`` in each of its modes (graph only on GPUs); one result row per mode: ``row``
    plus impl, algo, mode, median_us / p10_us / p90_us, ``wrong`` (summed over ranks; None
    without a check) and ``error`` where it failed. A collective.

    Per mode: reset, one call, check -> (graph: capture ``t.ops`` calls) -> reset, timed loop,
    check. Every step is agreed between ranks, so one rank's failure ends the mode on all.
    """
    rows = []
    for mode in impl.modes:
        if mode == "graph" and t.device.type != "cuda":
            continue
        r = {**row, "impl": impl.impl, "algo": impl.algo, "mode": mode, "median_us": None,
             "p10_us": None, "p90_us": None, "wrong": None, **impl.extra}
        rows.append(r)
        if impl.fn is None:
            r["error"] = impl.error
            continue
        err, wrong, state = [None], [0], {}

        def checked():
            if impl.raise_errors:
                impl.raise_errors()
            if impl.check:
                wrong[0] += impl.check()

        def first_call():
            if impl.reset:
                impl.reset()
            impl.fn()
            checked()

        def capture_it():
            state["graph"] = capture(impl.fn, t.ops)

        def timed():
            if impl.reset:
                impl.reset()
            state["stats"] = (time_graph(state["graph"], t) if mode == "graph"
                              else time_eager(impl.fn, t))
            checked()

        ok = attempt(first_call, err, t.device)
        if ok and mode == "graph":
            ok = attempt(capture_it, err, t.device)
        if ok:
            ok = attempt(timed, err, t.device)
        state.pop("graph", None)
        if impl.check:
            r["wrong"] = sum_over_ranks(wrong[0], t.device)
        if ok:
            s = state["stats"]
            r.update(median_us=s.median_us, p10_us=s.p10_us, p90_us=s.p90_us)
        else:
            r["error"] = err[0]
    return rows


# -- correctness oracles --------------------------------------------------------------------------
def gather_inputs(x: torch.Tensor) -> torch.Tensor:
    """``[world_size, *x.shape]``: every rank's ``x``, by torch.distributed all_gather (a list
    all_gather, which every backend has). A collective."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.stack(parts)


def gather_bytes(t: torch.Tensor) -> torch.Tensor:
    """``gather_inputs`` moving raw bytes (gloo moves no 16-bit types). A collective."""
    return gather_inputs(t.contiguous().view(torch.uint8)).view(t.dtype)


def rank_order_sum(stack: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum over dim 0 in fp32, rank 0 first, rounded once to ``dtype``: the peer backend's
    reduction, so its results must match this bit for bit."""
    acc = stack[0].float().clone()
    for r in range(1, stack.shape[0]):
        acc += stack[r].float()
    return acc.to(dtype)


def sum_bound(stack: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise error bound of any summation order of ``stack`` rounded to ``dtype``:
    ``(W + 1) * eps * sum |x_r|`` plus the smallest normal (for the reference backend, whose
    reduction order is NCCL's or gloo's own)."""
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    return (stack.shape[0] + 1) * eps * stack.double().abs().sum(0) + tiny


def count_wrong(out: torch.Tensor, expected: torch.Tensor,
                bound: torch.Tensor | None = None) -> int:
    """Elements of ``out`` that differ from ``expected``: bit for bit when ``bound`` is None,
    else by more than ``bound`` from ``expected`` (the exact sum, any float dtype). NaN (the
    poison) is always wrong."""
    if bound is None:
        iv = _INT_VIEW[out.element_size()]
        return int((out.reshape(-1).view(iv) != expected.reshape(-1).view(iv)).sum().item())
    err = (out.double() - expected.double()).abs()
    return int((~(err <= bound)).sum().item())


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN, so a result that was never written is counted wrong."""
    return t.fill_(float("nan"))


# -- result metadata ------------------------------------------------------------------------------
def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the tree llcomm is imported from. ``LLCOMM_COMMIT`` overrides the
    commit (for a copied tree without .git); dirty counts tracked files only."""
    repo = str(Path(__file__).resolve().parents[2])
    sha = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    given = BenchSettings.read().commit
    if given and not (sha and sha.strip().startswith(given)):
        return given, None          # a copied tree: its state is not known here
    commit = sha.strip() if sha else None
    return commit, (bool(status.strip()) if status is not None else None)


def nvidia_topo() -> str | None:
    """``nvidia-smi topo -m`` output, or None where nvidia-smi is absent or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    return _run(["nvidia-smi", "topo", "-m"])


def topo_link(topo: str | None, i: int, j: int) -> str | None:
    """The entry of ``nvidia-smi topo -m`` between GPU i and GPU j (e.g. 'NV18', 'PIX')."""
    if not topo:
        return None
    for line in topo.splitlines():
        cells = line.split()
        # the row of GPU i has "X" on its own column (the underlined header row does not)
        if (cells and re.sub(r"\x1b\[[0-9;]*m", "", cells[0]) == f"GPU{i}"
                and len(cells) > max(i, j) + 1 and cells[i + 1] == "X"):
            return cells[j + 1]
    return None


def machine_string(world: int, device: torch.device) -> str:
    """'2xH200 NV18' from the GPU names and the link between GPU 0 and 1; '2xCPU gloo' on CPU."""
    if device.type != "cuda":
        return f"{world}xCPU gloo"
    names = [torch.cuda.get_device_name(i).removeprefix("NVIDIA ").strip() for i in range(world)]
    base = f"{world}x{names[0]}" if len(set(names)) == 1 else "+".join(names)
    link = topo_link(nvidia_topo(), 0, 1) if world >= 2 else None
    return f"{base} {link}" if link else base


def versions() -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - absent or broken: recorded as None
        out["triton"] = None
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        out["nccl"] = None
    out["cuda"] = torch.version.cuda
    return out


def result_header(world: int, device: torch.device) -> dict:
    """The keys of a result file (docs/DESIGN "Result files") other than ``rows``."""
    commit, dirty = git_state()
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith("LLCOMM_") or k in MULTICAST_OFF_ENV}
    from llcomm.runtime import launch, settings
    return {"commit": commit, "dirty": dirty, "machine": machine_string(world, device),
            "date": datetime.date.today().isoformat(), "versions": versions(),
            "world_size": world, "env": env,
            "pdl": launch.pdl_enabled(device, settings.value("LLCOMM_PDL"))}


def write_json(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


# -- display --------------------------------------------------------------------------------------
class _NoProgress:
    def advance(self, text: str = "") -> None:
        pass


#: Without a terminal (a log file, the GPU machine's output), progress is a plain line at each
#: tenth of the work: a live bar writes nothing there, and a run killed by a timeout would
#: otherwise leave no trace of how far it got.
LOG_LINES = 10


class _LogLines:
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done, self.t0 = max(total, 1), desc, 0, time.perf_counter()
        self.next_at = self.total / LOG_LINES

    def advance(self, text: str = "") -> None:
        self.done += 1
        if self.done >= self.next_at or self.done == self.total:
            self.next_at += self.total / LOG_LINES
            print(f"{self.desc}: {self.done}/{self.total} {text} "
                  f"({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress(total: int, desc: str, enabled: bool = True):
    """A progress bar on stderr (rich, else tqdm, else nothing; plain lines without a terminal);
    yields ``.advance(text)``, one call per unit of ``total``."""
    if not enabled:
        yield _NoProgress()
        return
    if not sys.stderr.isatty():
        yield _LogLines(total, desc)
        return
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        Progress = None
    if Progress is not None:
        with Progress(console=Console(stderr=True), transient=True) as p:
            task = p.add_task(desc, total=total)

            class _Rich:
                def advance(self, text: str = "") -> None:
                    p.update(task, advance=1, description=f"{desc} {text}")
            yield _Rich()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield _NoProgress()
        return
    with tqdm(total=total, desc=desc, file=sys.stderr, leave=False) as bar:
        class _Tqdm:
            def advance(self, text: str = "") -> None:
                bar.set_postfix_str(text)
                bar.update(1)
        yield _Tqdm()


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    """A rich table on a terminal, plain right-aligned columns otherwise (pipes, logs, tests)."""
    try:
        from rich.console import Console
        from rich.table import Table
        console = Console()
        rich_ok = console.is_terminal
    except ImportError:
        rich_ok = False
    if rich_ok:
        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(*r)
        console.print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    print(f"# {title}")
    print("# " + "  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))


def fmt_us(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"
