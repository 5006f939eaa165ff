"""Which backend a Communicator or EPBuffer runs on: peer kernels where every rank has its own
GPU on one host with peer access both ways, the reference backend (torch.distributed) otherwise.

The choice is one exchange among the group at construction (``choose_backend``): each rank's
GPU, and the settings every rank must share (``runtime/settings.py``, ``agreed()``), which are
checked on every backend, so a job that would fail on the peer backend fails the same way on
the reference one. The same exchange carries each rank's host name, from which
``choose_backend_hosts`` (``EPBuffer``) forms the group's hosts (``runtime/hosts.py``)."""
from __future__ import annotations

import logging
import re
import socket

import torch
import torch.distributed as dist

from ..errors import UnsupportedConfigError
from .hosts import Hosts, resolve_hosts, this_host
from .settings import check_agreement
from .shmem import shmem_problem

log = logging.getLogger("llcomm")

#: A rank's place: (host name, GPU uuid, device index), or None without a CUDA device.
Place = tuple[str, str, int] | None
#: The oldest Triton that compiles the peer kernels for sm_90 (pyproject.toml's floor;
#: docs/development.md, "Triton versions").
MIN_TRITON = (3, 6)


def this_place() -> Place:
    """Where this rank runs: its host and current CUDA device (None where there is none)."""
    if not torch.cuda.is_available():
        return None
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    return (socket.gethostname(), str(getattr(props, "uuid", dev)), dev)


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.6.0" or "3.10.0+git1a2b"; (0, 0) if it
    does not start with them."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def triton_problem() -> str | None:
    """Why this process's Triton cannot run the peer kernels (not importable, or older than
    MIN_TRITON), or None. An old Triton would otherwise fail in ptxas at the first launch."""
    try:
        import triton
    except Exception as e:  # noqa: BLE001 - absent or broken install: a reason, not a crash
        return f"Triton cannot be imported ({type(e).__name__}: {e})"
    version = str(getattr(triton, "__version__", "0"))
    if _release(version) < MIN_TRITON:
        return (f"Triton {version} is older than {'.'.join(map(str, MIN_TRITON))}, the oldest "
                "that compiles llcomm's peer kernels")
    return None


def peer_support(places: list[Place]) -> tuple[bool, str]:
    """Can the peer backend run on ranks at ``places`` (every rank's ``this_place()``, by rank)?
    Returns (ok, reason). Peer access is asked of this process's CUDA runtime."""
    missing = [r for r, p in enumerate(places) if p is None]
    if missing:
        if len(missing) == len(places):
            return False, "no CUDA device is available"
        return False, f"no CUDA device is available on rank {missing[0]}"
    if len({h for h, _, _ in places}) != 1:
        return False, "the ranks are on more than one host (peer memory is one host only)"
    uuids = [u for _, u, _ in places]
    if len(set(uuids)) != len(uuids):
        return False, ("two or more ranks share one GPU: a peer store between two contexts on one "
                       "device is undefined; give every rank its own GPU")
    dev = torch.cuda.current_device()
    local = {str(getattr(torch.cuda.get_device_properties(i), "uuid", i)): i
             for i in range(torch.cuda.device_count())}
    for _, u, _ in places:
        if u not in local:
            return False, ("a peer's GPU is not visible to this process, so peer access cannot "
                           "be checked")
        j = local[u]
        if j != dev and not torch.cuda.can_device_access_peer(dev, j):
            return False, f"GPU {dev} cannot access GPU {j} as a peer (no P2P/NVLink path)"
    return True, "every rank has its own GPU on this host and peer access works"


def _exchange(group: dist.ProcessGroup, backend: str, what: str, agreed: tuple) -> list:
    """The construction's one exchange: every rank's (place, agreed settings, Triton verdict,
    host), by rank; raises on every rank where the agreed settings differ."""
    place = this_place() if backend in ("auto", "peer") else None
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (place, tuple(agreed),
                                      triton_problem() if place is not None else None,
                                      this_host()), group=group)
    check_agreement(what, [a for _, a, _, _ in everyone])
    return everyone


def _decide(group: dist.ProcessGroup, backend: str, what: str, everyone: list,
            hosts: Hosts | None = None, shmem: list | None = None) -> tuple[str, str]:
    """The backend and its reason from the exchanged values (the same on every rank). A
    topology of several ``hosts`` (detected or declared) rules the peer backend out."""
    if backend == "reference":
        return backend, "requested" + (f"; the ranks span {hosts.describe()}: the two-level "
                                       "exchange" if hosts is not None and hosts.spans_hosts
                                       else "")
    if hosts is not None and hosts.spans_hosts:
        return _decide_hosts(group, backend, what, everyone, hosts, shmem)
    ok, why = peer_support([p for p, _, _, _ in everyone])
    unusable = [(r, t) for r, (_, _, t, _) in enumerate(everyone) if t]   # Triton, by rank
    if ok and unusable:         # every rank sees every rank's verdict: they choose alike
        ok, why = False, f"rank {unusable[0][0]}: {unusable[0][1]}"
    if backend == "peer" and not ok:
        raise UnsupportedConfigError(
            f"llcomm.{what}(backend='peer'): {why}. Use backend='reference' "
            "(torch.distributed) for this configuration.")
    if not ok:
        log.info("llcomm: rank %d: %s uses the reference backend: %s", dist.get_rank(group),
                 what, why)
    return ("peer" if ok else "reference"), why


