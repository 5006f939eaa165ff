"""Result files of the benchmarks (docs/design.md#result-files): the header that says what ran
where (commit, machine, versions, environment) and writing ``--json`` / ``--plot``."""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ..runtime import settings
from ..runtime.settings import BenchSettings
from .spawn import MULTICAST_OFF_ENV

#: Seconds allowed to ``git`` and ``nvidia-smi`` calls.
TOOL_TIMEOUT_S = 10


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the tree llcomm is imported from. ``LLCOMM_COMMIT`` overrides the
    commit (for a copied tree without .git); dirty counts tracked files only."""
    repo = str(Path(__file__).resolve().parents[2])
    sha = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    given = BenchSettings.read().commit
    if given and not (sha and sha.strip().startswith(given)):
        return given, None          # a copied tree: its state is not known here
    commit = sha.strip() if sha else None
    return commit, (bool(status.strip()) if status is not None else None)


def nvidia_topo() -> str | None:
    """``nvidia-smi topo -m`` output, or None where nvidia-smi is absent or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    return _run(["nvidia-smi", "topo", "-m"])


def topo_link(topo: str | None, i: int, j: int) -> str | None:
    """The entry of ``nvidia-smi topo -m`` between GPU i and GPU j (e.g. 'NV18', 'PIX')."""
    if not topo:
        return None
    for line in topo.splitlines():
        cells = line.split()
        # the row of GPU i has "X" on its own column (the underlined header row does not)
        if (cells and re.sub(r"\x1b\[[0-9;]*m", "", cells[0]) == f"GPU{i}"
                and len(cells) > max(i, j) + 1 and cells[i + 1] == "X"):
            return cells[j + 1]
    return None


def machine_string(world: int, device: torch.device) -> str:
    """'2xH200 NV18' from the GPU names and the link between GPU 0 and 1; '2xCPU gloo' on CPU."""
    if device.type != "cuda":
        return f"{world}xCPU gloo"
    names = [torch.cuda.get_device_name(i).removeprefix("NVIDIA ").strip() for i in range(world)]
    base = f"{world}x{names[0]}" if len(set(names)) == 1 else "+".join(names)
    link = topo_link(nvidia_topo(), 0, 1) if world >= 2 else None
    return f"{base} {link}" if link else base


def versions() -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - absent or broken: recorded as None
        out["triton"] = None
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        out["nccl"] = None
    out["cuda"] = torch.version.cuda
    return out


def result_header(world: int, device: torch.device) -> dict:
    """The keys of a result file other than ``rows``; ``env`` holds the LLCOMM_ and multicast
    variables the ranks ran with."""
    commit, dirty = git_state()
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith("LLCOMM_") or k in MULTICAST_OFF_ENV}
    from llcomm.runtime import launch
    return {"commit": commit, "dirty": dirty, "machine": machine_string(world, device),
            "date": datetime.date.today().isoformat(), "versions": versions(),
            "world_size": world, "env": env,
            "pdl": launch.pdl_enabled(device, settings.value("LLCOMM_PDL"))}


def write_json(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def write_outputs(result: dict, a) -> None:
    """Write ``--json`` and ``--plot`` where they were asked for, saying so."""
    if a.json:
        write_json(a.json, result)
        print(f"wrote {a.json}")
    if a.plot:
        from .plot import plot_results
        plot_results(result, a.plot)
        print(f"wrote {a.plot}")
