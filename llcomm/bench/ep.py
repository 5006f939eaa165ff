"""``llcomm bench ep``: MoE dispatch / combine of ``llcomm.EPBuffer``, the peer backend against
the reference backend on NCCL, in the same run, on the same inputs, every result checked.

Per tokens-per-rank value (default 1, 32, 128, 256, 512; DeepSeek-V3's MoE: hidden 7168, 256
experts, top-8; bf16), on GPUs (one process per GPU, NCCL):

- ``llcomm``: ``EPBuffer(backend="peer")``, CUDA-graph mode and eager mode;
- ``reference``: ``EPBuffer(backend="reference")``, ``all_to_all_single`` on NCCL, same modes
  (a graph that cannot be captured gives a row with an ``error``, the eager row still runs).

On CPU (two gloo processes) only the reference runs, eagerly, with small default shapes.

Routing is uniform: each token's top-k experts are distinct and drawn uniformly (the top-k of
uniform random scores), weights are uniform and sum to 1. ``bytes`` is the payload one rank sends
(mean over ranks): a row of ``hidden`` values per (token, destination rank holding at least one
of its experts). Combine sends as many partial rows back (exactly, summed over ranks), so both ops
report the same ``bytes``; GB/s = bytes / time.

Correctness (``wrong``, summed over ranks), from every rank's inputs gathered by torch.distributed:
- dispatch, byte for byte: ``recv_count`` and, for each local expert, the rows of the tokens that
  chose it in source-rank then token order, and their ``src_info``;
- combine, bit for bit: the experts are a stand-in ``y = x * scale[g] + bias[g]`` per global expert
  ``g`` (fp32, rounded to bf16), the expected output is the documented combine arithmetic
  (docs/ep.md: per expert rank the k-order fp32 fold, rounded; then the rank-order fold, rounded)
  computed at the source from its own tokens. The reference backend implements exactly that, so
  the llcomm rows are checked against the reference's result and the reference rows against the
  oracle. Outputs are NaN-poisoned before the first call and before the timed loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import common as C
from .common import Impl

DEFAULT_ITERS = 50
DEFAULT_WARMUP = 5
#: (tokens per rank, hidden, experts, topk) on GPUs, and the tiny CPU defaults.
GPU_SHAPE = ("1,32,128,256,512", 7168, 256, 8)
CPU_SHAPE = ("1,8,32", 256, 16, 4)
OPS = ("dispatch", "combine")
IMPLS = ("llcomm", "reference")
DTYPE = torch.bfloat16


@dataclass
class Config:
    tokens: list[int]
    hidden: int
    experts: int
    topk: int
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    graph_ops: int = C.GRAPH_OPS
    seed: int = 0
    progress: bool = True


# -- inputs and oracles --------------------------------------------------------------------------
def uniform_routing(n: int, experts: int, topk: int, gen: torch.Generator, device):
    """``(topk_idx [n, topk] int64, topk_weights [n, topk] fp32)``: distinct uniform experts per
    token, uniform weights summing to 1."""
    idx = torch.rand(n, experts, generator=gen, device=device).topk(topk, dim=1).indices
    w = torch.rand(n, topk, generator=gen, device=device) + 0.01
    return idx.contiguous(), (w / w.sum(1, keepdim=True)).contiguous()


def expert_affine(experts: int, device):
    """fp32 ``(scale, bias)`` of the stand-in expert of each global expert id."""
    g = torch.arange(experts, device=device, dtype=torch.float32)
    return 1 + (g % 7) / 8, (g % 5) / 4 - 0.5


def run_experts(recv_x, recv_count, scale, bias, rank: int) -> torch.Tensor:
    """``expert_out`` for ``recv_x [L, W*T, H]``: ``x * scale[g] + bias[g]`` (fp32, rounded) on the
    filled rows, zeros elsewhere."""
    L = recv_x.shape[0]
    out = torch.zeros_like(recv_x)
    m = int(recv_count.max()) if L else 0
    s = scale[rank * L:(rank + 1) * L].view(L, 1, 1)
    b = bias[rank * L:(rank + 1) * L].view(L, 1, 1)
    out[:, :m] = (recv_x[:, :m].float() * s + b).to(recv_x.dtype)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


class Expected:
    """What this rank's dispatch and combine must return, from every rank's inputs."""

    def __init__(self, x, idx, w, rank: int, world: int, max_tokens: int, scale, bias):
        L = scale.shape[0] // world
        n, K = idx.shape
        xs = C.gather_bytes(x).reshape(world * n, -1)                 # pair p = s * n + t
        ids = C.gather_inputs(idx).reshape(world * n, K)
        mine = torch.arange(rank * L, (rank + 1) * L, device=idx.device)
        hit = (ids.unsqueeze(-1) == mine).any(1).T                   # [L, W * n]
        self.count = hit.sum(1).to(torch.int32)
        self.e, self.p = hit.nonzero(as_tuple=True)                  # expert-major, then pair
        self.row = (hit.cumsum(1) - 1)[self.e, self.p]
        self.rows = xs[self.p]
        self.src = ((self.p // n) * max_tokens + self.p % n).to(torch.int32)
        self.combine = self._combine(x, idx, w, world, L, scale, bias)

    @staticmethod
    def _combine(x, idx, w, world, L, scale, bias):
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        owner = idx // L
        for q in range(world):
            acc = torch.zeros_like(total)
            for k in range(idx.shape[1]):
                g = idx[:, k]
                y = (x.float() * scale[g].unsqueeze(1) + bias[g].unsqueeze(1)).to(x.dtype)
                acc = torch.where((owner[:, k] == q).unsqueeze(1), acc + w[:, k:k + 1] * y.float(),
                                  acc)
            went = (owner == q).any(1, keepdim=True)
            total = torch.where(went, total + acc.to(x.dtype).float(), total)
        return total.to(x.dtype)

    def dispatch_wrong(self, recv_x, recv_count, handle) -> int:
        bad = int((recv_count != self.count).sum())
        got = recv_x[self.e, self.row]
        bad += int((_bits(got) != _bits(self.rows)).sum())
        bad += int((handle.src_info[self.e, self.row] != self.src).sum())
        return bad


# -- one token count ---------------------------------------------------------------------------
def _impls(buf, name: str, x, idx, w, exp: Expected, ref_out, scale, bias, R) -> list[Impl]:
    """The dispatch and the combine of one buffer; combine runs on a handle of its own dispatch."""
    shape = (buf.num_local_experts, buf.num_ranks * buf.max_tokens, buf.hidden)
    recv = torch.zeros(shape, dtype=DTYPE, device=R.device)
    got = {}

    def dispatch():
        got["d"] = buf.dispatch(x, idx, out=recv)
    d = Impl(name, "ll", dispatch, reset=lambda: C.poison_(recv),
             check=lambda: exp.dispatch_wrong(*got["d"]), raise_errors=buf.check)
    recv_c = torch.zeros_like(recv)
    out = torch.empty_like(x)
    state = {}

    def prepare():  # a dispatch of its own: the handle lives until this buffer's next two
        rx, rc, state["h"] = buf.dispatch(x, idx, out=recv_c)
        state["y"] = run_experts(rx, rc, scale, bias, R.rank)
        C.poison_(out)

    expected = exp.combine if ref_out is None else ref_out
    c = Impl(name, "ll", lambda: buf.combine(state["y"], idx, w, state["h"], out=out),
             reset=lambda: C.poison_(out), check=lambda: C.count_wrong(out, expected),
             raise_errors=buf.check)
    return [d, (prepare, c)]


class Rank:
    def __init__(self, rank: int, world: int, cfg: Config):
        from llcomm import EPBuffer

        self.rank, self.world, self.cfg = rank, world, cfg
        self.cuda = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.timing = C.Timing(self.device, cfg.iters, cfg.warmup,
                               cfg.graph_ops if self.cuda else 1)
        kw = dict(num_experts=cfg.experts, hidden=cfg.hidden,
                  num_max_dispatch_tokens_per_rank=max(cfg.tokens), dtype=DTYPE)
        self.bufs = {"reference": EPBuffer(backend="reference", **kw)}
        if self.cuda:
            self.bufs = {"llcomm": EPBuffer(backend="peer", **kw), **self.bufs}
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(cfg.seed * 1_000_003 + rank)
        self.scale, self.bias = expert_affine(cfg.experts, self.device)


def run_tokens(R: Rank, n: int) -> list[dict]:
    cfg = R.cfg
    x = torch.randn(n, cfg.hidden, generator=R.gen, device=R.device).to(DTYPE)
    idx, w = uniform_routing(n, cfg.experts, cfg.topk, R.gen, R.device)
    exp = Expected(x, idx, w, R.rank, R.world, max(cfg.tokens), R.scale, R.bias)
    L = cfg.experts // R.world
    dests = torch.zeros(n, R.world, dtype=torch.bool, device=R.device)
    dests.scatter_(1, idx // L, True)
    nbytes = C.sum_over_ranks(int(dests.sum()), R.device) * cfg.hidden * 2 // R.world
    base = {"op": None, "dtype": C.dtype_name(DTYPE), "world_size": R.world, "bytes": nbytes,
            "tokens_per_rank": n, "hidden": cfg.hidden, "num_experts": cfg.experts,
            "topk": cfg.topk, "fp8": False}
    rows, ref_out = [], None
    for name in reversed(list(R.bufs)):            # reference first: its combine is the oracle
        buf = R.bufs[name]
        d, (prepare, c) = _impls(buf, name, x, idx, w, exp, ref_out, R.scale, R.bias, R)
        rows += C.time_impl(d, {**base, "op": "dispatch"}, R.timing)
        for mode in c.modes:
            err = [None]
            if not C.attempt(prepare, err, R.device):
                rows.append({**base, "op": "combine", "impl": name, "algo": c.algo, "mode": mode,
                             "median_us": None, "p10_us": None, "p90_us": None, "wrong": None,
                             "error": f"dispatch before combine: {err[0]}"})
                continue
            one = Impl(**{**c.__dict__, "modes": (mode,)})
            rows += C.time_impl(one, {**base, "op": "combine"}, R.timing)
        if name == "reference" and R.cuda:
            ref_out = _reference_combine(buf, x, idx, w, R)
    return rows


def _reference_combine(buf, x, idx, w, R) -> torch.Tensor:
    """The reference backend's combine of these inputs (the expected llcomm combine)."""
    rx, rc, h = buf.dispatch(x, idx)
    return buf.combine(run_experts(rx, rc, R.scale, R.bias, R.rank), idx, w, h)