def _decide_hosts(group: dist.ProcessGroup, backend: str, what: str, everyone: list,
                  hosts: Hosts, shmem: list) -> tuple[str, str]:
    """``_decide`` for ranks that span hosts: ``"shmem"`` (the two-level kernels on SHMEM,
    ``llcomm/ep/hosts/peer.py``) where every rank has a GPU, a usable Triton and SHMEM (``shmem``:
    each rank's ``shmem_problem()``), and the group is the default one (the kernels name ranks by
    SHMEM PE); else the two-level reference exchange, which ``"peer"`` refuses."""
    span = f"the ranks span {hosts.describe()}"
    problems = [(r, "no CUDA device is available" if p is None else (t or s))
                for r, ((p, _, t, _), s) in enumerate(zip(everyone, shmem)) if p is None or t or s]
    if not problems and group is not dist.group.WORLD and \
            dist.get_world_size(group) != dist.get_world_size():
        problems = [(0, "the group is not the default group (SHMEM names ranks by their rank "
                        "in it)")]
    if not problems:
        return "shmem", f"{span}: the two-level kernels on SHMEM"
    r, why = problems[0]
    reason = (f"{span}: the two-level reference exchange (rank {r}: {why}, so the two-level "
              "kernels on SHMEM cannot run)")
    if backend == "peer":
        raise UnsupportedConfigError(
            f"llcomm.{what}(backend='peer'): {span}, and the two-level kernels on SHMEM cannot "
            f"run: rank {r}: {why}. Use backend='reference' (torch.distributed) for this "
            "configuration.")
    log.info("llcomm: rank %d: %s uses the reference backend: %s", dist.get_rank(group), what,
             reason)
    return "reference", reason


def choose_backend(group: dist.ProcessGroup, backend: str, what: str,
                   agreed: tuple = ()) -> tuple[str, str]:
    """Resolve ``backend`` ("auto", "peer" or "reference") for ``what`` (the class asking):
    returns (backend, reason). A collective: one ``all_gather_object`` of every rank's place and
    Triton verdict (for "auto" and "peer"), its host (``runtime/hosts.py``) and its ``agreed``
    settings ((variable, value) pairs). Settings that differ between ranks raise
    UnsupportedConfigError naming them, on every rank and whatever the backend; so does "peer"
    on a group that cannot run it, with the reason."""
    return _decide(group, backend, what, _exchange(group, backend, what, agreed))


def choose_backend_hosts(group: dist.ProcessGroup, backend: str, what: str, agreed: tuple,
                         ranks_per_host: int | None) -> tuple[str, str, Hosts]:
    """``choose_backend`` in the same one exchange, plus the group's host topology (declared by
    ``ranks_per_host``, the ``LLCOMM_EP_RANKS_PER_HOST`` setting, else detected from the host
    names): returns (backend, reason, hosts). Ranks that span hosts never get the peer backend:
    ``"shmem"`` where the two-level kernels can run (``_decide_hosts``; each rank's SHMEM verdict
    travels in a second exchange, only across hosts), else ``"auto"`` gives the reference one and
    the reason says why. A topology that is not regular raises UnsupportedConfigError on every
    rank."""
    everyone = _exchange(group, backend, what, agreed)
    hosts = resolve_hosts(what, [h for _, _, _, h in everyone], ranks_per_host)
    shmem = None
    if hosts.spans_hosts and backend != "reference":
        # only across hosts (a second, small exchange): a one-host group never touches SHMEM
        shmem = [None] * dist.get_world_size(group)
        place = everyone[dist.get_rank(group)][0]
        dist.all_gather_object(shmem, shmem_problem() if place is not None else
                               "no CUDA device is available", group=group)
    return (*_decide(group, backend, what, everyone, hosts, shmem), hosts)


#: The device types a single torch.distributed backend carries tensors of, for the reference
#: backend's all-to-all and all-reduce: NCCL CUDA tensors; gloo (and any other) CPU tensors
#: (gloo's all-to-all takes no CUDA tensor).
SINGLE_BACKEND_DEVICES = {"nccl": ("cuda",)}


def parse_backends(spec: str) -> dict[str, str]:
    """``dist.get_backend(group)`` as {device type: backend}: ``"gloo"`` -> {"cpu": "gloo"},
    ``"nccl"`` -> {"cuda": "nccl"}, a mixed group's ``"cpu:gloo,cuda:nccl"`` (what
    ``init_process_group()`` without a backend makes where CUDA and NCCL are there, or
    ``new_group(backend=...)`` with that string) -> {"cpu": "gloo", "cuda": "nccl"}."""
    spec = str(spec).lower().strip()
    if ":" not in spec:
        return {dev: spec for dev in SINGLE_BACKEND_DEVICES.get(spec, ("cpu",))}
    out = {}
    for part in spec.split(","):
        dev, _, name = part.partition(":")
        if dev.strip() and name.strip():
            out[dev.strip()] = name.strip()
    return out


def device_backends(group: dist.ProcessGroup) -> dict[str, str]:
    """Which backend carries each device type's tensors on ``group`` (``parse_backends``)."""
    return parse_backends(dist.get_backend(group))


def reference_device(group: dist.ProcessGroup) -> torch.device:
    """Where the reference backend's tensors live: the current GPU where the group carries CUDA
    tensors (NCCL, alone or in a mixed group such as ``"cpu:gloo,cuda:nccl"``) and there is
    one, else the CPU (a gloo group, also where the ranks have GPUs: gloo's all-to-all takes CPU
    tensors only; docs/integration.md, "The process group an engine passes")."""
    if "cuda" in device_backends(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
