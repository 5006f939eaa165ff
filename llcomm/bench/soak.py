"""``llcomm bench soak``: many random ops, every result checked, then a replayed CUDA graph.

Two processes (one per GPU, peer backend by ``auto``; or two gloo processes on CPU, reference
backend, small counts) run the same random sequence of ``--ops`` ops: every all_reduce algorithm,
broadcast, all_gather, all_gather_2d and reduce_scatter at a random size and dtype, and an EP
dispatch + combine every ``--ep-every`` ops. Then (GPU only) ``--graph-ops`` mixed ops are
captured in one CUDA graph, checks included, and replayed ``--replays`` times on fresh inputs.
Then ``--ep-sequences`` random legal EP call sequences per API (``EPBuffer`` and
``llcomm.deep_ep``; ``ep_sequences``: one or two dispatches before a combine, handles combined
twice, zero copy, hooks, FP8 / round_scale / UE8M0, carried weights, sleeps on one rank), every
dispatch and combine checked by ``ep_seqrun`` against its oracle.

The oracle needs no communication: every rank's input is a slice of a random pool that every
rank generates identically, so each rank computes every expected result locally (sums in fp32
in rank order, rounded once: the peer backend must match bit for bit; the reference backend's
own summation order is held to a summation-error bound; movement and EP dispatch byte for byte;
EP combine by the documented order, docs/ep.md). Outputs are poisoned (NaN) before each op.
Checks stay on the device: each op adds its count of wrong elements to a device counter, which
the host reads once per ``--check-every`` ops (with ``check()``), so 100,000 ops take minutes.

A timeout or mismatch is counted and ends the phase (the communicator is broken after it);
exit status 1 if anything was wrong or failed.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from . import console, options, result_files, spawn, verify

TP_KINDS = ("one_shot", "two_shot", "lamport", "broadcast", "all_gather", "all_gather_2d",
            "reduce_scatter")
KINDS = TP_KINDS + ("dispatch", "combine")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Default op counts: GPU (peer) and CPU (gloo reference, slow per op).
GPU_OPS, CPU_OPS = 100_000, 2_000
#: Largest operand, in elements, of the eager phase (GPU / CPU) and of the graph.
GPU_MAX_ELEMS, CPU_MAX_ELEMS, GRAPH_MAX_ELEMS = 1 << 18, 1 << 12, 1 << 14
#: Communicator workspace: the largest operand in any dtype fits.
MAX_BYTES = 4 * GPU_MAX_ELEMS
#: Lamport runs up to this many bytes (its slot size on the peer backend).
LAMPORT_MAX_BYTES = 1 << 20
#: EP shapes of the soak's EPBuffer (small: the soak is about the protocol, not bandwidth).
EP_EXPERTS_PER_RANK, EP_HIDDEN, EP_TOKENS, EP_TOPK = 4, 128, 16, 4
#: all_gather_2d operands have at most this many rows.
MAX_ROWS = 64
#: Wait bound of the soak's objects (ms): generous, the soak measures correctness.
SOAK_TIMEOUT_MS = 5000
#: Random EP sequences per API by default (GPU / CPU), their shape (hidden a multiple of 512:
#: UE8M0), largest top-k, and largest sleep of the slow rank (s, far below the wait bound).
GPU_SEQUENCES, CPU_SEQUENCES = 200, 4
SEQ_EXPERTS_PER_RANK, SEQ_HIDDEN, SEQ_TOKENS, SEQ_TOPK, SEQ_MAX_DELAY_S = 4, 512, 8, 4, 0.05


@dataclass
class SoakConfig:
    ops: int
    graph_ops: int
    replays: int
    ep_every: int
    check_every: int
    seed: int
    backend: str
    max_elems: int
    ep_sequences: int = 0
    progress: bool = True
    counts: dict = field(default_factory=dict)


class _Checker:
    """Device-side counters of wrong elements per kind; no host sync until ``read``."""

    def __init__(self, device: torch.device, exact_sums: bool):
        self.wrong = torch.zeros(len(KINDS), dtype=torch.int64, device=device)
        self.exact_sums = exact_sums

    def bits(self, kind: str, got: torch.Tensor, want: torch.Tensor) -> None:
        iv = verify.INT_VIEW[got.element_size()]
        bad = (got.reshape(-1).view(iv) != want.reshape(-1).view(iv)).sum()
        self.wrong[KINDS.index(kind)].add_(bad)

    def sum(self, kind: str, got: torch.Tensor, stack: torch.Tensor) -> None:
        """``got`` is the sum over dim 0 of ``stack`` (or a slice: see reduce_scatter)."""
        if self.exact_sums:
            self.bits(kind, got, verify.rank_order_sum(stack, got.dtype))
            return
        err = (got.double() - stack.double().sum(0)).abs()
        self.wrong[KINDS.index(kind)].add_((~(err <= verify.sum_bound(stack, got.dtype))).sum())

    def read(self) -> list[int]:
        return [int(v) for v in self.wrong.tolist()]


class _Pool:
    """Every rank's operands: ``[world, P]`` random values per dtype, identical on every rank
    (one seeded generator), so any rank can compute any expected result."""

    def __init__(self, world: int, size: int, device: torch.device, seed: int):
        self.world, self.size, self.device = world, size, device
        self.f32 = torch.empty((world, size), dtype=torch.float32, device=device)
        self.by_dtype = {d: torch.empty((world, size), dtype=d, device=device) for d in DTYPES}
        self.refresh(seed)

    def refresh(self, seed: int) -> None:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        self.f32.normal_(generator=g)
        for d, t in self.by_dtype.items():
            t.copy_(self.f32)

    def stack(self, dtype, offset: int, n: int) -> torch.Tensor:
        """``[world, n]`` view: row r is rank r's operand."""
        return self.by_dtype[dtype][:, offset:offset + n]


