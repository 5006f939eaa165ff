"""Print a markdown table of graph-mode medians from a TP result file (for docs/performance.md).

    python tools/perf_table.py bench/results/h200x2-tp.json [--op all_reduce]
"""
import argparse
import json

SIZES = (8 << 10, 64 << 10, 256 << 10, 1 << 20, 8 << 20, 16 << 20)


def _label(nbytes):
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--op", default="all_reduce")
    args = ap.parse_args()
    res = json.load(open(args.path))
    cols = {}
    for r in res["rows"]:
        if r["op"] != args.op or r.get("median_us") is None:
            continue
        name = r["impl"] if r["impl"] != "llcomm" else f"llcomm {r['algo']}"
        cols.setdefault(f"{name} ({r['mode']})", {})[r["bytes"]] = r["median_us"]
    names = sorted(cols)
    print(f"{args.op}, µs per op (median; {res['machine']}, commit {str(res['commit'])[:10]})\n")
    print("| impl (mode) | " + " | ".join(_label(s) for s in SIZES) + " |")
    print("|---" * (len(SIZES) + 1) + "|")
    for n in names:
        cells = [f"{cols[n][s]:.1f}" if s in cols[n] else "–" for s in SIZES]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
