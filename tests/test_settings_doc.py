"""docs/settings.md lists every environment variable the package reads, and nothing it does not.

An engine developer looks there first for what can be set; a knob added in code without a line
there (or a line left behind after a knob is removed) fails here."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: A quoted name in the package's source: how every setting is spelled (``*_ENV = "LLCOMM_..."``).
QUOTED = re.compile(r"[\"'](LLCOMM_[A-Z0-9_]+)[\"']")
#: A name in a table row of the settings page: "| `LLCOMM_...` |".
LISTED = re.compile(r"^\| `(LLCOMM_[A-Z0-9_]+)` \|", re.M)


def _in_code() -> set[str]:
    names = set()
    for path in (ROOT / "llcomm").rglob("*.py"):
        names |= set(QUOTED.findall(path.read_text()))
    return names


def test_every_setting_is_documented_and_every_documented_one_exists():
    code = _in_code()
    doc = set(LISTED.findall((ROOT / "docs" / "settings.md").read_text()))
    assert "LLCOMM_TIMEOUT_MS" in code and "LLCOMM_LAMPORT_BYTES" in code   # the scan works
    assert not code - doc, f"read by llcomm but not in docs/settings.md: {sorted(code - doc)}"
    assert not doc - code, f"in docs/settings.md but read nowhere: {sorted(doc - code)}"
