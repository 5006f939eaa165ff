"""What ``llcomm.deep_ep`` adds to ``EPBuffer``, in CUDA-graph replay on one GPU.

    python tools/deep_ep_cost.py [--tokens 128] [--hidden 7168] [--experts 256] [--topk 8]
                                 [--ops 20] [--replays 200] [--stats] [--json PATH]
                                 [--llcomm DIR]

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
Not part of the test suite.
"""
import json
import os

import torch
import torch.distributed as dist

from _checkout import argument_parser, use_llcomm_dir

use_llcomm_dir()

import llcomm.deep_ep as deep_ep  # noqa: E402  (--llcomm DIR first)
from llcomm.deep_ep import convert  # noqa: E402  (--llcomm DIR first)
from llcomm.bench import spawn  # noqa: E402  (--llcomm DIR first)
from llcomm.bench.timing import Timing, capture, time_graph  # noqa: E402  (--llcomm DIR first)

#: The dispatch variants: (name, EPBuffer.dispatch kwargs, low_latency_dispatch kwargs).
VARIANTS = (
    ("bf16", {}, dict(use_fp8=False)),
    ("fp8", dict(use_fp8=True), dict(use_fp8=True)),
    ("fp8+ue8m0", dict(use_fp8=True, round_scale=True),
     dict(use_fp8=True, round_scale=True, use_ue8m0=True)),
)


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
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/deep_ep_cost.py times kernels: it needs a CUDA GPU")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{spawn.free_port()}", rank=0,
                            world_size=1, device_id=device)
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

    rows = []
    for name, ep_kw, deep_kw in VARIANTS:
        bad = agree(buf, x, idx, ep_kw, deep_kw, stats)
        if bad:
            raise SystemExit(f"{name}: deep_ep's outputs differ from the torch ops' conversion "
                             f"of EPBuffer's: {', '.join(bad[:8])}")
        t_ep = us(lambda: ep.dispatch(x, idx, **ep_kw))

        def deep():
            buf.low_latency_dispatch(x, idx, T, E, cumulative_local_expert_recv_stats=stats,
                                     **deep_kw)
        rows.append(dict(op="dispatch", variant=name, ep_us=t_ep, deep_ep_us=us(deep)))
    # combine: a handle of a dispatch of its own, made just before each graph
    rx, _, h = ep.dispatch(x, idx)
    y = rx.clone()
    t_ep = us(lambda: ep.combine(y, idx, w, h))
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    t_deep = us(lambda: buf.low_latency_combine(y, idx, w, handle))
    rows.append(dict(op="combine", variant="bf16", ep_us=t_ep, deep_ep_us=t_deep))
    ep.check()

    print(f"# {T} tokens, hidden {H}, {E} experts, top-{a.topk}, one rank on "
          f"{torch.cuda.get_device_name(device)}; median µs per call over {a.replays} replays of "
          f"{a.ops} calls{' (with stats)' if a.stats else ''}")
    print(f"{'op':9s} {'variant':10s} {'EPBuffer':>9s} {'deep_ep':>9s} {'diff':>7s}")
    for r in rows:
        print(f"{r['op']:9s} {r['variant']:10s} {r['ep_us']:9.2f} {r['deep_ep_us']:9.2f} "
              f"{r['deep_ep_us'] - r['ep_us']:7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": dict(tokens=T, hidden=H, experts=E, topk=a.topk, ops=a.ops,
                                      replays=a.replays, stats=a.stats),
                       "device": torch.cuda.get_device_name(device),
                       "commit": os.environ.get("LLCOMM_COMMIT"), "llcomm": a.llcomm,
                       "rows": rows}, f, indent=1)
        print(f"wrote {a.json}")
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
