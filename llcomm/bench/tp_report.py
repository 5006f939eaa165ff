"""The nccl-tests style table of a ``llcomm bench tp`` result (one table per op).

One line per size (and per explicitly requested llcomm algorithm with ``--algos all``). The peers
(NCCL, torch symmetric memory) sit on the ``auto`` line. Bandwidths are computed from the llcomm
graph time (the eager time on CPU); ``#wrong`` adds up the llcomm rows of the line over all ranks.
"""
from __future__ import annotations

from . import console

HEADERS = ["size", "count", "dtype", "llcomm graph µs", "llcomm eager µs", "algo",
           "NCCL graph µs", "NCCL eager µs", "torch one_shot µs", "torch two_shot µs",
           "algbw GB/s", "busbw GB/s", "#wrong"]
LLCOMM_IMPLS = ("llcomm", "reference")


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw / algbw factor."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op == "broadcast":
        return 1.0
    return (world - 1) / world


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("error"):
        return "err"
    return console.fmt_us(row["median_us"])


def lines_of(rows: list[dict], op: str) -> dict:
    """{(bytes, requested algo): {(impl, mode): row}} for one op, in order of appearance."""
    lines: dict = {}
    for r in rows:
        if r["op"] != op:
            continue
        impl = "llcomm" if r["impl"] in LLCOMM_IMPLS else r["impl"]
        req = r.get("requested_algo", "auto") if impl == "llcomm" else "auto"
        lines.setdefault((r["bytes"], req), {})[(impl, r["mode"])] = r
    return lines


def table_rows(rows: list[dict], op: str, world: int) -> list[list[str]]:
    out = []
    for (nbytes, req), cells in lines_of(rows, op).items():
        g, e = cells.get(("llcomm", "graph")), cells.get(("llcomm", "eager"))
        any_row = g or e or next(iter(cells.values()))
        algo = "-"
        if g or e:
            algo = (g or e)["algo"]
            algo = f"auto:{algo}" if req == "auto" and (g or e)["impl"] == "llcomm" else algo
        t = next((r["median_us"] for r in (g, e) if r and r.get("median_us")), None)
        algbw = nbytes / (t * 1e3) if t else None
        wrongs = [r["wrong"] for r in (g, e) if r and r.get("wrong") is not None]
        out.append([
            console.fmt_bytes(nbytes), str(any_row["count"]), any_row["dtype"], _cell(g), _cell(e),
            algo,
            _cell(cells.get(("nccl", "graph"))), _cell(cells.get(("nccl", "eager"))),
            _cell(cells.get(("torch_one_shot", "graph"))),
            _cell(cells.get(("torch_two_shot", "graph"))),
            f"{algbw:.2f}" if algbw else "-",
            f"{algbw * bus_factor(op, world):.2f}" if algbw else "-",
            str(sum(wrongs)) if wrongs else "-"])
    return out


def error_notes(rows: list[dict]) -> list[str]:
    """One note per distinct (op, impl, mode, error), listing the sizes it happened at."""
    seen: dict = {}
    for r in rows:
        if r.get("error"):
            seen.setdefault((r["op"], r["impl"], r.get("requested_algo"), r["mode"], r["error"]),
                            []).append(console.fmt_bytes(r["bytes"]))
    notes = []
    for (op, impl, req, mode, err), sizes in seen.items():
        name = f"{impl}[{req}]" if req and req != "auto" else impl
        notes.append(f"{op} {name} {mode} at {','.join(sizes)}: {err}")
    return notes


def print_result(result: dict) -> None:
    world = result["world_size"]
    print(f"# llcomm bench tp: {result['machine']}, world size {world}, llcomm backend "
          f"{result['backend']} ({result.get('backend_reason', '')})")
    v = result["versions"]
    print(f"# torch {v.get('torch')}, triton {v.get('triton')}, nccl {v.get('nccl')}; "
          f"commit {result.get('commit')}{' (dirty)' if result.get('dirty') else ''}; "
          f"{result['iters']} iters after {result['warmup']} warm-up"
          + (f", {result['graph_ops']} ops per graph" if result.get("graph_ops") else
             ", eager only (CPU)") + (", PDL on" if result.get("pdl") else ""))
    ops = list(dict.fromkeys(r["op"] for r in result["rows"]))
    for op in ops:
        console.print_table(op, HEADERS, table_rows(result["rows"], op, world))
    notes = result.get("notes", []) + error_notes(result["rows"])
    for n in notes:
        print(f"# note: {n}")
