"""``llcomm bench link``: how fast the GPUs of this host move bytes to each other.

Needs two or more CUDA GPUs with peer access (one process per GPU, NCCL); elsewhere it says so
and exits with status 2. Each GPU's buffers are peer-mapped with torch symmetric memory. Per
size, three ways of moving ``size`` bytes to or from a neighbour GPU:

- ``copy_engine``: ``Tensor.copy_`` into the peer's buffer (a peer ``cudaMemcpyAsync``, done by
  the copy engines, no SMs);
- ``sm_push``: a kernel's stores into the peer's memory (how llcomm's kernels move data), one
  block per SM (``--blocks``), 16-byte vectors;
- ``sm_pull``: a kernel's loads from the peer's memory into local memory.

and two patterns: ``one`` (GPU 0 alone moves data, to / from GPU 1; the others launch an empty
kernel) and ``all`` (every GPU r at once, to / from GPU (r + 1) mod W: with two GPUs both
directions of the link are busy). Each is timed as a CUDA graph of ``--graph-ops`` launches
(``bench.timing``: slowest rank per iteration, median), and GB/s = size / time is per
direction. The bytes are checked where they land: destination buffers are poisoned before the
first call and before the timed loop, and must hold the sender's pattern after both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import console, options, result_files, spawn, timing
from .timing import Impl

DEFAULT_SIZES = "64K,1M,8M,64M"
DEFAULT_ITERS = 20
DEFAULT_WARMUP = 3
#: Launches per CUDA graph (one timed iteration).
GRAPH_OPS = 10
WAYS = ("copy_engine", "sm_push", "sm_pull")
PATTERNS = ("one", "all")
#: Warps per block of the SM ways; each thread moves one 16-byte vector per step.
WARPS = 8
#: Word a destination holds before anything arrived (no sender's pattern contains it).
POISON = -1
#: Sizes must be a multiple of this (the SM ways move 16-byte vectors).
SIZE_ALIGN = 16


@dataclass
class Config:
    sizes: list[int]
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    graph_ops: int = GRAPH_OPS
    blocks: int = 0             # 0: one per SM
    progress: bool = True


def active(pattern: str, rank: int) -> bool:
    """Whether ``rank`` moves data in ``pattern`` (else it launches an empty kernel)."""
    return pattern == "all" or rank == 0


def sender_of(way: str, pattern: str, rank: int, world: int) -> int | None:
    """The rank whose words ``rank``'s destination buffer holds after ``way`` in ``pattern``,
    or None where nothing lands there. A push (``copy_engine``, ``sm_push``) writes into the
    next rank's buffer; a pull (``sm_pull``) reads the next rank's into its own."""
    if way == "sm_pull":
        return (rank + 1) % world if active(pattern, rank) else None
    prev = (rank - 1) % world
    return prev if active(pattern, prev) else None


def pattern_of(rank: int, n: int, device) -> torch.Tensor:
    """The int32 words rank ``rank`` sends: non-negative (never POISON), and for up to 2 GiB
    distinct per position and, among 4 consecutive ranks, per rank."""
    return ((torch.arange(n, dtype=torch.int64, device=device) * 4 + rank) % (1 << 31)).to(
        torch.int32)


class Rank:
    def __init__(self, rank: int, world: int, cfg: Config):
        from llcomm.runtime.workspace import SymmetricWorkspace

        from .link_kernel import move

        self.rank, self.world, self.cfg = rank, world, cfg
        self.device = torch.device("cuda", rank)
        self.timing = timing.Timing(self.device, cfg.iters, cfg.warmup, cfg.graph_ops)
        top = max(cfg.sizes)
        self.ws = SymmetricWorkspace(dist.group.WORLD, {"src": top, "dst": top}, self.device)
        words = top // 4
        self.src = self.ws.local("src", torch.int32)
        self.src.copy_(pattern_of(rank, words, self.device))
        self.dst = self.ws.local("dst", torch.int32)
        self.next = (rank + 1) % world

        def peer(name: str) -> torch.Tensor:
            return self.ws.handle.get_buffer(self.next, (words,), torch.int32,
                                             self.ws.offsets[name] // 4)
        self.next_src, self.next_dst = peer("src"), peer("dst")
        self.blocks = cfg.blocks or torch.cuda.get_device_properties(rank).multi_processor_count
        self.move = move
        torch.cuda.synchronize(self.device)
        dist.barrier(device_ids=[rank])

    def impl(self, way: str, pattern: str, nbytes: int) -> Impl:
        """One way in one pattern: its call, and the check of where its bytes land."""
        n = nbytes // 4
        block = WARPS * 32 * 4
        if not active(pattern, self.rank):
            def fn():
                self.move[(1,)](self.src, self.dst, 0, BLOCK=block, num_warps=WARPS)
        elif way == "copy_engine":
            def fn():
                self.next_dst[:n].copy_(self.src[:n])
        else:
            src, dst = ((self.src, self.next_dst) if way == "sm_push"
                        else (self.next_src, self.dst))

            def fn():
                self.move[(self.blocks,)](src, dst, n, BLOCK=block, num_warps=WARPS)
        sender = sender_of(way, pattern, self.rank, self.world)
        want = None if sender is None else pattern_of(sender, n, self.device)

        def reset():
            self.dst[:n].fill_(POISON)
            spawn.barrier(self.device)          # poisoned everywhere before anyone sends

        def check() -> int:
            spawn.barrier(self.device)          # every sender finished
            if want is None:
                return 0
            return int((self.dst[:n] != want).sum())
        return Impl(way, pattern, fn, reset=reset, check=check, modes=("graph",),
                    extra={"way": way, "pattern": pattern})

    def close(self) -> None:
        self.ws.close()


def rank_main(rank: int, world: int, cfg: Config):
    """One rank of ``llcomm bench link``: rank 0 returns the result."""
    R = Rank(rank, world, cfg)
    rows = []
    cases = [(s, w, p) for s in cfg.sizes for w in WAYS for p in PATTERNS]
    with console.progress(len(cases), "bench link", enabled=rank == 0 and cfg.progress) as bar:
        for nbytes, way, pattern in cases:
            base = {"op": "link", "dtype": "int32", "world_size": world, "bytes": nbytes}
            for r in timing.time_impl(R.impl(way, pattern, nbytes), base, R.timing):
                r["gbps"] = nbytes / (r["median_us"] * 1e3) if r["median_us"] else None
                rows.append(r)
            bar.advance(f"{console.fmt_bytes(nbytes)} {way} {pattern}")
    R.close()
    if rank != 0:
        return None
    topo = result_files.nvidia_topo()
    links = {f"{r}-{(r + 1) % world}": result_files.topo_link(topo, r, (r + 1) % world)
             for r in range(world)}
    return {**result_files.result_header(world, R.device), "bench": "link", "iters": cfg.iters,
            "warmup": cfg.warmup, "graph_ops": cfg.graph_ops, "blocks": R.blocks,
            "warps": WARPS, "links": links, "rows": rows}


# -- report ------------------------------------------------------------------------------------
HEADERS = ["bytes", "way", "one µs", "one GB/s", "all µs", "all GB/s", "#wrong"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    lines: dict = {}
    for r in rows:
        lines.setdefault((r["bytes"], r["way"]), {})[r["pattern"]] = r

    def cells(r):
        if r is None:
            return ["-", "-"]
        if r.get("error"):
            return ["err", "-"]
        return [console.fmt_us(r["median_us"]), f"{r['gbps']:.1f}" if r["gbps"] else "-"]
    out = []
    for (nbytes, way), by in lines.items():
        wrongs = [r["wrong"] for r in by.values() if r.get("wrong") is not None]
        out.append([console.fmt_bytes(nbytes), way, *cells(by.get("one")),
                    *cells(by.get("all")), str(sum(wrongs)) if wrongs else "-"])
    return out


def print_result(result: dict) -> None:
    world = result["world_size"]
    links = ", ".join(f"GPU{k.replace('-', '-GPU')} {v}" for k, v in result["links"].items()
                      if v) or "link types unknown (no nvidia-smi)"
    print(f"# llcomm bench link: {result['machine']}, {world} GPUs; {links}")
    print(f"# one: GPU0 alone, to / from GPU1; all: every GPU r at once, to / from GPU (r+1) mod "
          f"{world}. GB/s per direction; CUDA graph of {result['graph_ops']} launches, slowest "
          f"rank, median of {result['iters']}; SM ways {result['blocks']} blocks x "
          f"{result['warps']} warps")
    console.print_table("link bandwidth", HEADERS, table_rows(result["rows"]))
    for r in result["rows"]:
        if r.get("error"):
            print(f"# note: {r['way']} {r['pattern']} at {console.fmt_bytes(r['bytes'])}: "
                  f"{r['error']}")


# -- command line -------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"comma list of byte sizes with K/M suffixes, each a multiple of "
                        f"{SIZE_ALIGN} (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=DEFAULT_ITERS,
                   help=f"timed graph replays per case (default {DEFAULT_ITERS})")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help=f"untimed replays first (default {DEFAULT_WARMUP})")
    p.add_argument("--graph-ops", type=int, default=GRAPH_OPS,
                   help=f"launches per CUDA graph (default {GRAPH_OPS})")
    p.add_argument("--blocks", type=int, default=0,
                   help="blocks of the SM ways (default: one per SM)")
    p.add_argument("--json", metavar="PATH", help="write the run as a result file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    options.add_no_multicast_argument(p)


def config_from_args(a) -> Config:
    """Validate every argument; raise one ValueError naming each bad one."""
    problems: list[str] = []
    sizes: list[int] = []
    try:
        sizes = options.parse_sizes(a.sizes)
        bad = [s for s in sizes if s % SIZE_ALIGN]
        if bad or not sizes:
            problems.append(f"--sizes {a.sizes!r}: every size must be a positive multiple of "
                            f"{SIZE_ALIGN} bytes")
    except ValueError as e:
        problems.append(f"--sizes: {e}")
    if a.graph_ops < 1:
        problems.append("--graph-ops must be at least 1")
    if a.blocks < 0:
        problems.append("--blocks must not be negative (0: one per SM)")
    options.check_run_arguments(a, problems)
    if problems:
        raise ValueError("; ".join(problems))
    return Config(sizes=sizes, iters=a.iters, warmup=a.warmup, graph_ops=a.graph_ops,
                  blocks=a.blocks, progress=not a.no_progress)


def unavailable() -> str | None:
    """Why this host cannot run the probe, or None."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return (f"needs two or more CUDA GPUs with peer access; this host has "
                f"{n if n else 'no'} CUDA GPU{'' if n == 1 else 's'}")
    for r in range(n):
        if not torch.cuda.can_device_access_peer(r, (r + 1) % n):
            return (f"GPU {r} cannot access GPU {(r + 1) % n} as a peer (no P2P/NVLink path); "
                    "`llcomm doctor` shows the peer-access matrix")
    return None


def run(a) -> int:
    """``llcomm bench link``: exit status 2 where it cannot run, 1 if bytes arrived wrong or a
    way failed."""
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        print(f"llcomm bench link: {e}")
        return 2
    why = unavailable()
    if why:
        print(f"llcomm bench link: {why}")
        return 2
    result = spawn.launch(rank_main, cfg, multicast_off=a.no_multicast)
    print_result(result)
    if a.json:
        result_files.write_json(a.json, result)
        print(f"wrote {a.json}")
    bad = [r for r in result["rows"] if r.get("error") or (r["wrong"] or 0) > 0]
    if bad:
        print(f"llcomm bench link: {len(bad)} rows are wrong or failed")
    return 1 if bad else 0
