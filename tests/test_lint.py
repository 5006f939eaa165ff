"""The linter, in the suite: ``ruff check`` on every Python file the project tracks, with the
rules of ``pyproject.toml`` (``[tool.ruff]``), and every ``# noqa`` saying why it is there.

ruff comes with the ``test`` extra (``pip install -e '.[test]'``); without it the test fails
rather than skips, since a suite that lints only where the linter happens to be installed lints
nowhere in particular.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The folders that hold the project's Python files.
LINTED = ("llcomm", "tests", "tools", "examples")
#: A ``noqa`` comment: the codes it silences, then what follows them on the line.
NOQA = re.compile(r"#\s*(?i:noqa)(?=[:\s]|$)"
                  r"(?P<codes>:\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<why>.*)$")
#: The justification after the codes: ``(why)`` or ``- why``, with a word in it.
WHY = re.compile(r"^\s+(\(.*\w.*\)|-\s+\w.*)")


def ruff_check(*paths: str) -> subprocess.CompletedProcess:
    """``python -m ruff check PATHS`` in the repository root, without a cache folder."""
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", *paths],
                          cwd=ROOT, capture_output=True, text=True)


def unjustified_noqa(lines: dict[str, str]) -> list[str]:
    """``path:line`` of each ``noqa`` without rule codes or without a reason after them."""
    bad = []
    for name, text in lines.items():
        for lineno, line in enumerate(text.splitlines(), 1):
            m = NOQA.search(line)
            if m and (not m.group("codes") or not WHY.match(m.group("why"))):
                bad.append(f"{name}:{lineno}: {line.strip()[:100]}")
    return bad


def test_ruff_finds_nothing():
    run = ruff_check(*LINTED)
    if "No module named ruff" in run.stderr:
        raise AssertionError("ruff is not installed: pip install -e '.[test]'")
    assert run.returncode == 0, f"ruff check {' '.join(LINTED)}:\n{run.stdout}{run.stderr}"


def test_every_noqa_says_why():
    files = {str(p.relative_to(ROOT)): p.read_text()
             for d in LINTED for p in sorted((ROOT / d).rglob("*.py"))}
    bad = unjustified_noqa(files)
    assert not bad, ("each `# noqa` names its codes and says why, "
                     "e.g. `# noqa: E402  (sys.path first)`:\n" + "\n".join(bad))


# -- the checks themselves ---------------------------------------------------------------------
def test_the_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / "bad.py").write_text("import os\n")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                          "--config", str(ROOT / "pyproject.toml"), str(tmp_path / "bad.py")],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "F401" in run.stdout, run.stdout + run.stderr

    mark = "# no" + "qa"                     # spelled apart so this file passes its own test
    lines = {"a.py": f"import x  {mark}\n"
                     f"import y  {mark}: F401\n"
                     f"import z  {mark}: F401  ()\n"
                     f"import w  {mark}: F401  (re-exported)\n"
                     f"import v  {mark}: F401 - re-exported\n"
                     f"import u  {mark}: E402, F401  (sys.path first)\n"}
    assert [b.split(":")[1] for b in unjustified_noqa(lines)] == ["1", "2", "3"]
