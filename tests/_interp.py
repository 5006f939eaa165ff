"""Run a function of a test module in a fresh process under ``TRITON_INTERPRET=1`` (Triton reads
the variable at import, so the pytest process itself cannot switch to the interpreter).

    run_in_interpreter("test_ll_cpu", "simulate_matched", 2, 4, rounds)

The function's arguments and return value travel as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_in_interpreter(module: str, fn_name: str, *args):
    code = ("import json, sys; sys.path.insert(0, {here!r}); import {mod} as m; "
            "print('RESULT' + json.dumps(m.{fn}(*json.loads(sys.argv[1]))))").format(
                here=HERE, mod=module, fn=fn_name)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env,
                       capture_output=True, text=True, timeout=600)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert p.returncode == 0 and line, f"interpreter run failed:\n{p.stdout}\n{p.stderr}"
    return json.loads(line[0][len("RESULT"):])
