"""``llcomm doctor``: what this host offers llcomm. Works without GPUs; starts no process group.

Reports GPUs, the peer-access matrix, NVLink topology (``nvidia-smi topo -m`` where present),
versions, NVLink multicast (whether the driver reports it, how NCCL and torch symmetric memory
are configured to use it; llcomm itself does not), whether kernels launch with programmatic
dependent launch, which backend ``Communicator(backend="auto")`` would pick in a job of one
process per visible GPU, and why, and across hosts which remote transport NVSHMEM would use
(``llcomm/ep/hosts/transport.py``; read from files, NVSHMEM is not started), and whether
``import deep_ep`` gives ``llcomm.deep_ep`` here (``LLCOMM_DEEP_EP_ALIAS``).
"""
from __future__ import annotations

import ctypes
import os
import sys

import torch

from ..runtime import launch
from ..runtime.backend import MIN_TRITON, triton_problem
from ..runtime import settings
from ..bench import result_files
from ..ep.hosts import transport

GIB = 1 << 30


def peer_matrix(n: int) -> list[list[bool]]:
    """``m[i][j]``: GPU i can access GPU j as a peer (True on the diagonal)."""
    return [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)]
            for i in range(n)]


def predict_backend(n_gpus: int, peers: list[list[bool]], triton_ok: bool) -> tuple[str, str]:
    """The backend ``Communicator(backend="auto")`` would choose for a job of one process per
    visible GPU on this host, and why. Pure: mirrors ``llcomm.runtime.backend.peer_support``
    (which decides for real, collectively, when a Communicator is created) without a process
    group."""
    if n_gpus == 0:
        return "reference", "no CUDA device is available: torch.distributed on gloo (CPU)"
    if n_gpus == 1:
        return "reference", ("one GPU: a job of two or more ranks would put two ranks on one GPU, "
                             "where peer stores are undefined (a 1-rank job has nothing to join)")
    for i in range(n_gpus):
        for j in range(n_gpus):
            if not peers[i][j]:
                return "reference", (f"GPU {i} cannot access GPU {j} as a peer (no P2P/NVLink "
                                     "path): torch.distributed on NCCL")
    if not triton_ok:
        return "reference", ("every GPU reaches every other as a peer, but this Triton cannot "
                             "run the peer kernels (the triton line above says why): "
                             "torch.distributed on NCCL; install triton "
                             f">={'.'.join(map(str, MIN_TRITON))} for the peer backend")
    return "peer", "every rank gets its own GPU on this host and peer access works both ways"


def _triton() -> tuple[bool, str]:
    """(usable by the peer kernels, version or why not), as the backend choice decides it."""
    problem = triton_problem()
    if problem is not None:
        return False, problem
    import triton
    return True, triton.__version__


def pdl_line(n_gpus: int, triton_ok: bool) -> str:
    """Whether llcomm's kernels will be launched with programmatic dependent launch here."""
    head = "programmatic dependent launch (LLCOMM_PDL): "
    try:
        wanted = settings.value("LLCOMM_PDL")
    except ValueError as e:             # reported, as the Communicator would raise it
        return head + f"invalid setting ({e})"
    if not wanted:
        return head + "off (LLCOMM_PDL=0)"
    if not n_gpus or not triton_ok:
        return head + "off (" + ("no CUDA GPU" if not n_gpus else "Triton not importable") + ")"
    why = launch.pdl_unavailable(torch.device("cuda", 0))
    return head + ("on" if why is None else f"off ({why})")


def launch_line(triton_ok: bool) -> str:
    """How llcomm's kernels will be launched here: directly through the compiled kernel's
    launcher, or through Triton's ``kernel[grid](...)`` on a release it was not checked with."""
    head = "kernel launches: "
    if not triton_ok:
        return head + "none (Triton not usable)"
    why = launch.triton_unchecked()
    lo, hi = launch.DIRECT_TRITON
    if why is None:
        return head + (f"direct (Triton {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}; Triton's own path where "
                       "a compiled kernel's launcher differs)")
    return head + f"Triton's kernel[grid](...), slower per eager call ({why})"


#: ``CUdevice_attribute`` value of CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (CUDA 12.0 and later).
CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 132


