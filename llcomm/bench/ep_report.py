"""The tables of a ``llcomm bench ep`` result: per op, one line per tokens-per-rank value (llcomm
and reference, graph and eager, GB/s); for ``--overlap``, the step with and without receive hooks.
"""
from __future__ import annotations

from . import console

#: The single ops of the result, in table order, and the ``--overlap`` step.
OPS = ("dispatch", "combine", "dispatch_fp8")
OVERLAP_OP = "overlap_step"

HEADERS = ["tokens", "bytes", "llcomm graph µs", "llcomm eager µs", "ref graph µs",
           "ref eager µs", "llcomm GB/s", "ref GB/s", "ref / llcomm", "#wrong"]


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return "err" if row.get("error") else console.fmt_us(row["median_us"])


def _best(*rows):
    return next((r["median_us"] for r in rows if r and r.get("median_us")), None)


def table_rows(rows: list[dict], op: str) -> list[list[str]]:
    lines: dict = {}
    for r in rows:
        if r["op"] == op:
            lines.setdefault(r["tokens_per_rank"], {})[(r["impl"], r["mode"])] = r
    out = []
    for n, cells in lines.items():
        lg, le = cells.get(("llcomm", "graph")), cells.get(("llcomm", "eager"))
        rg, re_ = cells.get(("reference", "graph")), cells.get(("reference", "eager"))
        nbytes = next(iter(cells.values()))["bytes"]
        tl, tr = _best(lg, le), _best(rg, re_)
        wrongs = [r["wrong"] for r in cells.values() if r.get("wrong") is not None]
        out.append([str(n), console.fmt_bytes(nbytes), _cell(lg), _cell(le), _cell(rg), _cell(re_),
                    f"{nbytes / (tl * 1e3):.1f}" if tl else "-",
                    f"{nbytes / (tr * 1e3):.1f}" if tr else "-",
                    f"{tr / tl:.2f}x" if tl and tr else "-",
                    str(sum(wrongs)) if wrongs else "-"])
    return out


OVERLAP_HEADERS = ["tokens / micro-batch", "impl", "mode", "plain µs / step", "hooks µs / step",
                   "saving µs", "saving %", "#wrong"]


def overlap_table_rows(rows: list[dict]) -> list[list[str]]:
    """One line per (tokens, impl, mode) of the ``--overlap`` rows: plain vs hooked step."""
    lines: dict = {}
    for r in rows:
        if r["op"] == OVERLAP_OP:
            key = (r["tokens_per_rank"], r["impl"], r["mode"])
            lines.setdefault(key, {})[r["recv_hook"]] = r
    out = []
    for (n, impl, mode), cells in lines.items():
        plain, hooked = cells.get(False), cells.get(True)
        tp, th = _best(plain), _best(hooked)
        wrongs = [r["wrong"] for r in cells.values() if r.get("wrong") is not None]
        out.append([str(n), impl, mode, _cell(plain), _cell(hooked),
                    f"{tp - th:.1f}" if tp and th else "-",
                    f"{100 * (tp - th) / tp:.0f}%" if tp and th else "-",
                    str(sum(wrongs)) if wrongs else "-"])
    return out


HOSTS_HEADERS = ["op", "tokens", "impl", "two-level B", "per (token, GPU) B",
                 "per (token, expert) B", "two-level / per expert"]


def hosts_table_rows(rows: list[dict]) -> list[list[str]]:
    """One line per (op, tokens, impl) of the rows that carry inter-host bytes (mean per rank)."""
    seen, out = set(), []
    for r in rows:
        key = (r["op"], r["tokens_per_rank"], r["impl"])
        if "inter_host_bytes" not in r or key in seen:
            continue
        seen.add(key)
        per_expert = r["per_expert_bytes"]
        out.append([r["op"], str(r["tokens_per_rank"]), r["impl"], str(r["inter_host_bytes"]),
                    str(r["per_gpu_bytes"]), str(per_expert),
                    f"{r['inter_host_bytes'] / per_expert:.2f}" if per_expert else "-"])
    return out


def print_result(result: dict) -> None:
    r0 = result["rows"][0] if result["rows"] else {}
    v = result["versions"]
    print(f"# llcomm bench ep: {result['machine']}, world size {result['world_size']}, hidden "
          f"{r0.get('hidden')}, {r0.get('num_experts')} experts, top-{r0.get('topk')}, "
          f"{result['routing']} routing, {r0.get('dtype')}, buffer for "
          f"{r0.get('max_tokens', '?')} tokens per rank"
          + (", weights carried by the dispatch" if r0.get("carry_weights") else ""))
    print(f"# torch {v.get('torch')}, triton {v.get('triton')}, nccl {v.get('nccl')}; commit "
          f"{result.get('commit')}{' (dirty)' if result.get('dirty') else ''}; {result['iters']} "
          f"iters after {result['warmup']} warm-up"
          + (f", {result['graph_ops']} ops per graph" if result.get("graph_ops")
             else ", eager only (CPU, reference backend on gloo)")
          + (", PDL on" if result.get("pdl") else ""))
    print("# GB/s from the graph time where there is one; ref = reference backend "
          "(all_to_all_single)")
    present = {r["op"] for r in result["rows"]}
    for op in OPS:
        if op in present:
            title = op
            if op == "dispatch_fp8":
                rs = next(r.get("round_scale") for r in result["rows"] if r["op"] == op)
                title += " (round_scale)" if rs else ""
            console.print_table(title, HEADERS, table_rows(result["rows"], op))
    if OVERLAP_OP in present:
        mbs = next(r["micro_batches"] for r in result["rows"] if r["op"] == OVERLAP_OP)
        console.print_table(f"{OVERLAP_OP}: {mbs} micro-batches, return_recv_hook vs plain",
                      OVERLAP_HEADERS, overlap_table_rows(result["rows"]))
    hosts = hosts_table_rows(result["rows"])
    if hosts:
        rph = next(r["ranks_per_host"] for r in result["rows"] if "ranks_per_host" in r)
        console.print_table(f"bytes put across hosts per rank per call ({rph} ranks per host; "
                            "two-level: rows, tags and counts as reported; the others: payload "
                            "rows only)", HOSTS_HEADERS, hosts)
    for r in result["rows"]:
        if r.get("error"):
            print(f"# note: {r['op']} {r['impl']} {r['mode']} at {r['tokens_per_rank']} tokens: "
                  f"{r['error']}")