def rank_main(rank: int, world: int, cfg: Config):
    """One rank of ``llcomm bench ep``: rank 0 returns the result."""
    R = Rank(rank, world, cfg)
    rows = []
    with C.progress(len(cfg.tokens), "bench ep", enabled=rank == 0 and cfg.progress) as bar:
        for n in cfg.tokens:
            rows += run_tokens(R, n)
            bar.advance(f"{n} tokens")
    for buf in R.bufs.values():
        buf.close()
    if rank != 0:
        return None
    return {**C.result_header(world, R.device), "bench": "ep", "iters": cfg.iters,
            "warmup": cfg.warmup, "graph_ops": R.timing.ops if R.cuda else None,
            "routing": "uniform", "rows": rows}


# -- table ----------------------------------------------------------------------------------------
HEADERS = ["tokens", "bytes", "llcomm graph µs", "llcomm eager µs", "ref graph µs",
           "ref eager µs", "llcomm GB/s", "ref GB/s", "ref / llcomm", "#wrong"]


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return "err" if row.get("error") else C.fmt_us(row["median_us"])


def _best(*rows):
    return next((r["median_us"] for r in rows if r and r.get("median_us")), None)


def table_rows(rows: list[dict], op: str) -> list[list[str]]:
    lines: dict = {}
    for r in rows:
        if r["op"] == op:
            lines.setdefault(r["tokens_per_rank"], {})[(r["impl"], r["mode"])] = r
    out = []
    for n, cells in lines.items():
        lg, le = cells.get(("llcomm", "graph")), cells.get(("llcomm", "eager"))
        rg, re_ = cells.get(("reference", "graph")), cells.get(("reference", "eager"))
        nbytes = next(iter(cells.values()))["bytes"]
        tl, tr = _best(lg, le), _best(rg, re_)
        wrongs = [r["wrong"] for r in cells.values() if r.get("wrong") is not None]
        out.append([str(n), C.fmt_bytes(nbytes), _cell(lg), _cell(le), _cell(rg), _cell(re_),
                    f"{nbytes / (tl * 1e3):.1f}" if tl else "-",
                    f"{nbytes / (tr * 1e3):.1f}" if tr else "-",
                    f"{tr / tl:.2f}x" if tl and tr else "-",
                    str(sum(wrongs)) if wrongs else "-"])
    return out


