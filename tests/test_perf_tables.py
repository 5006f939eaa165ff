"""docs/performance.md's tables are the result files in bench/results, as tools/perf_table.py
renders them: a new result file without ``python tools/perf_table.py --write``, or a hand edit
of a generated cell, fails here. The spot checks read the JSON files on their own, so a
generator that put a number in the wrong cell fails too."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"


def _load():
    spec = importlib.util.spec_from_file_location("llcomm_perf_table",
                                                  ROOT / "tools" / "perf_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


P = _load()


def test_performance_page_tables_match_the_result_files():
    block = P.generated_block(PAGE.read_text())
    assert block == P.page_tables(RESULTS), (
        "docs/performance.md's tables differ from bench/results/*.json: run "
        "python tools/perf_table.py --write (and never edit between the perf-tables markers)")


def _tables_under(block: str, heading: str) -> list[dict[str, list[str]]]:
    """The markdown tables after ``heading`` (up to the next heading of any level), each as
    {first cell: the other cells}, with the header row under the key ``""``."""
    lines = block.splitlines()
    start = lines.index(heading) + 1
    tables, cur = [], None
    for line in lines[start:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cur is None:
                cur = {"": cells[1:]}
                tables.append(cur)
            else:
                cur[cells[0]] = cells[1:]
        elif not line.startswith("|"):
            cur = None
    return tables


def _cell(table: dict, row: str, col: str) -> str:
    return table[row][table[""].index(col)]


def _row(name: str, **want) -> dict:
    """The one row of a result file with the given fields (read here, not by the generator)."""
    rows = json.loads((RESULTS / name).read_text())["rows"]
    hits = [r for r in rows if all(r.get(k) == v for k, v in want.items())]
    assert len(hits) == 1, (name, want, len(hits))
    return hits[0]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def test_spot_checks_read_from_the_json_files():
    block = P.generated_block(PAGE.read_text())
    (ar,) = _tables_under(block, "#### all_reduce")
    for col, nbytes in (("8 KB", 8192), ("16 MB", 16 << 20)):
        r = _row("h200x2-tp.json", op="all_reduce", impl="llcomm", requested_algo="auto",
                    mode="graph", bytes=nbytes)
        assert _cell(ar, "llcomm auto", col) == _fmt(r["median_us"])
    r = _row("h200x2-tp.json", op="all_reduce", impl="torch_two_shot", mode="graph",
                bytes=16 << 20)
    assert _cell(ar, "torch symm-mem two_shot", "16 MB") == _fmt(r["median_us"])
    (bc,) = _tables_under(block, "#### broadcast")
    r = _row("h200x2-tp.json", op="broadcast", impl="llcomm", mode="graph", bytes=8 << 20)
    assert _cell(bc, "llcomm", "8 MB") == _fmt(r["median_us"])
    (rs,) = _tables_under(block, "#### reduce_scatter")
    r = _row("h200x2-tp.json", op="reduce_scatter", impl="nccl", mode="eager", bytes=8 << 20)
    assert _cell(rs, "NCCL, eager", "8 MB") == _fmt(r["median_us"])

    (fused,) = _tables_under(block, "### Fused all-reduce + residual + RMSNorm")
    r = _row("h200x2-fused.json", impl="unfused", mode="graph", tokens=128)
    unfused = "llcomm all_reduce + torch add + RMSNorm"
    assert _cell(fused, unfused, "128 tok") == _fmt(r["median_us"])

    tp, _moe = _tables_under(block, "### Decode steps")
    r = _row("h200x2-decode.json", part="tp", impl="nccl", mode="graph", batch=64)
    assert _cell(tp, "NCCL", "batch 64") == f"{r['comm_ms']:.3f}"

    (ep,) = _tables_under(block, "### EP dispatch / combine, buffer for 256 tokens (LL dispatch)")
    for row, op, impl in (("dispatch FP8", "dispatch_fp8", "llcomm"),
                          ("reference on NCCL: combine", "combine", "reference")):
        r = _row("h200x2-ep-b256.json", op=op, impl=impl, mode="graph", tokens_per_rank=128)
        assert _cell(ep, row, "128 tok") == _fmt(r["median_us"])


def test_every_table_names_its_commit():
    block = P.generated_block(PAGE.read_text())
    for name in P.CANONICAL:
        commit = json.loads((RESULTS / name).read_text())["commit"][:7]
        assert f"`bench/results/{name}`: commit `{commit}`" in block, name


def test_a_changed_result_file_changes_the_tables(tmp_path):
    for name in P.CANONICAL:
        for path in RESULTS.glob(Path(name).stem + ".*"):     # the JSON and its plot
            shutil.copy(path, tmp_path / path.name)
    assert P.page_tables(tmp_path) == P.page_tables(RESULTS)
    res = json.loads((tmp_path / "h200x2-ep-b256.json").read_text())
    row = next(r for r in res["rows"] if r["op"] == "combine" and r["impl"] == "llcomm"
               and r["mode"] == "graph" and r["tokens_per_rank"] == 128)
    row["median_us"] += 1.0
    (tmp_path / "h200x2-ep-b256.json").write_text(json.dumps(res))
    assert P.page_tables(tmp_path) != P.page_tables(RESULTS)


def test_check_flags_a_hand_edited_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "performance.md"
    text = PAGE.read_text()
    block = P.generated_block(text)
    edited = block.replace("| llcomm auto | ", "| llcomm auto | 0.1 | ", 1)
    assert edited != block
    page.write_text(text.replace(block, edited))
    monkeypatch.setattr(P, "PAGE", page)
    assert P.main(["--check"]) == 1
    assert P.write_page(page) and P.main(["--check"]) == 0


def test_a_page_without_markers_is_refused():
    with pytest.raises(ValueError, match="perf-tables"):
        P.generated_block("# Performance\n\nno tables here\n")
