"""Where an EP dispatch / combine spends its time, stage by stage, on this host's GPUs.

    python tools/ep_timeline.py [--tokens 1,128] [--hidden 7168] [--experts 256] [--topk 8]
                                [--fp8] [--replays 50] [--json PATH] [--one-rank] [--llcomm DIR]

Runs EPBuffer with ``LLCOMM_EP_PROFILE=1``: every block of the kernels stamps its SM cycle
counter at each stage boundary (and the global timer at its start and end) into the buffer's
private ``err`` tensor (``_stamp`` in ``llcomm/ep/kernels/common.py``). A CUDA graph of ``--ops``
back-to-back dispatch + combine pairs is replayed; the stamps of the last pair of each replay
(ranks in lockstep by then) are read back. Cycles become µs by the ratio of global-timer to cycle
spans over all blocks. Prints, per rank, the median (and p90) over blocks and replays of each stage,
the kernel span (first block start to last block end) and the spread of block start times.

Needs two or more GPUs with peer access (the peer backend); not part of the test suite.
``--one-rank`` runs one rank on GPU 0 instead (a group of one: every expert is local), for a
one-GPU machine: no link, but the scan and the expand write as many rows per rank as at two
ranks (every token's top-k pairs land locally), so the local stages can be worked on there.
It also prints the graph's time per dispatch + combine pair (CUDA events over each replay).
"""
import json
import os
import statistics

import torch
import torch.distributed as dist

from _checkout import argument_parser, use_llcomm_dir

use_llcomm_dir()

from llcomm.bench import spawn  # noqa: E402  (--llcomm DIR first)
from llcomm.runtime.fp8_format import dequantize  # noqa: E402  (--llcomm DIR first)
from llcomm.ep.layout import ERR_PROF, PROF_WORDS  # noqa: E402  (--llcomm DIR first)

def stage_names(ll: int) -> dict:
    """Stage names, slot i = the stage that ends at stamp i (stamp 0 is the kernel start), for
    the flag dispatch or the LL one (``ll``: no signal, no wait; each word is waited for where
    the expand reads it). The flag dispatch pushes its rows before the top-k scan, the LL one
    after it."""
    first = (("scan top-k", "push rows, counts, metadata") if ll else
             ("push rows", "scan top-k, counts, metadata"))
    rest = (("wait + expand own pairs", "wait for the peers' last row",
             "expand the peers' pairs") if ll else
            ("signal", "wait (all blocks, all ranks)", "expand"))
    return {"dispatch": first + rest,
            "combine": ("push weights", "wait weights", "reduce + push partials",
                        "wait partials", "sum")}
CYCLE_SLOTS = PROF_WORDS - 2          # then global timer start, end


def _inputs(rank, cfg, device):
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    T, H, E, K = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    return x, idx, w


def _summary(stamps, nb, names):
    """stamps: [replays, 2, nb, PROF_WORDS] int64 -> per kernel kind, stage medians in µs
    (``names``: ``stage_names``)."""
    cyc = stamps[..., :CYCLE_SLOTS].double()
    gt0, gt1 = stamps[..., CYCLE_SLOTS].double(), stamps[..., CYCLE_SLOTS + 1].double()
    out = {}
    for kind, name in enumerate(("dispatch", "combine")):
        c, a, b = cyc[:, kind], gt0[:, kind], gt1[:, kind]
        ns_per_cycle = float((b - a).sum() / (c[..., -1] - c[..., 0]).sum())
        stages = {}
        for i, label in enumerate(names[name]):
            d = ((c[..., i + 1] - c[..., i]) * ns_per_cycle / 1e3).flatten().tolist()
            d.sort()
            stages[label] = {"median_us": statistics.median(d),
                             "p90_us": d[int(0.9 * (len(d) - 1))], "max_us": d[-1]}
        span = ((b.max(1).values - a.min(1).values) / 1e3).tolist()
        skew = ((a.max(1).values - a.min(1).values) / 1e3).tolist()
        out[name] = {"stages": stages, "span_us": statistics.median(span),
                     "start_spread_us": statistics.median(skew),
                     "ns_per_cycle": ns_per_cycle}
    return out