def _spec(rng: random.Random, world: int, max_elems: int, lamport_ok) -> tuple:
    """One random TP op: (kind, dtype, n, rows, offset). Every rank draws the same sequence."""
    kind = rng.choice(TP_KINDS)
    dtype = rng.choice(DTYPES)
    n = max(1, int(2 ** rng.uniform(0, max_elems.bit_length() - 1)))
    rows = 1
    if kind == "reduce_scatter":
        n = max(world, n - n % world)
    elif kind == "all_gather_2d":
        rows = rng.randint(1, min(MAX_ROWS, n))
        n = rows * max(1, n // rows)
    if kind == "lamport" and not lamport_ok(n * dtype.itemsize):
        kind = "one_shot"
    offset = rng.randrange(0, max_elems - n + 1)
    return kind, dtype, n, rows, offset


def _run_tp(comm, spec, pool: _Pool, rank: int, world: int, chk: _Checker) -> None:
    """Poison, run, and check (on the device) one TP op."""
    kind, dtype, n, rows, offset = spec
    stack = pool.stack(dtype, offset, n)
    x = stack[rank]
    if kind in ("one_shot", "two_shot", "lamport"):
        out = torch.full_like(x, float("nan"))
        comm.all_reduce(x, out=out, algo=kind)
        chk.sum(kind, out, stack)
    elif kind == "broadcast":
        src = offset % world
        y = torch.empty_like(x)
        if rank == src:
            y.copy_(x)
        else:
            y.fill_(float("nan"))
        comm.broadcast(y, src)
        chk.bits(kind, y, stack[src])
    elif kind == "all_gather":
        out = torch.full((world * n,), float("nan"), dtype=dtype, device=x.device)
        comm.all_gather(x, out=out)
        chk.bits(kind, out, stack.reshape(-1))
    elif kind == "all_gather_2d":
        part = n // rows
        out = torch.full((rows, world * part), float("nan"), dtype=dtype, device=x.device)
        comm.all_gather_2d(x.view(rows, part), out=out)
        chk.bits(kind, out, stack.view(world, rows, part).transpose(0, 1).reshape(rows, -1))
    else:
        m = n // world
        out = torch.full((m,), float("nan"), dtype=dtype, device=x.device)
        comm.reduce_scatter(x, out=out)
        chk.sum(kind, out, stack[:, rank * m:(rank + 1) * m])


def _run_ep(buf, i: int, seed: int, pool: _Pool, rank: int, world: int, chk: _Checker) -> None:
    """One dispatch + combine (experts = identity) against a local oracle of every rank."""
    E, H, T, K = buf.num_experts, buf.hidden, buf.max_tokens, EP_TOPK
    L, dev, dt = buf.num_local_experts, buf.device, buf.dtype
    # drawn on the host: the same numbers whatever the device
    g = torch.Generator(device="cpu").manual_seed(seed * 7919 + i)
    ns = torch.randint(0, T + 1, (world,), generator=g, device="cpu", dtype=torch.int64).tolist()
    idx = [torch.randint(-1, E, (ns[s], K), generator=g, device="cpu", dtype=torch.int64)
           for s in range(world)]
    w = torch.rand(ns[rank], K, generator=g, device="cpu", dtype=torch.float32)
    off = (i * 31) % (pool.size // H - T)
    xs = pool.by_dtype[dt][:, off * H:(off + T) * H].reshape(world, T, H)
    # expected rows of each local expert: pairs (s, t) routed to it, by s then t
    counts, e_ix, j_ix, st_ix = [0] * L, [], [], []
    for e in range(L):
        for s in range(world):
            hit = (idx[s] == rank * L + e).any(1).nonzero().flatten().tolist()
            for t in hit:
                e_ix.append(e)
                j_ix.append(counts[e])
                st_ix.append(s * T + t)
                counts[e] += 1
    recv_x, recv_count, handle = buf.dispatch(xs[rank, :ns[rank]], idx[rank].to(dev))
    chk.bits("dispatch", recv_count, torch.tensor(counts, dtype=torch.int32, device=dev))
    if e_ix:
        got = recv_x[torch.tensor(e_ix, dtype=torch.int64, device=dev),
                     torch.tensor(j_ix, dtype=torch.int64, device=dev)]
        src = torch.tensor(st_ix, dtype=torch.int64, device=dev)
        chk.bits("dispatch", got, xs.reshape(world * T, H)[src])
    out = torch.full((ns[rank], H), float("nan"), dtype=dt, device=dev)
    mine, wd = idx[rank].to(dev), w.to(dev)
    buf.combine(recv_x, mine, wd, handle, out=out)
    # oracle: per expert rank q, fold w_k * x over its entries in k order (fp32), round once;
    # then the partials in rank order (fp32), round once (docs/ep.md)
    x = xs[rank, :ns[rank]].float()
    dest = torch.where(mine >= 0, mine // L, -1)
    total = torch.zeros_like(x)
    for q in range(world):
        acc = torch.zeros_like(x)
        for k in range(K):
            acc = torch.where((dest[:, k] == q).unsqueeze(1), acc + wd[:, k:k + 1] * x, acc)
        went = (dest == q).any(1, keepdim=True)
        total = torch.where(went, total + acc.to(dt).float(), total)
    chk.bits("combine", out, total.to(dt))


def rank_main(rank: int, world: int, cfg: SoakConfig) -> dict:
    import llcomm
    from llcomm.ep import EPBuffer

    comm = llcomm.Communicator(max_bytes=MAX_BYTES, backend=cfg.backend,
                               timeout_ms=SOAK_TIMEOUT_MS)
    device = comm.device
    on_gpu = device.type == "cuda"
    buf = EPBuffer(num_experts=EP_EXPERTS_PER_RANK * world, hidden=EP_HIDDEN,
                   num_max_dispatch_tokens_per_rank=EP_TOKENS, backend=cfg.backend,
                   timeout_ms=SOAK_TIMEOUT_MS)
    peer = comm.backend == "peer"
    lamport_max = comm.lamport_bytes if peer else LAMPORT_MAX_BYTES

    def lamport_ok(nbytes):
        return nbytes <= lamport_max

    chk = _Checker(device, exact_sums=peer)
    pool = _Pool(world, cfg.max_elems, device, cfg.seed)
    rng = random.Random(cfg.seed)
    counts = dict.fromkeys(KINDS, 0)
    failures: list[str] = []
    t0 = time.perf_counter()
    done = 0
    checks = -(-cfg.ops // cfg.check_every)  # the bar advances once per check
    with console.progress(checks, "soak", enabled=cfg.progress and rank == 0) as bar:
        try:
            for i in range(cfg.ops):
                if cfg.ep_every and i % cfg.ep_every == cfg.ep_every - 1:
                    _run_ep(buf, i, cfg.seed, pool, rank, world, chk)
                    counts["dispatch"] += 1
                    counts["combine"] += 1
                else:
                    spec = _spec(rng, world, cfg.max_elems, lamport_ok)
                    _run_tp(comm, spec, pool, rank, world, chk)
                    counts[spec[0]] += 1
                done += 1
                if done % cfg.check_every == 0 or done == cfg.ops:
                    comm.check()
                    buf.check()
                    bar.advance(f"{done} ops, {sum(chk.read())} wrong")
        except llcomm.LLCommError as e:
            failures.append(f"eager op {done}: {type(e).__name__}: {e}")
    eager_s = time.perf_counter() - t0
    wrong_eager = chk.read()

    seqs = {"run": 0, "dispatches": 0, "combines": 0, "failed": 0}
    if cfg.ep_sequences and not failures:
        seqs = _sequence_phase(rank, world, cfg, device, failures)
    graph = {"ops": 0, "replays": 0, "wrong": 0, "seconds": 0.0}
    if on_gpu and peer and cfg.graph_ops and cfg.replays and not failures:
        graph = _graph_phase(comm, rank, world, cfg, device, lamport_ok, failures)
    result = {"rank": rank, "eager_ops": done, "eager_seconds": eager_s, "counts": counts,
              "wrong": wrong_eager, "failures": failures, "graph": graph, "sequences": seqs,
              "backend": comm.backend, "device": str(device)}
    if not failures:
        comm.close()
        buf.close()
    return _gather_reports(result, world, device)


def _sequence_phase(rank, world, cfg, device, failures) -> dict:
    """``cfg.ep_sequences`` random EP sequences per API, each on its own buffer; a failed
    sequence is reported in ``failures`` (an error ends its API's run: the buffer is broken)."""
    import llcomm
    import llcomm.deep_ep as deep_ep
    from llcomm.ep import EPBuffer

    from . import ep_sequences as S
    from .ep_seqrun import SequenceRunner
    E = SEQ_EXPERTS_PER_RANK * world
    got = {"run": 0, "dispatches": 0, "combines": 0, "failed": 0}
    for api in S.APIS:
        if api == "ep":
            buf = EPBuffer(num_experts=E, hidden=SEQ_HIDDEN,
                           num_max_dispatch_tokens_per_rank=SEQ_TOKENS, backend=cfg.backend,
                           timeout_ms=SOAK_TIMEOUT_MS)
        else:
            buf = deep_ep.Buffer(None, backend=cfg.backend, timeout_ms=SOAK_TIMEOUT_MS)
        run = SequenceRunner(buf, rank, world, num_experts=E, dtype=torch.bfloat16,
                             device=device)
        try:
            for i in range(cfg.ep_sequences):
                seed = cfg.seed * 1_000_003 + i
                fails = run.run(S.generate(seed, api=api, world=world, max_tokens=SEQ_TOKENS,
                                           hidden=SEQ_HIDDEN, num_experts=E, max_topk=SEQ_TOPK,
                                           max_delay_s=SEQ_MAX_DELAY_S))
                got["run"] += 1
                if fails:
                    got["failed"] += 1
                    failures.append(f"{api} sequence {seed}: {fails[0]}"
                                    + (f" (and {len(fails) - 1} more)" if len(fails) > 1 else ""))
        except llcomm.LLCommError as e:
            got["failed"] += 1
            failures.append(f"{api} sequences: {type(e).__name__}: {e}")
            continue
        finally:
            got["dispatches"] += run.dispatches
            got["combines"] += run.combines
        (buf.close if api == "ep" else buf.destroy)()
    return got


def _graph_phase(comm, rank, world, cfg, device, lamport_ok, failures) -> dict:
    """Capture ``graph_ops`` mixed TP ops with their checks; replay on fresh pool contents."""
    import llcomm

    chk = _Checker(device, exact_sums=True)
    pool = _Pool(world, GRAPH_MAX_ELEMS, device, cfg.seed + 1)
    rng = random.Random(cfg.seed + 1)
    specs = [_spec(rng, world, GRAPH_MAX_ELEMS, lamport_ok) for _ in range(cfg.graph_ops)]

    def ops():
        for s in specs:
            _run_tp(comm, s, pool, rank, world, chk)

    t0 = time.perf_counter()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops()  # warm-up: compiles every specialisation outside the capture (checked too)
        torch.cuda.current_stream().wait_stream(side)
        comm.check()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ops()
        for r in range(cfg.replays):
            pool.refresh(cfg.seed * 1_000_003 + r)
            g.replay()
        comm.check()
    except llcomm.LLCommError as e:
        failures.append(f"graph: {type(e).__name__}: {e}")
    torch.cuda.synchronize()
    return {"ops": cfg.graph_ops, "replays": cfg.replays, "wrong": sum(chk.read()),
            "seconds": time.perf_counter() - t0}


def _gather_reports(result: dict, world: int, device) -> dict | None:
    """Rank 0 gets every rank's report (all_gather_object, a collective)."""
    import torch.distributed as dist
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if result["rank"] != 0:
        return None
    return {"ranks": everyone, "header": result_files.result_header(world, device)}


def _result_file(got: dict, cfg: SoakConfig) -> dict:
    """The result file (docs/design.md#result-files): one row per kind, summed over ranks, plus
    a graph row; ``soak`` holds the totals."""
    ranks = got["ranks"]
    world = len(ranks)
    rows = []
    for k, kind in enumerate(KINDS):
        op = "all_reduce" if kind in ("one_shot", "two_shot", "lamport") else kind
        rows.append({"op": op, "impl": "llcomm", "algo": kind if op == "all_reduce" else None,
                     "mode": "eager", "dtype": "mixed", "world_size": world, "bytes": None,
                     "median_us": None, "p10_us": None, "p90_us": None,
                     "count": ranks[0]["counts"][kind],
                     "wrong": sum(r["wrong"][k] for r in ranks), "backend": ranks[0]["backend"]})
    g = ranks[0]["graph"]
    if g["ops"]:
        rows.append({"op": "mixed", "impl": "llcomm", "algo": None, "mode": "graph",
                     "dtype": "mixed", "world_size": world, "bytes": None, "median_us": None,
                     "p10_us": None, "p90_us": None, "count": g["ops"] * g["replays"],
                     "wrong": sum(r["graph"]["wrong"] for r in ranks),
                     "backend": ranks[0]["backend"]})
    failures = [f"rank {r['rank']}: {f}" for r in ranks for f in r["failures"]]
    wrong = sum(row["wrong"] for row in rows)
    timeouts = sum("CommTimeoutError" in f for f in failures)
    out = dict(got["header"])
    out["soak"] = {"ops": ranks[0]["eager_ops"], "graph_ops": g["ops"], "replays": g["replays"],
                   "wrong": wrong, "timeouts": timeouts,
                   "mismatches": sum("CommMismatchError" in f for f in failures),
                   "failures": failures, "seed": cfg.seed,
                   "eager_seconds": round(max(r["eager_seconds"] for r in ranks), 2),
                   "graph_seconds": round(max(r["graph"]["seconds"] for r in ranks), 2),
                   "ep_sequences": {k: v for k, v in ranks[0]["sequences"].items()},
                   "ep_sequences_failed": sum(r["sequences"]["failed"] for r in ranks)}
    out["rows"] = rows
    return out


def add_arguments(p) -> None:
    p.add_argument("--ops", type=int, default=None,
                   help=f"random eager ops (default {GPU_OPS} on GPUs, {CPU_OPS} on CPU)")
    p.add_argument("--graph-ops", type=int, default=1000,
                   help="mixed ops captured in one CUDA graph (GPU; default 1000, 0 = none)")
    p.add_argument("--replays", type=int, default=100, help="replays of that graph (default 100)")
    p.add_argument("--ep-every", type=int, default=50,
                   help="an EP dispatch + combine every this many ops (default 50, 0 = none)")
    p.add_argument("--ep-sequences", type=int, default=None, metavar="N",
                   help=f"random EP call sequences per API after the eager phase (default "
                        f"{GPU_SEQUENCES} on GPUs, {CPU_SEQUENCES} on CPU, 0 = none)")
    p.add_argument("--check-every", type=int, default=1000,
                   help="ops between host reads of the device counters (default 1000)")
    p.add_argument("--max-elems", type=int, default=None,
                   help=f"largest operand in elements (default {GPU_MAX_ELEMS} on GPUs, "
                        f"{CPU_MAX_ELEMS} on CPU)")
    p.add_argument("--backend", choices=("auto", "peer", "reference"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the run as a result file")
    p.add_argument("--cpu", action="store_true",
                   help="run on CPU (2 gloo processes) even where GPUs are present")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    options.add_no_multicast_argument(p)


def run(a) -> int:
    """``llcomm bench soak``: exit status 1 if any result was wrong or any op failed."""
    world, backend = spawn.plan(a.cpu)
    gpu = backend == "nccl"
    cfg = SoakConfig(ops=a.ops if a.ops is not None else (GPU_OPS if gpu else CPU_OPS),
                     graph_ops=a.graph_ops, replays=a.replays, ep_every=a.ep_every,
                     check_every=a.check_every, seed=a.seed, backend=a.backend,
                     max_elems=a.max_elems or (GPU_MAX_ELEMS if gpu else CPU_MAX_ELEMS),
                     ep_sequences=a.ep_sequences if a.ep_sequences is not None else (
                         GPU_SEQUENCES if gpu else CPU_SEQUENCES),
                     progress=not a.no_progress)
    problems = [f"--{k.replace('_', '-')}={v}: expected >= {lo}" for k, v, lo in (
        ("ops", cfg.ops, 0), ("graph_ops", cfg.graph_ops, 0), ("replays", cfg.replays, 0),
        ("ep_every", cfg.ep_every, 0), ("check_every", cfg.check_every, 1),
        ("ep_sequences", cfg.ep_sequences, 0))
        if v < lo]
    if not EP_TOKENS * EP_HIDDEN * 2 <= cfg.max_elems <= GPU_MAX_ELEMS:
        problems.append(f"--max-elems={cfg.max_elems}: expected {EP_TOKENS * EP_HIDDEN * 2} "
                        f"to {GPU_MAX_ELEMS}")
    if problems:
        print("llcomm bench soak: " + "; ".join(problems))
        return 2
    result = _result_file(spawn.launch(rank_main, cfg, force_cpu=a.cpu,
                                       multicast_off=a.no_multicast), cfg)
    s = result["soak"]
    console.print_table(f"soak: {s['ops']} eager ops + {s['graph_ops']} graph ops x {s['replays']} "
                  f"replays on {result['machine']} ({result['rows'][0]['backend']})",
                  ["op", "algo", "mode", "count", "wrong"],
                  [[r["op"], r["algo"] or "-", r["mode"], str(r["count"]), str(r["wrong"])]
                   for r in result["rows"]])
    print(f"wrong {s['wrong']}, timeouts {s['timeouts']}, mismatches {s['mismatches']}, "
          f"eager {s['eager_seconds']} s, graph {s['graph_seconds']} s")
    q = s["ep_sequences"]
    print(f"ep sequences: {q['run']} run on rank 0 ({q['dispatches']} dispatches, "
          f"{q['combines']} combines), {s['ep_sequences_failed']} failed over the ranks")
    for f in s["failures"]:
        print(f"FAILED {f}")
    if a.json:
        result_files.write_json(a.json, result)
        print(f"wrote {a.json}")
    return 1 if s["wrong"] or s["failures"] else 0
