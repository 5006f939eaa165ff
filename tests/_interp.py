"""Run a function of a test module in a fresh process under ``TRITON_INTERPRET=1`` (Triton reads
the variable at import, so the pytest process itself cannot switch to the interpreter).

    run_in_interpreter("test_ll_cpu", "simulate_matched", 2, 4, rounds)

The function's arguments and return value travel as JSON. Inside that process, ``run_ranks``
runs several virtual ranks' kernels at once, one thread each (kernels with flag barriers).
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


# -- several virtual ranks' kernels at once (inside the interpreter process) -------------------
# Kernels with flag barriers (signal, then a bounded wait for every peer) cannot run rank after
# rank: each rank's launch must be running while its peers' launches run. ``run_ranks`` runs
# one thread per rank. Triton's interpreter is written for one launch at a time, so
# ``concurrent_kernels`` adapts it for the duration:
#   - the block index and grid size become per-thread (the interpreter keeps them in its one
#     builder object);
#   - triton.language is patched for the interpreter once, on entry, and restored on exit (each
#     launch would otherwise restore it when it ends, under the launches still running);
#   - a function's first call rewrites it (shared state in the interpreter): under a lock;
#   - a scalar comparison splat over a block (``(offs < n) & (s != rank)``) stays a boolean
#     block: the interpreter keeps the operands' type in a comparison's scalar result and
#     splats it as that type, which loads and stores then refuse as a mask;
#   - (the clocks need nothing here: under the interpreter the kernels read the host's
#     monotonic clock and yield to other threads at each reading, llcomm/runtime/kernels/sync.py)

def _interp_module():
    import triton.runtime.interpreter as I
    return I


class concurrent_kernels:
    """Context manager: while it is active, threads may run interpreted kernels at once."""

    def __enter__(self):
        import threading
        import types

        import numpy as np
        import triton.language as tl

        interp = _interp_module()
        B = interp.InterpreterBuilder
        local = threading.local()
        self._saved = [(B, name, B.__dict__.get(name)) for name in
                       ("grid_idx", "grid_dim", "create_splat")]
        self._saved.append((interp, "_patch_lang", interp._patch_lang))
        self._scope = interp._patch_lang(
            types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))

        def per_thread(name):
            return property(lambda self: getattr(local, name, None),
                            lambda self, value: setattr(local, name, value))

        splat = B.create_splat

        def create_splat(builder, ret_ty, arg):
            if arg.data.dtype == np.bool_ and ret_ty.scalar == tl.int1:
                return interp.TensorHandle(np.full(ret_ty.shape, arg.data.reshape(-1)[0]), tl.int1)
            return splat(builder, ret_ty, arg)

        # the first call of a function rewrites it, in shared state: one thread at a time
        F = interp.InterpretedFunction
        self._saved.append((F, "rewrite", F.__dict__["rewrite"]))
        rewrite, lock = F.rewrite, threading.RLock()

        def locked_rewrite(fn_self):
            with lock:
                return rewrite(fn_self)
        F.rewrite = locked_rewrite
        B.grid_idx = per_thread("grid_idx")
        B.grid_dim = per_thread("grid_dim")
        B.create_splat = create_splat
        # already patched, restored on exit
        interp._patch_lang = lambda fn: interp._LangPatchScope()
        return self

    def __exit__(self, *exc):
        for obj, name, value in reversed(self._saved):
            if value is None:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        self._scope.restore()
        return False


def run_ranks(fns, timeout: float = 300.0):
    """Run ``fns[r]()`` for every virtual rank r, each in its own thread, all at once (under
    ``concurrent_kernels``); return their results in rank order. A function that raises makes
    this raise its exception; one that has not returned after ``timeout`` seconds (a wait that
    never ends) makes this raise TimeoutError."""
    import threading

    results = [None] * len(fns)
    errors = [None] * len(fns)

    def body(r):
        try:
            results[r] = fns[r]()
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the caller's thread)
            errors[r] = e

    with concurrent_kernels():
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(fns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            raise TimeoutError(f"virtual ranks {stuck} still running after {timeout} s")
    for e in errors:
        if e is not None:
            raise e
    return results
