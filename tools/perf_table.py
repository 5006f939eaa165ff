"""Markdown tables of median µs per op from benchmark result files (``bench/results/*.json``).

    python tools/perf_table.py bench/results/h200x2-tp.json [--op all_reduce]   # one table
    python tools/perf_table.py bench/results/*.json --all                        # every op

The docs build (``tools/mkdocs_hooks.py``) calls ``results_markdown`` to write the tables of the
performance page from whatever result files are in ``bench/results``, so the page cannot drift
from the files. Rows: one per implementation and mode (``llcomm <algo>`` for llcomm rows);
columns: the sizes in ``SIZES`` for the TP ops, the token counts present for EP ops.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

#: Columns of the TP tables, bytes.
SIZES = (8 << 10, 64 << 10, 256 << 10, 1 << 20, 8 << 20, 16 << 20)
#: Ops whose rows are keyed by tokens per rank instead of bytes.
EP_OPS = ("dispatch", "combine")
#: Table order of the ops; others follow in the order the file has them.
OP_ORDER = ("all_reduce", "broadcast", "all_gather", "all_gather_2d", "reduce_scatter",
            "dispatch", "combine", "decode_step")


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def ops_in(res: dict) -> list[str]:
    """The ops a result file has rows for, in table order."""
    seen = list(dict.fromkeys(r["op"] for r in res["rows"]))
    return sorted(seen, key=lambda op: (OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER),
                                        seen.index(op)))


def table(res: dict, op: str) -> str:
    """One markdown table: median µs of ``op`` per implementation (mode) and size."""
    ep = op in EP_OPS
    key = "tokens_per_rank" if ep else "bytes"
    cols: dict[str, dict[int, float]] = {}
    for r in res["rows"]:
        if r["op"] != op or r.get("median_us") is None or key not in r:
            continue
        name = r["impl"] if r["impl"] != "llcomm" else f"llcomm {r.get('algo', '')}".rstrip()
        cols.setdefault(f"{name} ({r.get('mode', '?')})", {})[r[key]] = r["median_us"]
    if ep:
        sizes = sorted({s for c in cols.values() for s in c})
        heads = [f"{s} tok" for s in sizes]
    else:
        sizes = list(SIZES)
        heads = [_label(s) for s in sizes]
    lines = ["| impl (mode) | " + " | ".join(heads) + " |", "|---" * (len(sizes) + 1) + "|"]
    for n in sorted(cols):
        cells = [f"{cols[n][s]:.1f}" if s in cols[n] else "–" for s in sizes]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_markdown(paths, heading: str = "##", image_dir: str | None = None) -> str:
    """Every op's table of every result file in ``paths``, each file under a heading that names
    its machine, commit, date and versions. With ``image_dir``, a plot ``<stem>.png`` next to a
    file is shown from ``image_dir/<stem>.png`` (the docs hook copies it there)."""
    out = []
    for path in sorted(Path(p) for p in paths):
        res = json.loads(path.read_text())
        v = res.get("versions", {})
        vers = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "nccl") if k in v)
        out.append(f"{heading} {res.get('machine', '?')}: `{path.name}`\n\n"
                   f"Commit `{str(res.get('commit'))[:10]}`, {res.get('date', '?')}; {vers}. "
                   "Median µs per op.\n")
        png = path.with_suffix(".png")
        if image_dir is not None and png.exists():
            out.append(f"![{path.stem}: latency against size]({image_dir}/{png.name})\n")
        for op in ops_in(res):
            out.append(f"{heading}# {op}\n\n{table(res, op)}\n")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--op", default="all_reduce")
    ap.add_argument("--all", action="store_true", help="every op of every file")
    args = ap.parse_args()
    if args.all:
        print(results_markdown(args.paths))
        return
    for path in args.paths:
        res = json.loads(Path(path).read_text())
        print(f"{args.op}, µs per op (median; {res['machine']}, commit "
              f"{str(res['commit'])[:10]})\n")
        print(table(res, args.op))


if __name__ == "__main__":
    main()
