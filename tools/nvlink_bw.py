"""How fast can kernels move bytes to (or from) a peer GPU over NVLink? (2+ GPUs)

    python tools/nvlink_bw.py [--sizes 1835008,8388608] [--reps 20] [--json PATH]

Every rank moves ``size`` bytes to the next rank at the same time (both directions of a link
busy, as in an all-reduce or an EP dispatch), each way timed as a CUDA graph of ``--reps``
back-to-back launches, and prints GB/s per direction (the slowest rank). The ways:

- ``push``: SM stores into the peer's memory, a grid of ``blocks`` x ``warps``, each thread
  storing ``vec`` 16-byte vectors per iteration (what llcomm's kernels do today: about 240 GB/s
  at 128 x 8 warps x 1 in session 1);
- ``push_cs``: the same with streaming (``.cs``) stores;
- ``pull``: SM loads from the peer's memory into local memory;
- ``tma``: the block stages a tile in shared memory and a TMA bulk store writes it to the peer
  (``tl.make_tensor_descriptor`` on the peer's address; Triton >= 3.4);
- ``copy_engine``: ``Tensor.copy_`` into the peer's buffer (cudaMemcpyAsync; GPU-NOTES.md
  measured 393 GB/s);
- first, ``noop``: a kernel that moves nothing, 1 and 128 blocks: the floor of one graph node,
  which every small op pays (issue 3's 2 µs at 8 KB is that plus one NVLink crossing).

This is a measurement tool for choosing how llcomm's kernels should move data (issues 2-5: all
of their large-message costs are push rates); nothing in the library depends on it.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llcomm.bench import common as C  # noqa: E402
from llcomm.runtime.workspace import SymmetricWorkspace  # noqa: E402

#: (blocks, warps, vec): grids tried for the SM ways; vec = 16-byte vectors per thread per step.
GRIDS = ((128, 8, 1), (132, 8, 1), (132, 16, 1), (132, 8, 4), (264, 8, 1), (132, 4, 4),
         (66, 16, 2))
#: TMA tiles: [rows, 64] int32 (256-byte rows), rows per block-iteration.
TMA_ROWS = (32, 64)
TMA_COLS = 64


@triton.jit
def _move(src, dst, n, BLOCK: tl.constexpr, CS: tl.constexpr):
    """int32 words ``[0, n)`` from ``src`` to ``dst``, grid-strided, BLOCK words per step."""
    b = tl.program_id(0)
    nb = tl.num_programs(0)
    src = tl.multiple_of(src, 16)
    dst = tl.multiple_of(dst, 16)
    lanes = tl.arange(0, BLOCK)
    for start in range(b * BLOCK, n, nb * BLOCK):
        offs = start + lanes
        m = offs < n
        v = tl.load(src + offs, mask=m)
        if CS:
            tl.store(dst + offs, v, mask=m, cache_modifier=".cs")
        else:
            tl.store(dst + offs, v, mask=m)


@triton.jit
def _noop(flag):
    """Nothing but a store by block 0: the cost of one kernel in a graph (the floor every op
    pays)."""
    if tl.program_id(0) == 0:
        tl.store(flag, 1)


@triton.jit
def _tma_push(src, dst, rows, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``rows`` x COLS int32 from ``src`` to ``dst`` (the peer's), one TMA store per tile."""
    b = tl.program_id(0)
    nb = tl.num_programs(0)
    desc = tl.make_tensor_descriptor(dst, shape=[rows, COLS], strides=[COLS, 1],
                                     block_shape=[ROWS, COLS])
    r = tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    for r0 in range(b * ROWS, rows, nb * ROWS):
        v = tl.load(src + (r0 + r)[:, None] * COLS + c[None, :], mask=(r0 + r)[:, None] < rows)
        desc.store([r0, 0], v)


def _time(fn, reps: int, device) -> float:
    """Per-launch µs of ``fn`` in a graph of ``reps`` launches, slowest rank, median of 5."""
    fn()
    torch.cuda.synchronize()
    g = C.capture(fn, reps)
    return C.time_graph(g, C.Timing(device=device, iters=5, warmup=2, ops=reps)).median_us


