"""``llcomm bench ep --calibrate``: the in-host stages of the two-level EP kernels timed on one
GPU, for the cost model (``ep_inhost``; docs/multihost.md, "Cost model").

One rank of a host of R ranks (``RANK``: host 0, local rank 0) runs the kernels' own in-host
stages, each launch on its own:

- ``forward``: the dispatch with ``STAGES = HD_FORWARD_OWN | HD_FORWARD`` (plain stores,
  ``SHMEM`` = 0; no masks): its own tokens from its staging area, every other host's from its
  receive slots, to the ranks of its host that hold their experts, and their ids to all;
- ``partials``: the combine with ``HC_PARTIALS``: its partial per (source, token) into the
  forwarders of its host;
- ``host sums``: the combine with ``HC_HOST_SUM_WAIT | HC_HOST_SUM``: every rank's partials of
  each forwarded token folded, the own host's sum kept, the others' staged and put (a plain
  copy here, where a NIC would read the staged sum).

The region table names R distinct allocations of this GPU for the ranks of the host, so the
stages write to distinct memory as to the GPUs of a host, and one per other host for its rail
rank (where the host sums' puts land). What the rail would have delivered (the other hosts' id
blocks and rows) and what the other stages would have left (staged rows, weights, every rank's
partials, the handle) is written first, from a routing drawn as DeepSeek-V3 decode (128 tokens
a rank, hidden 7168, top-8 of 256 experts drawn uniformly, FP8 dispatch rows, bf16 combine) at
EP16 and EP64, 8 ranks per host. Every flag a stage waits for is preset to the call's word,
``((ctrl[b] + 1) << EPOCH_SHIFT) | tag``: only the expand and out stages advance the block
counters ``ctrl``, so every launch here sees the same word.

Each stage is timed in CUDA-graph replay (``--iters`` replays of a graph of ``--graph-ops``
launches, after ``--warmup`` replays; median, p10 and p90 µs per launch) and then checked:
the forward must have placed exactly the rows (and ids) the routing sends each of the R ranks,
byte for byte, and nothing else; the partials and host sums exactly the slots the routing
fills; no launch may report an error. The result file (``--json``, default
``bench/results/<gpu>x1-ep-calibration.json``) has a row per (EP, stage) with the bytes the
stage moves as the model counts them. On one GPU the writes land in this GPU's memory (and
its L2), not on NVLink: this is the kernels' own cost, and the model keeps each stage's NVLink
time as a floor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import result_files
from .ep_inhost import CALIBRATED_STAGES, CALIBRATION_SUFFIX, RESULTS
from .ep_model import Shape
from .ep_oracle import uniform_routing

#: The rank that calibrates: host 0, local rank 0 (every rank of a uniform routing is alike).
RANK = 0
#: Bound of the stages' waits, µs: their flags are preset, so they never wait.
TIMEOUT_US = 10_000_000
#: The byte the checked slots hold before a launch; bf16 partials and sums are poisoned with
#: NaN (every bit set).
POISON = 0xA5
#: What a result file says was timed.
WHAT = ("the two-level EP kernels' in-host stages (forward: dispatch HD_FORWARD_OWN | "
        "HD_FORWARD; partials: combine HC_PARTIALS; host sums: combine HC_HOST_SUM_WAIT | "
        "HC_HOST_SUM) as one rank of a host, its region table naming a distinct allocation of "
        "this GPU per rank, every awaited flag preset; CUDA-graph replay, µs per launch; bytes "
        "as the cost model counts them (llcomm/bench/ep_inhost.py)")


@dataclass
class Setup:
    """One rank's stages at one shape (``build``): the launches, and what they must place."""

    shape: Shape
    lay: object                         # HostsLayout
    rank: int
    regions: list                       # this host's R regions, then one per other host
    tab: torch.Tensor
    launch: dict                        # stage name -> one launch
    nbytes: dict                        # stage name -> bytes, as the model counts them
    rows: torch.Tensor                  # [N, T, PUT_BYTES] the rail sources' rows
    topks: list                         # every rank's [T, K] int64 ids (CPU)
    err: torch.Tensor
    host_words: torch.Tensor
    keep: list = field(default_factory=list)    # tensors the launches use


