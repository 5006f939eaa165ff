"""``llcomm bench ep --model`` and ``--calibrate``: the printout of the two-level kernels' cost
model (``ep_model``) and the options of both.

``--model`` prints, per EP size, every stage (when it runs, what bounds it, its share of the
critical path) and each op's time with the stage that limits it and why, next to the project's
goals and published figures; it starts no process. Its in-host stages come from a calibration
file (``--calibration FILE``; by default the newest
``bench/results/<gpu>x1-ep-calibration.json``) or, without one (or with ``--no-calibration``),
from the 2-GPU scaling (``ep_inhost``).
``--calibrate`` times those stages on this machine's GPU and writes such a file
(``ep_calibrate``).
"""
from __future__ import annotations

import math
from dataclasses import replace

from . import ep_inhost, options
from .ep_model import MB, MODEL_EPS, MODEL_SHAPE, LinkParams, Shape, combine_model, dispatch_model

#: Published dispatch / combine µs at MODEL_SHAPE (FP8 dispatch, bf16 combine), by EP: (name,
#: dispatch, combine, approximate). Their authors' figures; none was measured here. DeepEP V1:
#: the low-latency table of DeepEP's README before its version 2 (H800, CX7 400 Gb/s); the
#: layered mode: DeepEP's pull request 500, read from the request's logs.
ANCHORS = {16: (("DeepEP V1 low-latency", 118, 195, False), ("pplx-garden", 110, 186, False),
                ("NCCL EP (bf16)", 191, 201, True),
                ("DeepEP layered low-latency (PR 500)", 37, 67, True)),
           32: (("DeepEP V1 low-latency", 155, 273, False),),
           64: (("DeepEP V1 low-latency", 173, 314, False),)}
#: The project's goal, dispatch / combine µs, by EP.
GOALS = {16: (30, 55), 64: (80, 150)}
#: Why a stage bound by each of these takes its time, as the summary says it.
WHY = {"NIC": "NIC bandwidth", "NIC rate": "NIC message rate", "NVLink": "NVLink bandwidth",
       "HBM": "HBM bandwidth", "in host (scaled)": "the in-host stage scaled from 2 GPUs",
       "in host (calibrated)": "the in-host calibration"}


# -- the tables ---------------------------------------------------------------------------------
def _num(v: float, digits: int) -> str:
    return f"{v:.{digits}f}" if v else ""


def _runs(m, i: int) -> str:
    """When stage i starts: first, after the previous stage, or during it."""
    if i == 0:
        return "first"
    return f"{'during' if m.stages[i].overlaps else 'after'} {m.stages[i - 1].name}"


