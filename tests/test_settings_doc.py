"""docs/settings.md lists every environment variable the package reads, and nothing it does not;
llcomm/runtime/settings.py parses them.

An engine developer looks there first for what can be set; a knob added in code without a line
there (or a line left behind after a knob is removed), or a "ranks agree" column that says
otherwise than the check at construction, fails here."""
import dataclasses
import re
from pathlib import Path

import pytest

from llcomm.runtime import settings as S

ROOT = Path(__file__).resolve().parent.parent
#: A quoted name in the package's source: how every setting is spelled.
QUOTED = re.compile(r"[\"'](LLCOMM_[A-Z0-9_]+)[\"']")
#: A table row of the settings page: "| `LLCOMM_...` | ... |", with its cells.
ROW = re.compile(r"^\| `(LLCOMM_[A-Z0-9_]+)` \|(.*)\|\s*$", re.M)


def _in_code() -> set[str]:
    names = set()
    for path in (ROOT / "llcomm").rglob("*.py"):
        names |= set(QUOTED.findall(path.read_text()))
    return names


def _rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "settings.md").read_text()
    return {name: [c.strip() for c in cells.split("|")] for name, cells in ROW.findall(text)}


def test_every_setting_is_documented_and_every_documented_one_exists():
    code = _in_code()
    doc = set(_rows())
    assert "LLCOMM_TIMEOUT_MS" in code and "LLCOMM_LAMPORT_BYTES" in code   # the scan works
    assert not code - doc, f"read by llcomm but not in docs/settings.md: {sorted(code - doc)}"
    assert not doc - code, f"in docs/settings.md but read nowhere: {sorted(doc - code)}"


def test_settings_module_declares_what_the_page_says():
    """Every setting of settings.py is on the page, and its "ranks agree" column (the last of
    the library's tables) is "yes" exactly where the agreement check covers it."""
    rows = _rows()
    reg = S.registry()
    assert {"LLCOMM_LAMPORT_BYTES", "LLCOMM_EP_LL", "LLCOMM_PDL", "LLCOMM_COMMIT"} <= set(reg)
    assert not set(reg) - set(rows), sorted(set(reg) - set(rows))
    for name, f in reg.items():
        if name == "LLCOMM_COMMIT":             # the benchmarks' table has no such column
            assert len(rows[name]) == 1
            continue
        said = rows[name][-1]
        assert said.startswith(("yes", "no")), (name, said)
        assert said.startswith("yes") == f.metadata["agree"], (name, said)


def test_parsers_take_defaults_and_refuse_by_name():
    """The default when unset; a bad value refused naming the variable."""
    tp = S.TPSettings.read(2, environ={})
    assert (tp.num_blocks, tp.pdl, tp.timeout_ms) == (S.NUM_BLOCKS, 1, None)
    ep = S.EPSettings.read(environ={})
    assert (ep.num_blocks, ep.ll, ep.profile) == (None, None, 0)
    set_ = {"LLCOMM_NUM_BLOCKS": "64", "LLCOMM_PDL": "0", "LLCOMM_TUNE_TABLE": "t.json"}
    tp = S.TPSettings.read(4, environ=set_)
    assert (tp.num_blocks, tp.pdl, tp.tune_table) == (64, 0, "t.json")
    ep = S.EPSettings.read(environ={"LLCOMM_EP_NUM_BLOCKS": "32", "LLCOMM_EP_LL": "0",
                                    "LLCOMM_EP_PROFILE": "1"})
    assert (ep.num_blocks, ep.ll, ep.profile) == (32, 0, 1)
    bad = {"LLCOMM_NUM_BLOCKS": ("0", "-1", "4K", ""), "LLCOMM_PDL": ("2", "yes", ""),
           "LLCOMM_EP_NUM_BLOCKS": ("0", "x"), "LLCOMM_EP_PROFILE": ("on",),
           "LLCOMM_EP_LL": ("2",)}
    tp_names = {f.metadata["env"] for f in dataclasses.fields(S.TPSettings)}
    for name, values in bad.items():
        def read(environ):
            if name in tp_names:
                return S.TPSettings.read(2, environ=environ)
            return S.EPSettings.read(environ=environ)
        for raw in values:
            with pytest.raises(ValueError, match=f"{name}={raw!r}"):
                read({name: raw})


def test_disagreements_name_the_setting_and_every_rank():
    a = S.TPSettings.read(2, environ={})
    b = S.TPSettings.read(2, environ={"LLCOMM_LAMPORT_BYTES": "1048576"})
    c = S.TPSettings.read(2, environ={"LLCOMM_LAMPORT_BYTES": str(16 << 20)})   # the default
    assert S.disagreements([a.agreed(), c.agreed()]) == []
    assert S.disagreements([a.agreed(), b.agreed(), c.agreed()]) == [
        "LLCOMM_LAMPORT_BYTES differs between ranks: rank 0: 16777216, rank 1: 1048576, "
        "rank 2: 16777216"]
    # a setting that is not the ranks' business (the timeout, PDL) may differ
    d = S.TPSettings.read(2, environ={"LLCOMM_TIMEOUT_MS": "5", "LLCOMM_PDL": "0"})
    assert S.disagreements([a.agreed(), d.agreed()]) == []