def _view(region: torch.Tensor, off: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of ``dtype`` at byte ``off`` of a region."""
    size = torch.tensor([], dtype=dtype, device="cpu").element_size()
    return region[off:off + n * size].view(dtype)


def _extent(lay, name: str) -> tuple[int, int]:
    """(offset, bytes) of region ``name`` up to the next one (its padding included)."""
    o = lay.offsets
    after = sorted(v for v in o.values() if v > o[name])
    return o[name], (after[0] if after else lay.set_bytes) - o[name]


def _here(idx: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """``[..., K]`` ids -> ``[...]`` bool: one of them lies in ``[lo, lo + n)``."""
    return ((idx >= lo) & (idx < lo + n)).any(-1)


def _row_of(topks, rank: int, L: int, T: int) -> torch.Tensor:
    """The dispatch's handle ``row_of [W, T, K]``: for each entry whose expert is local here,
    its row ``e * W * T + position`` (rows of local expert e in source then token order),
    else -1 (``kernels/dispatch.py``, expand)."""
    idx = torch.stack(list(topks))                                  # [W, T, K]
    W = idx.shape[0]
    out = torch.full(idx.shape, -1, dtype=torch.int32, device="cpu")
    for e in range(L):
        hit = idx == rank * L + e
        pos = torch.cumsum(hit.any(-1).flatten().to(torch.int64), 0).view(W, T) - 1
        out = torch.where(hit, (e * W * T + pos).unsqueeze(-1).to(torch.int32), out)
    return out


def build(s: Shape, device: torch.device, seed: int = 0, num_blocks: int | None = None,
          rank: int = RANK) -> Setup:
    """The stages of ``rank`` at shape ``s`` on ``device`` (module doc), ready to launch."""
    from ..ep.hosts.kernels import combine as HC
    from ..ep.hosts.kernels import dispatch as HD
    from ..ep.hosts.layout import ERR_WORDS
    from ..ep.hosts.peer import default_num_blocks, hosts_consts, make_layout, size_tag
    from ..runtime import protocol as P

    N, R, T, H, K, E, W = s.hosts, s.ranks_per_host, s.tokens, s.hidden, s.topk, s.experts, s.ranks
    L, (host, local), dt = E // W, divmod(rank, R), torch.bfloat16
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else None)
    lay = make_layout(T, H, N, R, s.itemsize, s.fp8, num_experts=E,
                      num_blocks=num_blocks or default_num_blocks(N, R, sms))
    NB, o = lay.num_blocks, lay.offsets
    dc, cc, warps = hosts_consts(lay, E, K, int(s.fp8))
    put = int(dc["SIZES"].PUT_BYTES)       # a plain int: the result file holds it
    # one set of the region is enough: the counters stay at 0, so set 0 is the only one used
    regions = [torch.zeros(lay.set_bytes, dtype=torch.uint8, device=device)
               for _ in range(R + N - 1)]
    sink = {g: regions[R + i] for i, g in enumerate(g for g in range(N) if g != host)}
    tab = torch.tensor([(regions[r % R] if r // R == host else sink[r // R]).data_ptr()
                        for r in range(W)], dtype=torch.int64, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    topks, weights = zip(*(uniform_routing(T, E, K, gen, "cpu") for _ in range(W)))
    srcs = [g * R + local for g in range(N)]            # the rail sources, one per host
    rows = torch.randint(0, 256, (N, T, put), generator=gen, dtype=torch.uint8,
                         device="cpu").to(device)
    d_tag = size_tag(P.OP_DISPATCH, H, K, int(s.fp8), dt)
    c_tag = size_tag(P.OP_COMBINE, H, K, 0, dt)
    d_word, c_word = (1 << P.EPOCH_SHIFT) | d_tag, (1 << P.EPOCH_SHIFT) | c_tag   # ctrl[b] = 0
    me, ids_bytes = regions[local], lay.ids_block_bytes()
    # what the send and the rail would have left: own rows staged, other hosts' id blocks and
    # rows in their receive slots, every flag the forward waits for holding the word
    for g in range(N):
        at = o["d_stage"] if g == host else o["d_rail_rows"] + g * T * lay.row_bytes
        _view(me, at, T * lay.row_bytes, torch.uint8).view(T, -1)[:, :put] = rows[g]
        block = torch.zeros(4 + T * K, dtype=torch.int32, device="cpu")
        block[0], block[4:] = T, topks[srcs[g]].flatten()
        _view(me, o["d_rail_ids"] + g * ids_bytes, 4 + T * K, torch.int32).copy_(block)
    _view(me, o["d_rail_sig"], N, torch.int64).fill_(d_word)
    _view(me, o["d_row_sig"], N * T, torch.int64).fill_(d_word)
    # the combine's: every rank's weights, every awaited partial flag, the handle
    _view(me, o["c_host_w"], W * T * K, torch.float32).copy_(torch.stack(weights).flatten())
    off, n = _extent(lay, "c_part_sig")
    _view(me, off, n // 8, torch.int64).fill_(c_word)
    i32, i64 = torch.int32, torch.int64
    row_of = _row_of(topks, rank, L, T).to(device)
    fwd_ids = torch.stack([topks[q] for q in srcs]).to(dtype=i32, device=device)
    fwd_ntok = torch.full((N,), T, dtype=i32, device=device)
    ntok = torch.full((W,), T, dtype=i32, device=device)
    topk, wts = topks[rank].to(device), weights[rank].to(device)
    eo = torch.randn(L, W * T, H, dtype=torch.float32, device=device).to(dt)
    out = torch.empty(T, H, dtype=dt, device=device)
    err = torch.zeros(ERR_WORDS, dtype=i64, device=device)
    host_words = torch.zeros(2, dtype=torch.int64, device="cpu",
                             pin_memory=device.type == "cuda")
    err[1:3] = torch.tensor([host_words.data_ptr(), host_words.data_ptr() + 8],
                              dtype=i64, device=device)
    ctrl_d = torch.zeros(NB, dtype=i64, device=device)
    ctrl_c = torch.zeros(NB, dtype=i64, device=device)
    ledger = torch.zeros(2, NB, N, 3, dtype=i64, device=device)
    d_args = (torch.zeros(1, H, dtype=dt, device=device), topk, T,
              torch.zeros(1, dtype=torch.uint8, device=device),
              torch.zeros(1, dtype=torch.float32, device=device), row_of,
              torch.zeros(1, dtype=i32, device=device), torch.zeros(L, dtype=i32, device=device),
              torch.zeros(W, dtype=i32, device=device), fwd_ids,
              fwd_ntok, tab, ctrl_d, err, rank, d_tag, TIMEOUT_US, ledger[0], None)
    c_args = (eo, topk, wts, T, out, row_of, ntok, fwd_ids, fwd_ntok, tab, ctrl_c, err, rank,
              c_tag, TIMEOUT_US, ledger[1], None)
    plain = dict(SHMEM=0, MASKS=0, STATS=0, num_warps=warps)

    def launcher(kernel, args, consts, stages):
        return lambda: kernel[(NB,)](*args, **consts, STAGES=stages, **plain)
    launch = {"forward": launcher(HD.hosts_dispatch_kernel, d_args, dc,
                                  HD.HD_FORWARD_OWN | HD.HD_FORWARD),
              "partials": launcher(HC.hosts_combine_kernel, c_args, cc, HC.HC_PARTIALS),
              "host sums": launcher(HC.hosts_combine_kernel, c_args, cc,
                                    HC.HC_HOST_SUM_WAIT | HC.HC_HOST_SUM)}
    # bytes as the model counts them: rows a forwarder writes into its host (its own
    # included), partials this rank forms, partials of its host's ranks the host sums read
    pairs = sum(int(_here(topks[q], (host * R + j) * L, L).sum()) for q in srcs for j in range(R))
    mine = sum(int(_here(t, rank * L, L).sum()) for t in topks)
    nbytes = {"forward": pairs * put, "partials": mine * s.sum_bytes,
              "host sums": pairs * s.sum_bytes}
    return Setup(s, lay, rank, regions, tab, launch, nbytes, rows, list(topks), err, host_words,
                 keep=[d_args, c_args, ledger])


# -- what each stage must place -------------------------------------------------------------------
def _poison(st: Setup, stage: str) -> None:
    """Fill what ``stage`` writes with poison (the host sums also get every rank's partials,
    as the partials stages of the host's ranks would have left them)."""
    lay, s = st.lay, st.shape
    R, local = s.ranks_per_host, st.rank % s.ranks_per_host
    if stage == "forward":
        for reg in st.regions[:R]:
            for name in ("d_host_ntok", "d_host_ids", "d_host_rows"):
                off, n = _extent(lay, name)
                reg[off:off + n].fill_(POISON)
    elif stage == "partials":
        for reg in st.regions[:R]:
            off, n = _extent(lay, "c_part")
            reg[off:off + n].fill_(0xFF)
    else:
        off, n = _extent(lay, "c_part")
        part = _view(st.regions[local], off, n // 2, torch.bfloat16)
        part.copy_(torch.randn(part.shape, dtype=torch.float32, device=part.device))
        for reg in [st.regions[local]] + st.regions[R:]:
            off, n = _extent(lay, "c_back")
            reg[off:off + n].fill_(0xFF)


def _routed(st: Setup, src: int, rank: int) -> torch.Tensor:
    """``[T]`` bool: token t of ``src`` has an expert on ``rank``."""
    L = st.shape.experts // st.shape.ranks
    return _here(st.topks[src], rank * L, L).to(st.rows.device)


def forward_problems(st: Setup) -> list[str]:
    """What the forward placed wrong in each rank of the host: its rows (``d_host_rows``) must
    be the rows each rail source sends that rank, byte for byte, every other slot untouched;
    its ids and token counts (``d_host_ids``, ``d_host_ntok``) every rail source's."""
    s, lay, o = st.shape, st.lay, st.lay.offsets
    N, R, T, K, W = s.hosts, s.ranks_per_host, s.tokens, s.topk, s.ranks
    host, local = divmod(st.rank, R)
    put, dev = st.rows.shape[-1], st.rows.device
    poison32 = torch.tensor([POISON] * 4, dtype=torch.uint8, device="cpu").view(torch.int32)
    problems = []
    for q in range(R):
        reg = st.regions[q]
        want = torch.full((W, T, lay.row_bytes), POISON, dtype=torch.uint8, device=dev)
        ids = poison32.to(dev).repeat(W * T * K).view(W, T, K)
        ntok = poison32.to(dev).repeat(W)
        for g in range(N):
            s_ = g * R + local
            hit = _routed(st, s_, host * R + q)
            want[s_, :, :put] = torch.where(hit.unsqueeze(-1), st.rows[g], want[s_, :, :put])
            ids[s_], ntok[s_] = st.topks[s_].to(ids), T
        got = _view(reg, o["d_host_rows"], W * T * lay.row_bytes, torch.uint8).view(W, T, -1)
        bad = (got != want).any(-1)
        if bool(bad.any()):
            problems.append(f"rank {host * R + q}: {int(bad.sum())} of {W * T} row slots differ "
                            f"from the rows the routing sends it")
        if not torch.equal(_view(reg, o["d_host_ids"], W * T * K, torch.int32).view(W, T, K),
                           ids):
            problems.append(f"rank {host * R + q}: the forwarded ids differ")
        if not torch.equal(_view(reg, o["d_host_ntok"], W, torch.int32), ntok):
            problems.append(f"rank {host * R + q}: the forwarded token counts differ")
    return problems


def _filled(slots: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` bf16 -> ``[...]`` bool: the slot holds no NaN (its poison)."""
    return ~torch.isnan(slots.float()).any(-1)


def combine_problems(st: Setup, stage: str) -> list[str]:
    """The partials must fill exactly the slots of the tokens with an expert on this rank, in
    their forwarders' regions; the host sums exactly those of the rail sources' tokens routed
    to this host, here for the own host's, at the token's rail rank for the others'."""
    s, o = st.shape, st.lay.offsets
    N, R, T, H = s.hosts, s.ranks_per_host, s.tokens, s.hidden
    host, local = divmod(st.rank, R)
    problems = []
    for g in range(N):
        for j in range(R):
            src = g * R + j
            if stage == "partials":
                reg, want = st.regions[j], _routed(st, src, st.rank)
                at = o["c_part"] + ((local * N + g) * T) * H * 2
            elif j == local:
                reg = st.regions[local] if g == host else st.regions[R + g - (g > host)]
                want = torch.stack([_routed(st, src, host * R + q) for q in range(R)]).any(0)
                at = o["c_back"] + (g if g == host else host) * T * H * 2
            else:
                continue
            got = _filled(_view(reg, at, T * H, torch.bfloat16).view(T, H))
            if not torch.equal(got, want):
                problems.append(f"{stage}: source rank {src}: {int((got != want).sum())} of "
                                f"{T} slots filled where the routing says otherwise")
    return problems


def measure(st: Setup, timer: Callable) -> list[dict]:
    """Each stage: poisoned, timed (``timer(launch)`` -> (median, p10, p90) µs per launch),
    then checked. One row per stage; RuntimeError naming every problem."""
    s, rows, problems = st.shape, [], []
    for stage in CALIBRATED_STAGES:
        _poison(st, stage)
        median, p10, p90 = timer(st.launch[stage])
        if st.err.device.type == "cuda":
            torch.cuda.synchronize(st.err.device)
        word = int(st.err[0]) or int(st.host_words[0])
        if word:
            problems.append(f"{stage}: the kernel reported error word {word:#x}")
        problems += (forward_problems(st) if stage == "forward" else combine_problems(st, stage))
        rows.append({"stage": stage, "ranks": s.ranks, "ranks_per_host": s.ranks_per_host,
                     "tokens": s.tokens, "hidden": s.hidden, "experts": s.experts,
                     "topk": s.topk, "fp8": s.fp8, "dtype": "bfloat16",
                     "blocks": st.lay.num_blocks, "rank": st.rank, "bytes": st.nbytes[stage],
                     "median_us": median, "p10_us": p10, "p90_us": p90})
    if problems:
        raise RuntimeError(f"EP{s.ranks}: " + "; ".join(problems))
    return rows


# -- the command ----------------------------------------------------------------------------------
def graph_timer(ops: int, replays: int, warmup: int) -> Callable:
    """``timer(fn)``: a CUDA graph of ``ops`` calls (``timing.capture``, which calls ``fn``
    once first), ``warmup`` replays, then ``replays`` timed ones (``timing.replay_us``, this
    process only): (median, p10, p90) µs per call."""
    from .timing import Timing, capture, replay_us, stats_of
    t = Timing(torch.device("cuda", torch.cuda.current_device()), replays, warmup, ops)

    def timer(fn):
        s = stats_of(replay_us(capture(fn, ops), t))
        return s.median_us, s.p10_us, s.p90_us
    return timer


def gpu_tag(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the model number of a device name, lower case."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name.upper().replace("NVIDIA", " "))
    return m.group(1).lower() if m else (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
                                         or "gpu")


def default_path(device: torch.device) -> str:
    """``bench/results/<gpu>x1-ep-calibration.json`` for this device."""
    return str(RESULTS / f"{gpu_tag(torch.cuda.get_device_name(device))}x1{CALIBRATION_SUFFIX}")


def run(a, shapes) -> int:
    """Calibrate at ``shapes`` on this machine's GPU and write the result file; 2 without a
    GPU, 1 when a stage fails its check (nothing written)."""
    if a.cpu or not torch.cuda.is_available():
        print("llcomm bench ep --calibrate: needs a CUDA GPU (it times the kernels on one)")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    timer, rows = graph_timer(a.graph_ops, a.iters, a.warmup), []
    for s in shapes:
        print(f"# EP{s.ranks}: {s.hosts} hosts of {s.ranks_per_host}, {s.tokens} tokens, hidden "
              f"{s.hidden}, top-{s.topk} of {s.experts}", flush=True)
        try:
            rows += measure(build(s, device, a.seed), timer)
        except RuntimeError as e:
            print(f"llcomm bench ep --calibrate: {e}")
            return 1
        torch.cuda.empty_cache()
    print("| EP | stage | MB | median µs | p10 µs | p90 µs | GB/s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['stage']} | {r['bytes'] / 1e6:.2f} | {r['median_us']:.2f} | "
              f"{r['p10_us']:.2f} | {r['p90_us']:.2f} | {r['bytes'] / r['median_us'] / 1e3:.0f} |")
    path = a.json or default_path(device)
    result = {**result_files.result_header(1, device), "bench": "ep-calibration",
              "command": "llcomm bench ep --calibrate", "what": WHAT,
              "config": {"graph_ops": a.graph_ops, "replays": a.iters, "warmup": a.warmup,
                         "seed": a.seed}, "rows": rows}
    result_files.write_json(path, result)
    print(f"wrote {path}")
    return 0
