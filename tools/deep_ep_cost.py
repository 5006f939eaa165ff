"""What ``llcomm.deep_ep`` adds to ``EPBuffer``, in CUDA-graph replay on one GPU.

    python tools/deep_ep_cost.py [--tokens 128] [--hidden 7168] [--experts 256] [--topk 8]
                                 [--ops 20] [--replays 200] [--stats] [--json PATH]
                                 [--plot PATH] [--llcomm DIR]

A group of one rank on cuda:0 (as ``tools/ep_timeline.py --one-rank``: every expert is local,
no link), DeepSeek-V3's shape by default. Times, per call, the median over graph replays of
``--ops`` back-to-back calls (``llcomm.bench.timing``):

- ``EPBuffer.dispatch`` (bf16, FP8, FP8 with power-of-two scales) against
  ``deep_ep.Buffer.low_latency_dispatch`` (bf16, FP8, FP8 + UE8M0), whose dispatch kernel also
  writes DeepEP's layouts (``EPBuffer.dispatch(deep_ep=...)``): the difference is what that
  and the wrapper cost;
- ``EPBuffer.combine`` against ``low_latency_combine`` (no conversion: the difference is the
  wrapper's own work, none of it on the device).

Before timing, the deep_ep outputs of each variant are compared with convert.py's torch ops
applied to ``EPBuffer.dispatch``'s outputs of the same inputs (filled rows, ``layout_range``
and the statistics must be equal). ``--stats`` passes ``cumulative_local_expert_recv_stats``
to the deep_ep dispatches.
``--json`` writes a result file (commit, machine, versions, both columns of every variant),
``--plot`` a bar chart of it; ``--plot`` with ``--from-json PATH`` redraws a written file
without a GPU. Not part of the test suite.
"""
import json

import torch
import torch.distributed as dist

from _checkout import argument_parser, use_llcomm_dir

use_llcomm_dir()

import llcomm.deep_ep as deep_ep  # noqa: E402  (--llcomm DIR first)
from llcomm.deep_ep import convert  # noqa: E402  (--llcomm DIR first)
from llcomm.ep.layout import FP8_BLOCK  # noqa: E402  (--llcomm DIR first)
from llcomm.bench.result_files import result_header, write_json  # noqa: E402  (--llcomm DIR first)
from llcomm.bench.timing import Timing, capture, time_graph  # noqa: E402  (--llcomm DIR first)

#: The dispatch variants: (name, EPBuffer.dispatch kwargs, low_latency_dispatch kwargs).
VARIANTS = (
    ("bf16", {}, dict(use_fp8=False)),
    ("fp8", dict(use_fp8=True), dict(use_fp8=True)),
    ("fp8+ue8m0", dict(use_fp8=True, round_scale=True),
     dict(use_fp8=True, round_scale=True, use_ue8m0=True)),
)


#: A result file's description of what was timed.
WHAT = ("EPBuffer.dispatch / combine against llcomm.deep_ep.Buffer.low_latency_dispatch / "
        "low_latency_combine, one rank, every expert local, CUDA-graph replay: median us per "
        "call over the replays of back-to-back calls; deep_ep's outputs checked against the "
        "torch conversion of EPBuffer's before timing")


def plot(result: dict, path: str) -> None:
    """Both columns of every variant as pairs of bars, the difference written above."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    us = {(r["op"], r["variant"], r["impl"]): r["median_us"] for r in result["rows"]}
    keys = list(dict.fromkeys((op, v) for op, v, _ in us))
    names = [f"{op} {v}" for op, v in keys]
    ep = [us[k + ("EPBuffer",)] for k in keys]
    deep = [us[k + ("deep_ep",)] for k in keys]
    xs = range(len(keys))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar([x - 0.2 for x in xs], ep, 0.4, label="EPBuffer")
    ax.bar([x + 0.2 for x in xs], deep, 0.4, label="llcomm.deep_ep")
    for x, a, b in zip(xs, ep, deep):
        ax.annotate(f"{b - a:+.2f}", (x, max(a, b)), ha="center", xytext=(0, 3),
                    textcoords="offset points")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("µs per call (median of graph replays)")
    c = result["config"]
    ax.set_title(f"llcomm.deep_ep vs EPBuffer, {result.get('machine', '?')}, "
                 f"commit {str(result.get('commit'))[:7]}\n{c['tokens']} tokens, hidden "
                 f"{c['hidden']}, {c['experts']} experts, top-{c['topk']}, one rank")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def result_rows(pairs: list[tuple[str, str, float, float]], tokens: int, hidden: int,
                experts: int, topk: int) -> list[dict]:
    """(op, variant, EPBuffer µs, deep_ep µs) as the result files' rows, one per implementation;
    ``bytes``: the rows the dispatch delivers (FP8: codes and fp32 scales)."""
    rows = []
    for op, variant, t_ep, t_deep in pairs:
        fp8 = variant.startswith("fp8")
        row_bytes = hidden + hidden // FP8_BLOCK * 4 if fp8 else hidden * 2
        for impl, t in (("EPBuffer", t_ep), ("deep_ep", t_deep)):
            rows.append(dict(op=op, impl=impl, variant=variant, mode="graph", dtype="bfloat16",
                             world_size=1, tokens_per_rank=tokens, hidden=hidden,
                             num_experts=experts, topk=topk, fp8=fp8,
                             bytes=tokens * topk * row_bytes, median_us=round(t, 3), wrong=0))
    return rows


def agree(buf, x, idx, ep_kw, kw, stats) -> list[str]:
    """deep_ep's outputs of one dispatch against convert.py's torch ops applied to
    ``EPBuffer.dispatch``'s outputs of the same inputs: what differs (filled rows only)."""
    ep = buf.ep_buffer
    L, R, W, T = ep.num_local_experts, ep.num_ranks * ep.max_tokens, ep.num_ranks, ep.max_tokens
    s0 = stats.clone() if stats is not None else None
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(
        x, idx, T, ep.num_experts, cumulative_local_expert_recv_stats=s0, **kw)
    ep_x, ep_count, h = ep.dispatch(x, idx, **ep_kw)
    dev = ep.device
    src = torch.empty((L, R), dtype=torch.int32, device=dev)
    convert.source_token(h.src_info, T, src)
    lay = torch.empty((L, W), dtype=torch.int64, device=dev)
    convert.layout_range(h.src_info, ep_count, convert.layout_aux(L, R, T, W, dev), lay)
    sc = None
    if isinstance(ep_x, tuple):
        sc = convert.scales_storage(L, R, ep.hidden, kw.get("use_ue8m0", False), dev)
        convert.fill_scales(sc, ep_x[1], kw.get("use_ue8m0", False))
    torch.cuda.synchronize()
    bad = []
    if not torch.equal(count, ep_count):
        bad.append("recv_count")
    if not torch.equal(handle[1], lay):
        bad.append("layout_range")
    if stats is not None and not torch.equal(s0, stats + ep_count):
        bad.append("stats")
    for e, n in enumerate(ep_count.tolist()):
        if not torch.equal(handle[0][e, :n], src[e, :n]):
            bad.append(f"src_info of expert {e}")
        if sc is not None and not torch.equal(recv_x[1][e, :n].contiguous().view(torch.int32),
                                              sc[e, :n].contiguous().view(torch.int32)):
            bad.append(f"scales of expert {e}")
        if not torch.equal((recv_x[0] if sc is not None else recv_x)[e, :n].view(torch.uint8),
                           (ep_x[0] if sc is not None else ep_x)[e, :n].view(torch.uint8)):
            bad.append(f"rows of expert {e}")
    return bad