def print_result(result: dict) -> None:
    r0 = result["rows"][0] if result["rows"] else {}
    v = result["versions"]
    print(f"# llcomm bench ep: {result['machine']}, world size {result['world_size']}, hidden "
          f"{r0.get('hidden')}, {r0.get('num_experts')} experts, top-{r0.get('topk')}, "
          f"{result['routing']} routing, {r0.get('dtype')}")
    print(f"# torch {v.get('torch')}, triton {v.get('triton')}, nccl {v.get('nccl')}; commit "
          f"{result.get('commit')}{' (dirty)' if result.get('dirty') else ''}; {result['iters']} "
          f"iters after {result['warmup']} warm-up"
          + (f", {result['graph_ops']} ops per graph" if result.get("graph_ops")
             else ", eager only (CPU, reference backend on gloo)"))
    print("# GB/s from the graph time where there is one; ref = reference backend "
          "(all_to_all_single)")
    for op in OPS:
        C.print_table(op, HEADERS, table_rows(result["rows"], op))
    for r in result["rows"]:
        if r.get("error"):
            print(f"# note: {r['op']} {r['impl']} {r['mode']} at {r['tokens_per_rank']} tokens: "
                  f"{r['error']}")


# -- command line -------------------------------------------------------------------------------
def add_arguments(p) -> None:
    g, c = GPU_SHAPE, CPU_SHAPE
    p.add_argument("--tokens", help=f"comma list of tokens per rank (default {g[0]}; CPU {c[0]})")
    p.add_argument("--hidden", type=int, help=f"token width (default {g[1]}; CPU {c[1]})")
    p.add_argument("--experts", type=int, help=f"global experts (default {g[2]}; CPU {c[2]})")
    p.add_argument("--topk", type=int, help=f"experts per token (default {g[3]}; CPU {c[3]})")
    p.add_argument("--graph-ops", type=int, default=C.GRAPH_OPS,
                   help=f"ops per CUDA graph / per eager iteration on GPU (default {C.GRAPH_OPS})")
    C.add_run_arguments(p, iters=DEFAULT_ITERS, warmup=DEFAULT_WARMUP)