def multicast_support(n_gpus: int) -> list[bool | None]:
    """Per GPU, whether the CUDA driver reports NVLink multicast support (the device attribute
    CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, read through libcuda; an attribute query, no
    multicast object is created). None where it cannot be read (no driver library, a driver
    older than the attribute)."""
    if n_gpus == 0:
        return []
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            return [None] * n_gpus
    except (OSError, AttributeError):
        return [None] * n_gpus
    out: list[bool | None] = []
    for i in range(n_gpus):
        dev, val = ctypes.c_int(), ctypes.c_int()
        if (cuda.cuDeviceGet(ctypes.byref(dev), i) != 0 or cuda.cuDeviceGetAttribute(
                ctypes.byref(val), CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev) != 0):
            out.append(None)
        else:
            out.append(bool(val.value))
    return out


def _setting(env, name: str) -> str:
    val = env.get(name)
    return f"{name}={val}" if val is not None else f"{name} unset"


def multicast_lines(support: list[bool | None], env) -> list[str]:
    """The NVLink multicast section: what the driver reports per GPU, how NCCL and torch
    symmetric memory are set to use it (from ``env``), and that llcomm does not use it."""
    out = ["NVLink multicast (NVLS):"]
    if not support:
        out.append("  GPUs: no CUDA GPU")
    else:
        names = {True: "supported", False: "not supported", None: "unknown (not readable)"}
        states = [names[s] for s in support]
        if len(set(states)) == 1:
            out.append(f"  GPUs: {states[0]} (driver attribute MULTICAST_SUPPORTED, all "
                       f"{len(states)})")
        else:
            out.append("  GPUs: " + ", ".join(f"GPU{i} {st}" for i, st in enumerate(states))
                       + " (driver attribute MULTICAST_SUPPORTED)")
    nvls = env.get("NCCL_NVLS_ENABLE")
    out.append("  NCCL: " + ("NVLS off" if nvls == "0" else "NVLS used where NCCL finds it "
                             "supported") + f" ({_setting(env, 'NCCL_NVLS_ENABLE')})")
    symm = env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")
    out.append("  torch symmetric memory: " + (
        "no multicast object" if symm == "1" else
        "rendezvous sets up a multicast object where the GPUs support it")
        + f" ({_setting(env, 'TORCH_SYMM_MEM_DISABLE_MULTICAST')})")
    out.append("  llcomm: does not use multicast (its workspace is torch symmetric memory, above)")
    out.append("  `llcomm bench|check|tune --no-multicast` switch it off in the processes they "
               "start; by default they leave these settings as they are")
    return out


def report() -> list[str]:
    import llcomm

    out = []
    v = result_files.versions()
    triton_ok, triton_v = _triton()
    out.append(f"llcomm {llcomm.__version__} (python {v['python']}, {sys.executable})")
    out.append(f"torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl'] or 'n/a'}, "
               f"triton {triton_v}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out.append("")
    out.append(f"GPUs: {n}")
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        out.append(f"  GPU{i}  {p.name}  {p.total_memory / GIB:.1f} GiB  sm_{p.major}{p.minor}")
    peers = peer_matrix(n) if n else []
    if n >= 2:
        out.append("peer access (row GPU can access column GPU):")
        out.append("        " + "".join(f"GPU{j:<4}" for j in range(n)))
        for i in range(n):
            out.append(f"  GPU{i:<3} " + "".join(
                f"{'-' if i == j else ('yes' if peers[i][j] else 'NO'):<7}" for j in range(n)))
    topo = result_files.nvidia_topo()
    out.append("")
    if topo is None:
        out.append("nvidia-smi topo -m: not available (no nvidia-smi, or it failed)")
    else:
        out.append("nvidia-smi topo -m:")
        out.extend("  " + line for line in topo.rstrip().splitlines())
    out.append("")
    out.extend(multicast_lines(multicast_support(n), os.environ))
    out.append("")
    out.append(pdl_line(n, triton_ok))
    out.append(launch_line(triton_ok))
    backend, why = predict_backend(n, peers, triton_ok)
    out.append("")
    out.append(f'backend: Communicator(backend="auto") with one process per GPU here would pick '
               f'"{backend}": {why}')
    out.append("  (a prediction: the Communicator decides collectively when it is created; a job "
               "spanning hosts, or ranks sharing a GPU, gets \"reference\")")
    out.append("")
    out.extend(transport.report_lines())
    out.append("")
    out.append(alias_line())
    return out


def alias_line() -> str:
    """Whether ``import deep_ep`` gives ``llcomm.deep_ep`` in this process (LLCOMM_DEEP_EP_ALIAS,
    read at interpreter start) and what it resolves to; an invalid value is named as the
    settings module refuses it."""
    import llcomm_deep_ep_alias as alias
    try:
        settings.value(alias.ENV)
    except ValueError as e:
        return alias.describe() + f" ({e})"
    return alias.describe()


def run(args) -> int:
    print("\n".join(report()))
    return 0
