"""Plots of result files, one layout per benchmark; ``python -m llcomm.bench.plot results.json
out.png`` redraws one from a result file alone.

- ``tp``: latency vs message size, log-log, one panel per op, one line per impl + mode (+ the
  requested algorithm of explicit llcomm runs).
- ``ep``: latency vs tokens per rank, one panel for the ops (``dispatch_fp8`` of ``--fp8`` its
  own lines), one for ``--overlap``'s steps, one line per op (+ variant) + impl + mode.
- ``decode``: ms per step vs batch, one panel per part (``tp``, ``ep``), one line per impl + mode
  (``none`` is the step without communication).
- ``ep-calibration``: µs per launch vs the bytes of each in-host stage, one line per stage
  through its EP16 and EP64 points (what ``llcomm bench ep --model`` fits).

Eager lines are dashed.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def series_label(row: dict) -> str:
    """impl + mode, with the requested algorithm of explicit llcomm runs:
    'llcomm[lamport] graph'."""
    impl = row["impl"]
    req = row.get("requested_algo")
    if req and req != "auto":
        impl = f"{impl}[{req}]"
    return f"{impl} {row['mode']}"


@dataclass(frozen=True)
class Layout:
    x: str                                   # row key on the x axis
    xlabel: str
    y: str                                   # row key on the y axis
    ylabel: str
    panel: Callable[[dict], str]             # which panel a row goes to
    label: Callable[[dict], str]             # which line of its panel
    xlog: int = 2                            # log base of the x axis (0: linear)


LAYOUTS = {
    "tp": Layout("bytes", "message size (bytes)", "median_us", "median µs per op",
                 lambda r: r["op"], series_label),
    "ep": Layout("tokens_per_rank", "tokens per rank (per micro-batch for overlap_step)",
                 "median_us", "median µs per op (per step for overlap_step)",
                 lambda r: ("2-micro-batch step, return_recv_hook vs plain"
                            if r["op"] == "overlap_step" else "dispatch / combine"),
                 lambda r: f"{r['op']}{'[' + r['algo'] + ']' if r['op'] == 'overlap_step' else ''}"
                           f"{'[round_scale]' if r.get('round_scale') else ''} {series_label(r)}"),
    "fused": Layout("tokens", "tokens (rows of the hidden size in the title)", "median_us",
                    "median µs per op",
                    lambda r: f"{r.get('op', 'all_reduce_residual_rmsnorm')}, hidden "
                              f"{r.get('hidden', '?')}", series_label),
    "decode": Layout("batch", "tokens per rank (batch)", "ms_per_step", "median ms per step",
                     lambda r: f"{r['part']}: {r['model']}", series_label),
    "ep-calibration": Layout("bytes", "bytes a rank writes in the stage (EP16, then EP64)",
                             "median_us", "median µs per launch",
                             lambda r: "two-level EP, in-host stages",
                             lambda r: r["stage"], xlog=0),
}


def plot_results(result: dict, path: str) -> None:
    """Draw ``result`` (a result file's object) as a PNG at ``path``, laid out by its ``bench``
    key (``tp`` where absent)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lay = LAYOUTS[result.get("bench", "tp")]
    rows = [r for r in result["rows"] if r.get(lay.y) is not None]
    panels = list(dict.fromkeys(lay.panel(r) for r in rows)) or ["(no data)"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 4.8 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        mine = [r for r in rows if lay.panel(r) == panel]
        series: dict[str, list[tuple[float, float]]] = {}
        for r in mine:
            series.setdefault(lay.label(r), []).append((r[lay.x], r[lay.y]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                    linestyle="--" if label.endswith(" eager") else "-", label=label)
        dtypes = sorted({r["dtype"] for r in mine})
        ax.set_title(f"{panel}  ({result.get('machine', '?')}, {result.get('world_size', '?')} "
                     f"ranks, {'/'.join(dtypes)}, commit {str(result.get('commit'))[:10]})")
        if lay.xlog:
            ax.set_xscale("log", base=lay.xlog)
        ax.set_yscale("log")
        ax.set_xlabel(lay.xlabel)
        ax.set_ylabel(lay.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m llcomm.bench.plot",
                                description="Plot an llcomm result JSON (any benchmark).")
    p.add_argument("results", help="result file written by `llcomm bench ... --json`")
    p.add_argument("out", help="PNG to write")
    a = p.parse_args(argv)
    with open(a.results) as f:
        plot_results(json.load(f), a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