def rank_main(rank: int, world: int, cfg: dict) -> list[dict]:
    device = torch.device("cuda", rank)
    top = max(cfg["sizes"])
    ws = SymmetricWorkspace(dist.group.WORLD, {"src": top, "dst": top}, device)
    peer = (rank + 1) % world
    src_local = ws.local("src", torch.int32)
    src_local.copy_(torch.arange(src_local.numel(), device=device, dtype=torch.int32))
    dst_local = ws.local("dst", torch.int32)
    peer_src = ws.handle.get_buffer(peer, (top // 4,), torch.int32, ws.offsets["src"] // 4)
    peer_dst = ws.handle.get_buffer(peer, (top // 4,), torch.int32, ws.offsets["dst"] // 4)

    def scratch(size, alignment, stream):      # TMA descriptors live in global memory
        return torch.empty(size, device=device, dtype=torch.int8)
    if hasattr(triton, "set_allocator"):
        triton.set_allocator(scratch)

    rows = []
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for blocks in (1, 128):             # the launch floor of a graph kernel, no data
        row = {"size": 0, "way": "noop", "grid": f"{blocks} blocks"}
        row["us"] = _time(lambda blocks=blocks: _noop[(blocks,)](flag), cfg["reps"], device)
        rows.append(row)
    # TMA last, after every size: a fault there (peer addresses in a descriptor) would end
    # the process and lose what follows
    plan = [(size, kind) for kind in ("sm", "tma") for size in cfg["sizes"]]
    for size, kind in plan:
        n = size // 4
        ways = []
        for blocks, warps, vec in GRIDS if kind == "sm" else ():
            block = warps * 32 * 4 * vec
            for name, s, d, cs in (("push", src_local, peer_dst, 0), ("push_cs", src_local, peer_dst, 1),
                                   ("pull", peer_src, dst_local, 0)):
                ways.append((name, f"{blocks}x{warps}w x{vec}", lambda s=s, d=d, cs=cs, blocks=blocks,
                             warps=warps, block=block: _move[(blocks,)](
                                 s, d, n, BLOCK=block, CS=cs, num_warps=warps)))
        for tr in TMA_ROWS if kind == "tma" else ():
            nrows = n // TMA_COLS
            ways.append(("tma", f"132x4w {tr}x{TMA_COLS}", lambda tr=tr, nrows=nrows: _tma_push[(132,)](
                src_local, peer_dst, nrows, ROWS=tr, COLS=TMA_COLS, num_warps=4)))
        if kind == "sm":
            ways.append(("copy_engine", "-", lambda n=n: peer_dst[:n].copy_(src_local[:n])))
        for name, grid, fn in ways:
            row = {"size": size, "way": name, "grid": grid}
            what = [None]
            if C.attempt(lambda: row.update(us=_time(fn, cfg["reps"], device)), what, device):
                row["gbps"] = size / row["us"] / 1e3
            else:
                row["error"] = what[0]
            if name in ("push", "tma"):     # the bytes arrived (a broken push would look fast)
                torch.cuda.synchronize()
                dist.barrier()
                want = torch.arange(n, device=device, dtype=torch.int32)
                row["wrong"] = C.sum_over_ranks(int((dst_local[:n] != want).sum()), device)
                dst_local.zero_()
                torch.cuda.synchronize()
                dist.barrier()
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1835008,8388608", help="bytes per direction, comma list")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if C.plan()[1] != "nccl":
        print("needs two or more GPUs")
        return 2
    sizes = [int(s) // 1024 * 1024 for s in a.sizes.split(",")]
    rows = C.launch(rank_main, {"sizes": sizes, "reps": a.reps})
    print("# per-direction GB/s, every rank pushing to the next at once; graph of "
          f"{a.reps} launches, slowest rank, median")
    print(f"{'bytes':>9} {'way':>12} {'grid':>16} {'µs':>8} {'GB/s':>7} wrong")
    for r in rows:
        print(f"{r['size']:>9} {r['way']:>12} {r['grid']:>16} {r.get('us', float('nan')):8.1f} "
              f"{r.get('gbps', float('nan')):7.1f} {r.get('wrong', '')} {r.get('error', '')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": "see nvidia-smi", "commit": os.environ.get("LLCOMM_COMMIT"),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
