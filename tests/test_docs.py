"""The docs site builds with ``mkdocs build --strict`` (broken links, bad docstrings and missing
pages fail it). Skipped, with the reason, where the docs extra is not installed."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Seconds a build may take (mkdocstrings imports nothing, it parses the sources).
TIMEOUT_S = 300


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs",
                        reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("material")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    perf = (tmp_path / "site" / "performance" / "index.html").read_text()
    assert "all_reduce" in perf and "<table>" in perf, "performance tables missing"
    assert 'src="../bench/h200x2-tp.png"' in perf, "plot links not pointed at the site's copies"
    assert (tmp_path / "site" / "bench" / "h200x2-tp.png").exists()
