"""``llcomm bench decode``: whole decode steps built from transformers' own modules
(llcomm/bench/decode_models.py says what is in them), timed with each communication
implementation, and with none, in the same run. Needs transformers (the ``hf`` extra).

- ``tp`` part: transformers' Llama decoder layers at a 70B-class shape, sharded at TP = world
  size by ``llcomm.hf.llama_tp``, attention over a KV cache of ``--context`` positions, batches
  1, 8, 32, 64 (one new token per sequence), with the row-parallel layers joined by llcomm
  (``Communicator.all_reduce``, algo auto; and ``llcomm_fused``: each layer's two joins
  ``all_reduce_residual_rmsnorm``, as examples/hf_llama_tp.py does with ``fused=True``), NCCL
  (``dist.all_reduce``), torch symmetric memory (``one_shot_all_reduce`` /
  ``two_shot_all_reduce_``, the projection written straight into the symmetric buffer), and
  ``none``. The whole step is one CUDA graph.
- ``ep`` part: transformers' Qwen3-MoE sparse block at DeepSeek-V3's MoE shape, expert-parallel
  at EP = world size by ``llcomm.hf.moe_ep``, 128 tokens per rank, with
  ``EPBuffer(backend="peer")`` (llcomm), ``EPBuffer(backend="reference")`` (all_to_all_single on
  NCCL) and ``none``; graph mode and eager mode (a reference graph that cannot be captured gives
  an ``error`` row, and the table then shows the eager time, marked).

Every number is the median over ``--iters`` replays of one step, slowest rank per iteration.
``comm_ms`` = step - the ``none`` step of the same part, batch and mode; ``comm_ratio`` = llcomm's
comm_ms (``llcomm`` and ``llcomm_fused`` rows) / NCCL's (TP) or / the reference's (EP); the goal
is <= 0.5. tokens/s: batch / step (TP: every rank holds the same tokens), W x tokens per rank /
step (EP).

``wrong``: TP: elements of the step output that are not finite or differ from rank 0's (an
all-reduce leaves every rank the same bits); EP (llcomm only): elements of the output that
differ from the reference backend's step on the same inputs (dispatch is byte-exact and combine
bitwise, so the whole stack must match). On CPU (two gloo processes) tiny shapes run with the
reference backends, eagerly (the ``reference`` and ``reference_fused`` rows).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from . import console, options, result_files, spawn, timing, verify
from . import decode_models as M
from .timing import Impl

DEFAULT_ITERS = 30
DEFAULT_WARMUP = 3
PARTS = ("tp", "ep")
DTYPE = torch.bfloat16
GPU_BATCHES, CPU_BATCHES = "1,8,32,64", "1,4"
GPU_EP_TOKENS, CPU_EP_TOKENS = "128", "4"
DEFAULT_WEIGHT_SETS = 8
MODELS = {"tp": "dense-70b", "ep": "deepseek-v3-moe"}
#: The implementation whose comm share llcomm's is divided by, per part.
BASELINE = {"tp": "nccl", "ep": "reference"}
#: llcomm's own rows (the peer backend), which get a comm_ratio.
LLCOMM = ("llcomm", "llcomm_fused")


@dataclass
class Config:
    parts: tuple
    batches: list[int]
    ep_tokens: list[int]
    dense: M.DenseShape
    moe: M.MoEShape
    weight_sets: int = DEFAULT_WEIGHT_SETS
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    seed: int = 0
    progress: bool = True


class Rank:
    def __init__(self, rank: int, world: int, cfg: Config):
        self.rank, self.world, self.cfg = rank, world, cfg
        self.cuda = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.timing = timing.Timing(self.device, cfg.iters, cfg.warmup, 1)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(cfg.seed * 1_000_003 + rank)
        self.modes = ("graph",) if self.cuda else ("eager",)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device,
                           dtype=torch.float32).to(DTYPE)


def _cross_rank_wrong(out: torch.Tensor) -> int:
    all_out = verify.gather_bytes(out)
    iv = verify.INT_VIEW[out.element_size()]
    same = all_out[0].view(iv) == out.view(iv)
    return int((~same | ~torch.isfinite(out)).sum())


# -- TP ------------------------------------------------------------------------------------------
def _nccl_join(y: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(y)
    return y


class SymmJoin:
    """A join by torch symmetric memory: the row-parallel layer writes its partial product
    straight into the symmetric buffer (``target``), then ``one_shot_all_reduce`` or
    ``two_shot_all_reduce_`` joins it."""

    def __init__(self, buf: torch.Tensor, group_name: str, two_shot: bool):
        self.buf, self.group_name, self.two_shot = buf, group_name, two_shot

    def target(self, shape, dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        return self.buf[:n].view(shape)

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if self.two_shot:
            torch.ops.symm_mem.two_shot_all_reduce_(y, "sum", self.group_name)
            return y
        return torch.ops.symm_mem.one_shot_all_reduce(y, "sum", self.group_name)


def tp_joins(R: Rank, comm, symm, batch: int) -> dict:
    """``{impl: (algo, join, fused_join)}``: how each implementation joins the row-parallel
    layers (``join``, the layer's own forward) or each layer's two joins (``fused_join``)."""
    from llcomm.hf.llama_tp import fused_join

    name = comm_name(comm)
    algo = (comm.choose_algo(batch * R.cfg.dense.hidden * 2) if comm.backend == "peer"
            else "reference")
    joins = {"none": ("none", None, None),
             name: (algo, comm.all_reduce, None),
             f"{name}_fused": ("fused", None, functools.partial(fused_join, comm))}
    if R.cuda:
        joins["nccl"] = ("nccl", _nccl_join, None)
        buf, gname, _ = symm
        if buf is not None:
            joins["torch_one_shot"] = ("one_shot", SymmJoin(buf, gname, False), None)
            joins["torch_two_shot"] = ("two_shot", SymmJoin(buf, gname, True), None)
    return joins


def tp_impls(R: Rank, model: M.DenseTP, comm, symm, batch: int) -> list[Impl]:
    H = model.shape.hidden
    # The same starting state on every rank (TP: every rank holds the whole batch).
    g = torch.Generator(device=R.device)
    g.manual_seed(R.cfg.seed + batch)
    x = torch.randn(batch, 1, H, generator=g, device=R.device, dtype=torch.float32).to(DTYPE)
    out = torch.empty_like(x)
    cache = model.cache(batch)
    impls = []
    for name, (algo, join, fused) in tp_joins(R, comm, symm, batch).items():
        def fn(join=join, fused=fused):
            model.set_join(join)
            out.copy_(model.step(x, cache, fused))
        mine = name.startswith(comm_name(comm))
        impls.append(Impl(name, algo, fn, reset=lambda: verify.poison_(out), modes=R.modes,
                          check=None if name == "none" else (lambda: _cross_rank_wrong(out)),
                          raise_errors=comm.check if mine else None))
    if R.cuda and symm[0] is None:
        impls += [Impl(n, n[6:], None, modes=R.modes, error=symm[2])
                  for n in ("torch_one_shot", "torch_two_shot")]
    return impls


def comm_name(comm) -> str:
    return "llcomm" if comm.backend == "peer" else "reference"


def run_tp(R: Rank, bar) -> list[dict]:
    from llcomm import Communicator

    cfg = R.cfg
    model = M.DenseTP(cfg.dense, M.Group(R.rank, R.world), cfg.weight_sets, cfg.seed,
                      R.device, DTYPE)
    max_bytes = max(cfg.batches) * cfg.dense.hidden * 2
    comm = Communicator(max_bytes=max_bytes)
    symm = (timing.torch_symm_buffer(max_bytes // 2, DTYPE, R.device) if R.cuda
            else (None, None, "CPU"))
    rows = []
    for batch in cfg.batches:
        base = {"op": "decode_step", "part": "tp", "model": MODELS["tp"], "batch": batch,
                "dtype": options.dtype_name(DTYPE), "world_size": R.world,
                "bytes": batch * cfg.dense.hidden * 2, "layers": cfg.dense.layers,
                "context": cfg.dense.context, "joins_per_step": 2 * cfg.dense.layers}
        for impl in tp_impls(R, model, comm, symm, batch):
            rows += timing.time_impl(impl, base, R.timing)
        bar.advance(f"tp batch {batch}")
    comm.close()
    return rows


# -- EP ------------------------------------------------------------------------------------------
def run_ep(R: Rank, bar) -> list[dict]:
    from llcomm import EPBuffer

    cfg = R.cfg
    rows = []
    for tokens in cfg.ep_tokens:
        # CPU: every row of every expert (the module's forward exactly); GPU: a fixed budget
        model = M.MoEEP(cfg.moe, M.Group(R.rank, R.world), tokens, cfg.seed, R.device, DTYPE,
                        rows=None if R.cuda else R.world * tokens)
        x = R.rand(tokens, cfg.moe.hidden)
        kw = dict(num_experts=cfg.moe.experts, hidden=cfg.moe.hidden,
                  num_max_dispatch_tokens_per_rank=tokens, dtype=DTYPE)
        bufs = {"reference": EPBuffer(backend="reference", **kw)}
        if R.cuda:
            bufs["llcomm"] = EPBuffer(backend="peer", **kw)
        ref = bufs["reference"]
        # the reference's step: the oracle
        expected = model.step(x, model.transport(ref, *model.buffers()))
        _, _, first = model.blocks[0].gate(x)
        dests = torch.zeros(tokens, R.world, dtype=torch.bool, device=R.device)
        dests.scatter_(1, first // (cfg.moe.experts // R.world), True)
        base = {"op": "decode_step", "part": "ep", "model": MODELS["ep"], "batch": tokens,
                "tokens_per_rank": tokens, "dtype": options.dtype_name(DTYPE),
                "world_size": R.world,
                "bytes": int(dests.sum()) * cfg.moe.hidden * 2, "hidden": cfg.moe.hidden,
                "num_experts": cfg.moe.experts, "topk": cfg.moe.topk, "fp8": False,
                "layers": cfg.moe.layers, "expert_rows": model.rows,
                "expert_intermediate": cfg.moe.intermediate}
        modes = ("graph", "eager")
        for name, buf in (("none", None), *((n, bufs[n]) for n in ("llcomm", "reference")
                                             if n in bufs)):
            out = torch.empty_like(x)
            transport = model.transport(buf, *model.buffers())

            def fn(transport=transport, out=out, model=model):
                out.copy_(model.step(x, transport))

            check = ((lambda out=out: verify.count_wrong(out, expected)) if name == "llcomm"
                     else None)
            impl = Impl(name, "ll" if buf is not None else "none", fn, modes=modes,
                        reset=lambda out=out: verify.poison_(out), check=check,
                        raise_errors=buf.check if buf is not None else None)
            rows += timing.time_impl(impl, base, R.timing)
        for buf in bufs.values():
            buf.close()
        del model
        bar.advance(f"ep {tokens} tokens")
    return rows


# -- results -------------------------------------------------------------------------------------
def add_shares(rows: list[dict]) -> None:
    """Per row: ms_per_step, tokens_per_s, comm_ms (vs ``none``) and, for llcomm's rows,
    comm_ratio."""
    for r in rows:
        med = r["median_us"]
        r["ms_per_step"] = med / 1e3 if med is not None else None
        toks = r["batch"] * (r["world_size"] if r["part"] == "ep" else 1)
        r["tokens_per_s"] = toks / (med * 1e-6) if med else None
    def key(r):
        return r["part"], r["batch"], r["mode"]

    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["impl"]] = r
    for r in rows:
        none = by[key(r)].get("none")
        r["comm_ms"] = (r["ms_per_step"] - none["ms_per_step"]
                        if r["impl"] != "none" and r["ms_per_step"] is not None and none
                        and none["ms_per_step"] is not None else None)
    for r in rows:
        base = by[key(r)].get(BASELINE[r["part"]])
        if r["impl"] in LLCOMM and base and r["comm_ms"] is not None and base["comm_ms"]:
            r["comm_ratio"] = r["comm_ms"] / base["comm_ms"]


def rank_main(rank: int, world: int, cfg: Config):
    R = Rank(rank, world, cfg)
    rows = []
    total = len(cfg.batches) * ("tp" in cfg.parts) + len(cfg.ep_tokens) * ("ep" in cfg.parts)
    with console.progress(total, "bench decode", enabled=rank == 0 and cfg.progress) as bar:
        if "tp" in cfg.parts:
            rows += run_tp(R, bar)
        if "ep" in cfg.parts:
            rows += run_ep(R, bar)
    if rank != 0:
        return None
    add_shares(rows)
    return {**result_files.result_header(world, R.device), "bench": "decode", "iters": cfg.iters,
            "warmup": cfg.warmup, "dense": cfg.dense.__dict__, "moe": cfg.moe.__dict__,
            "weight_sets": cfg.weight_sets, "rows": rows}


# -- table ---------------------------------------------------------------------------------------
def _ms(r: dict | None, key: str = "ms_per_step") -> str:
    if r is None:
        return "-"
    if r.get("error") or r.get(key) is None:
        return "err" if r.get("error") else "-"
    return f"{r[key]:.3f}"


def _ratio(r: dict | None) -> str:
    return f"{r['comm_ratio']:.2f}" if r and r.get("comm_ratio") else "-"


def table(rows: list[dict], part: str) -> tuple[list[str], list[list[str]]]:
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["part"] == part))
    headers = ["batch", *[f"{i} ms" for i in impls],
               *[f"{i} comm ms" for i in impls if i != "none"],
               *[f"{i}/{BASELINE[part]} comm" for i in LLCOMM if i in impls],
               "llcomm tok/s", "#wrong"]
    lines: dict = {}
    for r in rows:
        if r["part"] == part:
            lines.setdefault(r["batch"], {}).setdefault(r["impl"], {})[r["mode"]] = r
    out = []
    for batch, cells in lines.items():
        def pick(impl):  # graph where it ran, else the eager row, marked
            m = cells.get(impl, {})
            g = m.get("graph")
            if g is not None and g.get("median_us") is not None:
                return g, ""
            e = m.get("eager")
            if e is not None and e.get("median_us") is not None:
                return e, " (eager)" if g is not None else ""
            return g or e, ""
        picked = {i: pick(i) for i in impls}
        ll = picked.get("llcomm", (None, ""))[0]
        wrongs = [r["wrong"] for m in cells.values() for r in m.values()
                  if r.get("wrong") is not None]
        out.append([str(batch), *[_ms(picked[i][0]) + picked[i][1] for i in impls],
                    *[_ms(picked[i][0], "comm_ms") for i in impls if i != "none"],
                    *[_ratio(picked[i][0]) for i in LLCOMM if i in impls],
                    f"{ll['tokens_per_s']:.0f}" if ll and ll.get("tokens_per_s") else "-",
                    str(sum(wrongs)) if wrongs else "-"])
    return headers, out


def print_result(result: dict) -> None:
    v = result["versions"]
    print(f"# llcomm bench decode: {result['machine']}, world size {result['world_size']}; torch "
          f"{v.get('torch')}, triton {v.get('triton')}, nccl {v.get('nccl')}; commit "
          f"{result.get('commit')}{' (dirty)' if result.get('dirty') else ''}; median of "
          f"{result['iters']} steps after {result['warmup']} warm-up, slowest rank")
    d, m = result["dense"], result["moe"]
    sets = min(result["weight_sets"], d["layers"])
    titles = {"tp": f"tp: {MODELS['tp']} (transformers' LlamaDecoderLayer, hidden "
                    f"{d['hidden']}, {d['layers']} layers of {sets} weight sets, context "
                    f"{d.get('context')}, {2 * d['layers']} joins per step); graph mode: one "
                    "CUDA graph per step",
              "ep": f"ep: {MODELS['ep']} (transformers' Qwen3MoeSparseMoeBlock, hidden "
                    f"{m['hidden']}, {m['experts']} experts, top-{m['topk']}, {m['layers']} MoE "
                    f"layers, expert intermediate {m['intermediate']}); batch = tokens per rank"}
    for part in PARTS:
        if any(r["part"] == part for r in result["rows"]):
            headers, lines = table(result["rows"], part)
            console.print_table(titles[part], headers, lines)
    for r in result["rows"]:
        if r.get("error"):
            print(f"# note: {r['part']} {r['impl']} {r['mode']} at batch {r['batch']}: "
                  f"{r['error']}")


# -- command line --------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--parts", default="tp,ep", help="tp, ep or tp,ep (default)")
    p.add_argument("--batches", help=f"TP batches (default {GPU_BATCHES}; CPU {CPU_BATCHES})")
    p.add_argument("--layers", type=int, help=f"dense layers (default {M.DenseShape.layers}; "
                   f"CPU {M.DENSE_CPU.layers})")
    p.add_argument("--context", type=int, help="filled KV-cache positions per sequence (default "
                   f"{M.DenseShape.context}; CPU {M.DENSE_CPU.context})")
    p.add_argument("--weight-sets", type=int, default=DEFAULT_WEIGHT_SETS,
                   help="distinct dense weight sets, used by layers in turn (default "
                   f"{DEFAULT_WEIGHT_SETS})")
    p.add_argument("--ep-tokens", help=f"EP tokens per rank (default {GPU_EP_TOKENS}; CPU "
                   f"{CPU_EP_TOKENS})")
    p.add_argument("--moe-layers", type=int, help=f"MoE layers (default {M.MoEShape.layers}; "
                   f"CPU {M.MOE_CPU.layers})")
    p.add_argument("--moe-intermediate", type=int, help="expert intermediate width (default "
                   f"{M.MoEShape.intermediate}; CPU {M.MOE_CPU.intermediate})")
    options.add_run_arguments(p, iters=DEFAULT_ITERS, warmup=DEFAULT_WARMUP)


def config_from_args(a, on_cpu: bool) -> Config:
    problems: list[str] = []
    parts = tuple(p.strip() for p in a.parts.split(",") if p.strip())
    if not parts or set(parts) - set(PARTS):
        problems.append(f"--parts {a.parts!r}: expected tp, ep or tp,ep")
    batches, ep_tokens = [], []
    try:
        batches = options.parse_ints(a.batches or (CPU_BATCHES if on_cpu else GPU_BATCHES),
                               "--batches")
        ep_tokens = options.parse_ints(a.ep_tokens or (CPU_EP_TOKENS if on_cpu else GPU_EP_TOKENS),
                                 "--ep-tokens")
    except ValueError as e:
        problems.append(str(e))
    dense = M.DENSE_CPU if on_cpu else M.DenseShape()
    moe = M.MOE_CPU if on_cpu else M.MoEShape()
    for flag, v in (("--layers", a.layers), ("--context", a.context),
                    ("--moe-layers", a.moe_layers),
                    ("--moe-intermediate", a.moe_intermediate),
                    ("--weight-sets", a.weight_sets)):
        if v is not None and v < 1:
            problems.append(f"{flag} must be at least 1")
    options.check_run_arguments(a, problems)
    if problems:
        raise ValueError("; ".join(problems))
    if a.layers:
        dense = replace(dense, layers=a.layers)
    if a.context:
        dense = replace(dense, context=a.context)
    if a.moe_layers:
        moe = replace(moe, layers=a.moe_layers)
    if a.moe_intermediate:
        moe = replace(moe, intermediate=a.moe_intermediate)
    return Config(parts=parts, batches=batches, ep_tokens=ep_tokens, dense=dense, moe=moe,
                  weight_sets=a.weight_sets, iters=a.iters, warmup=a.warmup, seed=a.seed,
                  progress=not a.no_progress)


def run(a) -> int:
    """``llcomm bench decode``: exit status 1 if an llcomm row was wrong or failed."""
    from llcomm.hf import INSTALL_HINT, transformers_available

    if not transformers_available():
        print("llcomm bench decode: the decode steps are built from transformers' own modules, "
              f"and transformers is not installed here: {INSTALL_HINT}")
        return 2
    world, backend = spawn.plan(a.cpu)
    try:
        cfg = config_from_args(a, backend == "gloo")
    except ValueError as e:
        print(f"llcomm bench decode: {e}")
        return 2
    result = spawn.launch(rank_main, cfg, force_cpu=a.cpu,
                          multicast_off=a.no_multicast)
    print_result(result)
    result_files.write_outputs(result, a)
    bad = [r for r in result["rows"] if r["impl"] in (*LLCOMM, "reference", "reference_fused")
           and (r.get("wrong") or r.get("error"))
           and not (r["part"] == "ep" and r["impl"] == "reference" and r["mode"] == "graph")]
    if bad:
        print(f"llcomm bench decode: {len(bad)} llcomm result rows are wrong or failed")
    return 1 if bad else 0
