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


def test_env_parsers_take_defaults_and_refuse_by_name(monkeypatch):
    """llcomm/runtime/settings.py: the default when unset; a bad value refused naming the variable (a
    Lamport chunk that is not a power of two would not compile as a Triton block)."""
    import pytest

    from llcomm.runtime.settings import env_bit, env_int, env_pow2
    name = "LLCOMM_TEST_SETTING"
    monkeypatch.delenv(name, raising=False)
    assert (env_int(name, 7), env_bit(name, 1), env_pow2(name, 0)) == (7, 1, 0)
    monkeypatch.setenv(name, "0")
    assert env_int(name, 7, zero_ok=True) == 0 and env_bit(name, 1) == 0
    monkeypatch.setenv(name, "4096")
    assert env_int(name, 7) == env_pow2(name, 0) == 4096
    for bad, parsers in (("0", (env_int, env_pow2)), ("3000", (env_pow2, env_bit)),
                         ("4K", (env_int, env_pow2, env_bit)), ("-1", (env_int,))):
        monkeypatch.setenv(name, bad)
        for parse in parsers:
            with pytest.raises(ValueError, match=name):
                parse(name, 1)