def main():
    ap = argument_parser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ops", type=int, default=20, help="calls per graph")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--stats", action="store_true",
                    help="pass cumulative_local_expert_recv_stats to the deep_ep dispatches")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="a PNG of the result")
    ap.add_argument("--from-json", default=None, metavar="PATH",
                    help="draw --plot from this result file instead of measuring")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            plot(json.load(f), a.plot or a.from_json.removesuffix(".json") + ".png")
        return
    if not torch.cuda.is_available():
        raise SystemExit("tools/deep_ep_cost.py times kernels: it needs a CUDA GPU")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,  # a group of
                            device_id=device)                           # one: no port to pick
    T, H, E = a.tokens, a.hidden, a.experts
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=gen, device=device).topk(a.topk, dim=1).indices
    w = torch.rand(T, a.topk, generator=gen, device=device)
    buf = deep_ep.Buffer(backend="peer")
    buf.clean_low_latency_buffer(T, H, E)
    ep = buf.ep_buffer
    stats = torch.zeros(ep.num_local_experts, dtype=torch.int32, device=device) \
        if a.stats else None
    timing = Timing(device, a.replays, a.warmup, a.ops)

    def us(fn):
        return time_graph(capture(fn, a.ops), timing).median_us

    pairs = []
    for name, ep_kw, deep_kw in VARIANTS:
        bad = agree(buf, x, idx, ep_kw, deep_kw, stats)
        if bad:
            raise SystemExit(f"{name}: deep_ep's outputs differ from the torch ops' conversion "
                             f"of EPBuffer's: {', '.join(bad[:8])}")
        t_ep = us(lambda: ep.dispatch(x, idx, **ep_kw))

        def deep():
            buf.low_latency_dispatch(x, idx, T, E, cumulative_local_expert_recv_stats=stats,
                                     **deep_kw)
        pairs.append(("dispatch", name, t_ep, us(deep)))
    # combine: a handle of a dispatch of its own, made just before each graph
    rx, _, h = ep.dispatch(x, idx)
    y = rx.clone()
    t_ep = us(lambda: ep.combine(y, idx, w, h))
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    t_deep = us(lambda: buf.low_latency_combine(y, idx, w, handle))
    pairs.append(("combine", "bf16", t_ep, t_deep))
    ep.check()

    print(f"# {T} tokens, hidden {H}, {E} experts, top-{a.topk}, one rank on "
          f"{torch.cuda.get_device_name(device)}; median µs per call over {a.replays} replays of "
          f"{a.ops} calls{' (with stats)' if a.stats else ''}")
    print(f"{'op':9s} {'variant':10s} {'EPBuffer':>9s} {'deep_ep':>9s} {'diff':>7s}")
    for op, variant, t_ep, t_deep in pairs:
        print(f"{op:9s} {variant:10s} {t_ep:9.2f} {t_deep:9.2f} {t_deep - t_ep:7.2f}")
    result = {**result_header(1, device), "command": "python tools/deep_ep_cost.py --json PATH",
              "what": WHAT, "config": dict(tokens=T, hidden=H, experts=E, topk=a.topk,
                                           ops=a.ops, replays=a.replays, stats=a.stats),
              "rows": result_rows(pairs, T, H, E, a.topk)}
    if a.json:
        write_json(a.json, result)
        print(f"wrote {a.json}")
    if a.plot:
        plot(result, a.plot)
        print(f"wrote {a.plot}")
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