def _rank(rank, world, cfg):
    import llcomm.ep as ep
    device = torch.device("cuda", rank)
    buf = ep.EPBuffer(num_experts=cfg["experts"], hidden=cfg["hidden"],
                      num_max_dispatch_tokens_per_rank=cfg["tokens"], backend="peer")
    assert buf._impl.profile, "LLCOMM_EP_PROFILE=1 was not seen by the buffer"
    x, idx, w = _inputs(rank, cfg, device)
    nb = buf._impl.nb
    prof = buf._impl.err[ERR_PROF:ERR_PROF + 2 * nb * PROF_WORDS].view(2, nb, PROF_WORDS)

    # FP8: the combine sums rows dequantised once, here, outside the graph. Dequantising inside
    # it would move about 4.5 GB through HBM per pair at 128 tokens (the whole
    # [L, W * T, H] buffer, through fp32), so every dispatch and combine of the FP8 timeline
    # would start with L2 swept, unlike the bf16 one and unlike the FP8 bench (dispatches only).
    rows_fp8 = None
    if cfg["fp8"]:
        (q, sc), _, _ = buf.dispatch(x, idx, use_fp8=True)
        rows_fp8 = dequantize(q, sc)

    def pair():
        if cfg["fp8"]:
            _, _, h = buf.dispatch(x, idx, use_fp8=True)
            rows = rows_fp8
        else:
            rows, _, h = buf.dispatch(x, idx)
        buf.combine(rows, idx, w, h)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            pair()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(cfg["ops"]):
            pair()
    got, pair_us = [], []
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(cfg["replays"]):
        dist.barrier()
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        pair_us.append(t0.elapsed_time(t1) * 1e3 / cfg["ops"])
        got.append(prof.clone().cpu())
    buf.check()
    mine = _summary(torch.stack(got), nb, stage_names(buf._impl.ll))
    mine["pair_us"] = statistics.median(pair_us)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    buf.close()
    return everyone


def main():
    ap = argument_parser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--ops", type=int, default=10, help="dispatch + combine pairs per graph")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one-rank", action="store_true",
                    help="one rank on GPU 0 (a one-GPU machine): local stages only")
    a = ap.parse_args()
    os.environ["LLCOMM_EP_PROFILE"] = "1"
    world, backend = spawn.plan()
    if a.one_rank:
        world = 1
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,  # a group
                                device_id=torch.device("cuda", 0))      # of one: no port to pick
    elif backend != "nccl":
        raise SystemExit("ep_timeline needs two or more GPUs (or --one-rank)")
    results = []
    for t in (int(v) for v in a.tokens.split(",")):
        cfg = dict(tokens=t, hidden=a.hidden, experts=a.experts, topk=a.topk, fp8=a.fp8,
                   ops=a.ops, replays=a.replays)
        per_rank = _rank(0, 1, cfg) if a.one_rank else spawn.launch(_rank, cfg)
        results.append({"config": cfg, "ranks": per_rank})
        for r, summ in enumerate(per_rank):
            print(f"# {t} tokens/rank, rank {r}: {summ['pair_us']:.2f} µs per dispatch + "
                  "combine pair (graph replay)")
            for kind, v in summ.items():
                if kind == "pair_us":
                    continue
                print(f"# {kind}, {t} tokens/rank, rank {r}: span {v['span_us']:.1f} µs, block "
                      f"starts spread {v['start_spread_us']:.1f} µs")
                for label, st in v["stages"].items():
                    print(f"  {label:30s} median {st['median_us']:7.2f}  p90 {st['p90_us']:7.2f}"
                          f"  max {st['max_us']:7.2f} µs")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world_size": world, "commit": os.environ.get("LLCOMM_COMMIT"),
                       "llcomm": a.llcomm, "runs": results}, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