def config_from_args(a, on_cpu: bool) -> Config:
    """Validate every argument (defaults by where it runs); raise one ValueError naming each."""
    problems: list[str] = []
    d = CPU_SHAPE if on_cpu else GPU_SHAPE
    tokens = []
    try:
        tokens = C.parse_ints(a.tokens or d[0], "--tokens")
    except ValueError as e:
        problems.append(str(e))
    hidden, experts, topk = (v if v is not None else dv
                             for v, dv in zip((a.hidden, a.experts, a.topk), d[1:]))
    if hidden < 8 or hidden % 8:
        problems.append(f"--hidden {hidden}: expected a positive multiple of 8 (16-byte rows)")
    if experts < 1 or not 1 <= topk <= experts:
        problems.append(f"--experts {experts} --topk {topk}: expected 1 <= topk <= experts")
    if a.graph_ops < 1:
        problems.append("--graph-ops must be at least 1")
    C.check_run_arguments(a, problems)
    if problems:
        raise ValueError("; ".join(problems))
    return Config(tokens=tokens, hidden=hidden, experts=experts, topk=topk, iters=a.iters,
                  warmup=a.warmup, graph_ops=a.graph_ops, seed=a.seed,
                  progress=not a.no_progress)


def run(a) -> int:
    """``llcomm bench ep``: exit status 1 if any result was wrong or an llcomm row failed."""
    world, backend = C.plan(a.cpu)
    try:
        cfg = config_from_args(a, backend == "gloo")
        if cfg.experts % world:
            raise ValueError(f"--experts {cfg.experts} is not a multiple of the {world} ranks")
    except ValueError as e:
        print(f"llcomm bench ep: {e}")
        return 2
    result = C.launch(rank_main, cfg, force_cpu=a.cpu)
    print_result(result)
    C.write_outputs(result, a)
    bad = [r for r in result["rows"] if (r["wrong"] or 0) > 0
           or (r.get("error") and r["impl"] == "llcomm")]
    if bad:
        print(f"llcomm bench ep: {len(bad)} result rows are wrong or failed")
    return 1 if bad else 0