def ep_table(s: Shape, p: LinkParams) -> list[str]:
    """One configuration's tables: every stage (µs alone; for a stage that overlaps the one
    before it, its last batch after that one ends; when it ends; its share of the critical
    path), then each op's total, the stage that limits it and why, the project's goal and the
    published figures (at MODEL_SHAPE only)."""
    ops = (dispatch_model(s, p), combine_model(s, p))
    lines = [f"EP{s.ranks}: {s.hosts} hosts of {s.ranks_per_host} GPUs, {s.tokens} tokens per "
             f"GPU, hidden {s.hidden}, top-{s.topk} of {s.experts}; dispatch rows "
             f"{s.row_bytes} B ({'FP8' if s.fp8 else f'{s.itemsize}-byte'}), host sums "
             f"{s.sum_bytes} B; {s.blocks} blocks", "",
             "| op | stage | runs | bound by | messages | MB | µs | last batch µs | ends at µs "
             "| on the path µs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m in ops:
        for i, (st, (_, end), path) in enumerate(zip(m.stages, m.schedule(), m.on_path_us())):
            lines.append(f"| {m.op} | {st.name} | {_runs(m, i)} | {st.bound} | "
                         f"{_num(st.messages, 1)} | {st.nbytes / MB:.2f} | {st.us:.1f} | "
                         f"{f'{st.tail_us:.1f}' if st.overlaps else ''} | {end:.1f} | "
                         f"{path:.1f} |")
    shape = {k: getattr(s, k) for k in MODEL_SHAPE}
    anchors = ANCHORS.get(s.ranks, ()) if shape == MODEL_SHAPE and s.fp8 else ()
    goal = GOALS.get(s.ranks) if shape == MODEL_SHAPE else None
    head = ["op", "model µs", "limited by", "why", "goal µs", "goal"] + [a[0] for a in anchors]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    # the combine once more with the weights given at the combine (DeepEP's API: they cross),
    # and with the host sums crossing in FP8 (rail_fp8=True), where the hidden size allows it
    more = [(1, replace(combine_model(replace(s, carry=False), p),
                        op="combine, weights at the combine"))]
    if s.hidden % 128 == 0:
        more.append((1, replace(combine_model(replace(s, rail_fp8=True), p),
                                op="combine, FP8 rail hop")))
    for i, m in [(0, ops[0]), (1, ops[1])] + more:
        lim = m.limit_stage
        row = [m.op, f"{m.total_us:.1f}", lim.name, WHY.get(lim.bound, lim.bound)]
        row += ([f"<= {goal[i]}", "met" if m.total_us <= goal[i] else "not met"] if goal
                else ["-", "-"])
        row += [(f"about {a[1 + i]}" if a[3] else str(a[1 + i])) for a in anchors]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _line(name: str, c) -> str:
    return f"{name} {c.fixed_us:.1f} µs + bytes / {c.gbps:.0f} GB/s"


def report(shapes, p: LinkParams = LinkParams()) -> str:
    """The model's printout: the parameters, where the in-host costs come from, the
    pipelining, then ``ep_table`` for each shape."""
    h = p.in_host
    costs = [_line("forward", h.forward), _line("partials", h.partials)]
    costs.append(_line("host sums' fold", h.host_sums) if h.host_sums
                 else "host sums' fold inside the partials")
    lines = ["two-level EP kernels, cost model per GPU and call (docs/multihost.md, 'Cost model')",
             f"links: NVLink {p.nvlink_gbps:g} GB/s, NIC {p.nic_gbps:g} GB/s + "
             f"{p.nic_latency_us:g} µs, {p.nic_msg_rate / 1e6:g} M messages/s, "
             f"HBM {p.hbm_gbps:g} GB/s",
             f"in host ({h.source}): {h.note}: {', '.join(costs)}; each at least its NVLink "
             "time",
             "pipelining: the forward runs during the send and ends no earlier than its own time "
             "nor than its last batch (one token's rows per block) after the last row arrives; "
             "the combine's weights came with the dispatch (EPBuffer.dispatch(topk_weights=)), "
             "so only an entry flag precedes the host sums, which leave from the partials' "
             "first step on, the other hosts' first, and end no earlier than the last other "
             "host's partials plus one step's sums; each other stage runs after the one "
             "before"]
    for s in shapes:
        lines += [""] + ep_table(s, p)
    return "\n".join(lines)


# -- llcomm bench ep --model / --calibrate ---------------------------------------------------
#: The flags that override LinkParams, and the field each sets.
FLAGS = {"--nvlink-gbps": "nvlink_gbps", "--nic-gbps": "nic_gbps",
         "--nic-latency-us": "nic_latency_us", "--nic-msg-rate": "nic_msg_rate"}


def add_arguments(p) -> None:
    """``--model``, its parameters and ``--calibrate``, on ``llcomm bench ep``'s parser."""
    g = p.add_argument_group("cost model", "the two-level kernels' model (docs/multihost.md)")
    g.add_argument("--model", action="store_true",
                   help="print the cost model of the two-level kernels at EP16, 32 and 64 and "
                        "exit, starting no process (--tokens, --hidden, --experts, --topk and "
                        "--ranks-per-host change the shape)")
    units = {"nvlink_gbps": "NVLink GB/s per GPU, each way", "nic_gbps": "NIC GB/s per GPU",
             "nic_latency_us": "NIC one-way latency of a message, µs",
             "nic_msg_rate": "NIC messages per second"}
    for flag, field in FLAGS.items():
        g.add_argument(flag, type=float, default=None, metavar="X",
                       help=f"with --model: {units[field]} (default "
                            f"{getattr(LinkParams(), field):g})")
    g.add_argument("--calibration", metavar="FILE", default=None,
                   help="with --model: the in-host stages from this calibration result (default: "
                        "the newest bench/results/<gpu>x1-ep-calibration.json, else the 2-GPU "
                        "scaling)")
    g.add_argument("--no-calibration", action="store_true",
                   help="with --model: the 2-GPU scaling, even where a calibration file exists")
    g.add_argument("--calibrate", action="store_true",
                   help="time the two-level kernels' in-host stages on this machine's GPU (one "
                        "rank of a host, EP16 and EP64) and write the calibration result "
                        "(--json, default bench/results/<gpu>x1-ep-calibration.json); --iters "
                        "replays of a graph of --graph-ops launches, after --warmup")


def requested(a) -> bool:
    """Whether the command line asks for the model or the calibration (or sets one of their
    parameters)."""
    return (a.model or a.calibrate or a.calibration is not None or a.no_calibration
            or any(getattr(a, f) is not None for f in FLAGS.values()))


def shapes_from_args(a, eps, problems: list[str]) -> list[Shape]:
    """The shapes of ``--tokens``, ``--hidden``, ``--experts``, ``--topk`` and
    ``--ranks-per-host`` (MODEL_SHAPE where not given) at each EP of ``eps``; each bad flag
    appended to ``problems``."""
    tokens = [MODEL_SHAPE["tokens"]]
    if a.tokens:
        try:
            tokens = options.parse_ints(a.tokens, "--tokens")
        except ValueError as e:
            problems.append(str(e))
    given = {"hidden": a.hidden, "experts": a.experts, "topk": a.topk,
             "ranks_per_host": a.ranks_per_host or None}
    shape = {k: (MODEL_SHAPE[k] if v is None else v) for k, v in given.items()}
    shapes = []
    for ep in eps:
        for n in tokens:
            try:
                shapes.append(Shape(ranks=ep, tokens=n, **shape))
            except ValueError as e:
                flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items()
                                  if v is not None)
                problems.append(f"EP{ep} ({flags or 'defaults'}): {e}")
    return shapes


