"""Every example in examples/ runs to its 'ok' line on the CPU (reference backend, gloo, 2
processes), as a user would start it: ``python examples/X.py --cpu``. The ``hf_*`` examples run
transformers' models and are skipped where transformers is not installed (the ``hf`` extra;
scripts/venv.sh installs it, so CI runs them)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
#: Seconds one example may take (two spawned processes, torch import, compile on the CPU).
TIMEOUT_S = 300


def test_examples_found():
    assert {"quickstart.py", "tp_all_reduce.py", "deepep_low_latency.py",
            "compile_decode_step.py", "hf_llama_tp.py", "hf_moe_ep.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name):
    if name.startswith("hf_") and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install -e '.[hf]')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("RANK", None)  # never look like torchrun
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--cpu"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert f"{name.removesuffix('.py')}: ok" in proc.stdout, proc.stdout
