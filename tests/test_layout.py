"""The package layout holds: every module imports on its own, imports point down, none in a circle.

Layers, bottom up: ``llcomm.errors`` and ``llcomm.runtime`` (shared by both op families);
``llcomm.tp`` and ``llcomm.ep`` (each: api, peer, reference, kernels), which never import each
other; ``llcomm.ops`` (torch.library ops over both) and ``llcomm.deep_ep`` (DeepEP's low-latency
API over ``llcomm.ep``), which nothing in the library imports; ``llcomm.hf`` (transformers'
models sharded over both, an optional integration), which only the tools import;
``llcomm.bench``, ``llcomm.commands``, ``llcomm.cli`` and ``llcomm.multiproc`` (tools), which the
library never imports. A kernel module imports device helpers and constants, never an API, a
backend or the reference.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "llcomm"
#: Longest module, in lines: past this a module holds more than one algorithm or concern.
MAX_MODULE_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """llcomm modules ``name`` imports, anywhere in its file (function bodies included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            # a module's own package __init__ is not an edge (it is imported on the way in)
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_no_import_circles():
    graph = _graph()
    assert len(graph) > 30 and graph["llcomm.tp.api"]      # the scan sees the package
    assert _cycles(graph) == []


def test_imports_point_down():
    graph = _graph()
    tools = ("llcomm.bench", "llcomm.commands", "llcomm.cli", "llcomm.__main__", "llcomm.multiproc")
    adapters = ("llcomm.deep_ep",)
    integrations = ("llcomm.hf",)
    rules = [
        (("llcomm.runtime", "llcomm.errors"),
         ("llcomm.tp", "llcomm.ep", "llcomm.ops") + adapters + integrations + tools),
        (("llcomm.tp",), ("llcomm.ep", "llcomm.ops") + adapters + integrations + tools),
        (("llcomm.ep",), ("llcomm.tp", "llcomm.ops") + adapters + integrations + tools),
        (("llcomm.ops",), adapters + integrations + tools),
        # transformers' models sharded over tp / ep: above both, like ops; only the tools use it
        (integrations, ("llcomm.ops",) + tools),
    ]
    # DeepEP's API sits on llcomm.ep's public API (EPBuffer, DeepEPOutputs, HANDLE_SLOTS and the
    # FP8 format), the argument checks and the errors, and the runtime's backend choice with the
    # EP settings it takes (shrink mode asks it as EPBuffer will, hosts included); only the
    # tools above it import it (``import llcomm`` does not load it)
    adapter_may_import = {"llcomm.ep", "llcomm.runtime.fp8_format", "llcomm.runtime",
                          "llcomm.runtime.validate", "llcomm.runtime.backend",
                          "llcomm.runtime.settings", "llcomm.errors",
                          # the normal mode's hosts (get_dispatch_layout's per-host counts)
                          "llcomm.runtime.hosts",
                          # the single-batch-overlap wait kernel (deep_ep/overlap_kernel.py)
                          # polls with the runtime's clock and volatile-read helpers
                          "llcomm.runtime.kernels.sync"}
    wrong = []
    for src, targets in graph.items():
        for layer, banned in rules:
            if _under(src, *layer):
                wrong += [f"{src} -> {t}" for t in targets if _under(t, *banned)]
        if ".kernels" in src:
            wrong += [f"{src} -> {t}" for t in targets
                      if t.rsplit(".", 1)[-1] in ("api", "peer", "reference")]
        if _under(src, *adapters):
            wrong += [f"{src} -> {t}" for t in targets
                      if not _under(t, *adapters) and t not in adapter_may_import]
        elif not _under(src, *tools):
            wrong += [f"{src} -> {t}" for t in targets if _under(t, *adapters)]
    assert wrong == []


def test_every_module_imports_on_its_own():
    """Each module, imported first in a process whose llcomm modules were all forgotten, loads:
    no module relies on another having been imported before it."""
    names = [m for m in _modules() if m not in ("llcomm.__main__",)]
    code = (
        "import importlib, sys\n"
        "import torch, triton  # noqa: F401  (heavy dependencies once, not per module)\n"
        "bad = []\n"
        f"for name in {names!r}:\n"
        "    for k in [k for k in sys.modules if k == 'llcomm' or k.startswith('llcomm.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


def test_modules_are_a_few_hundred_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