def in_host_from_args(a, problems: list[str]):
    """The in-host costs ``--calibration`` / ``--no-calibration`` ask for (the newest
    committed calibration by default, else the 2-GPU scaling)."""
    if a.no_calibration:
        return ep_inhost.SCALED
    path = a.calibration or ep_inhost.newest_calibration()
    if path is None:
        return ep_inhost.SCALED
    try:
        return ep_inhost.load_calibration(path)
    except ValueError as e:
        problems.append(f"--calibration: {e}")
        return ep_inhost.SCALED


def from_args(a) -> tuple[list[Shape], LinkParams]:
    """The shapes and parameters of the command line; one ValueError naming each bad flag."""
    problems, values = [], {}
    for flag, field in FLAGS.items():
        v = getattr(a, field)
        if v is None:
            continue
        if not (math.isfinite(v) and v > 0):
            problems.append(f"{flag} {v:g}: expected a positive number")
        elif not a.model:
            problems.append(f"{flag} needs --model")
        values[field] = v
    for flag, given in (("--calibration", a.calibration is not None),
                        ("--no-calibration", a.no_calibration)):
        if given and not a.model:
            problems.append(f"{flag} needs --model")
    if a.calibration is not None and a.no_calibration:
        problems.append("--calibration and --no-calibration exclude each other")
    shapes = shapes_from_args(a, MODEL_EPS, problems)
    in_host = in_host_from_args(a, problems)
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))
    return shapes, LinkParams(**values, in_host=in_host)


def calibrate_shapes(a) -> list[Shape]:
    """The shapes ``--calibrate`` times (``ep_inhost.CALIBRATION_EPS``); one ValueError naming
    each bad flag."""
    problems = [f"--calibrate does not take {flag} (the model's)" for flag, given in
                [("--model", a.model), ("--calibration", a.calibration is not None),
                 ("--no-calibration", a.no_calibration)]
                + [(f, getattr(a, v) is not None) for f, v in FLAGS.items()] if given]
    shapes = shapes_from_args(a, ep_inhost.CALIBRATION_EPS, problems)
    options.check_run_arguments(a, problems)
    if a.graph_ops < 1:
        problems.append("--graph-ops must be at least 1")
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))
    return shapes


def run(a) -> int:
    """``llcomm bench ep --model`` (print the model) or ``--calibrate``; 2 on a bad option."""
    try:
        if a.calibrate:
            shapes = calibrate_shapes(a)
        else:
            shapes, params = from_args(a)
    except ValueError as e:
        print(f"llcomm bench ep: {e}")
        return 2
    if a.calibrate:
        from . import ep_calibrate
        return ep_calibrate.run(a, shapes)
    print(report(shapes, params))
    return 0
