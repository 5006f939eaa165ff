"""The docs site builds with ``mkdocs build --strict`` (broken links, bad docstrings and missing
pages fail it; skipped, with the reason, where the docs extra is not installed), and what the
README says of the API holds: the ``Communicator`` signature it writes out, and which ops take
``out=``."""
import re
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


# -- README claims about the API, against the code ---------------------------------------------
def test_readme_gives_the_communicator_signature():
    """The signature README's "Backends" paragraph writes out is the constructor's: every
    parameter, in order, with its default."""
    import ast
    import inspect

    import llcomm
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"`Communicator\((group=.*?)\)`", readme, re.S)
    assert m, "README.md no longer writes out Communicator(...)"
    written = ast.parse(f"def f({' '.join(m.group(1).split())}): pass").body[0].args
    defaults = [eval(compile(ast.Expression(d), "README.md", "eval"), {"__builtins__": {}})
                for d in written.defaults + written.kw_defaults]
    readme_params = [(a.arg, d) for a, d in zip(written.args + written.kwonlyargs, defaults)]
    actual = [(p.name, p.default)
              for p in inspect.signature(llcomm.Communicator).parameters.values()]
    assert readme_params == actual


def test_every_op_but_broadcast_takes_out():
    """README: "Every op but `broadcast` takes `out=`"."""
    import inspect

    import llcomm
    ops = [name for name, fn in inspect.getmembers(llcomm.Communicator, inspect.isfunction)
           if name.startswith(("all_", "broadcast", "reduce_"))]
    assert "broadcast" in ops and len(ops) >= 8, ops
    without = [n for n in ops
               if "out" not in inspect.signature(getattr(llcomm.Communicator, n)).parameters]
    assert without == ["broadcast"], without
