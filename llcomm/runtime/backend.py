"""Which backend a Communicator or EPBuffer runs on: peer kernels where every rank has its own
GPU on one host with peer access both ways, the reference backend (torch.distributed) otherwise."""
from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

from ..errors import UnsupportedConfigError

log = logging.getLogger("llcomm")


def peer_support(group: dist.ProcessGroup) -> tuple[bool, str]:
    """Can the peer backend run on ``group``? Returns (ok, reason). A collective."""
    if not torch.cuda.is_available():
        return False, "no CUDA device is available"
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    me = (socket.gethostname(), str(getattr(props, "uuid", dev)), dev)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    if len({h for h, _, _ in everyone}) != 1:
        return False, "the ranks are on more than one host (peer memory is one host only)"
    uuids = [u for _, u, _ in everyone]
    if len(set(uuids)) != len(uuids):
        return False, ("two or more ranks share one GPU: a peer store between two contexts on one "
                       "device is undefined; give every rank its own GPU")
    local = {str(getattr(torch.cuda.get_device_properties(i), "uuid", i)): i
             for i in range(torch.cuda.device_count())}
    for _, u, _ in everyone:
        if u not in local:
            return False, "a peer's GPU is not visible to this process, so peer access cannot be checked"
        j = local[u]
        if j != dev and not torch.cuda.can_device_access_peer(dev, j):
            return False, f"GPU {dev} cannot access GPU {j} as a peer (no P2P/NVLink path)"
    return True, "every rank has its own GPU on this host and peer access works"


def choose_backend(group: dist.ProcessGroup, backend: str, what: str) -> tuple[str, str]:
    """Resolve ``backend`` ("auto", "peer" or "reference") for ``what`` (the class asking):
    returns (backend, reason). A collective where peer support must be checked; "peer" on a
    group that cannot run it raises UnsupportedConfigError with the reason."""
    if backend not in ("auto", "peer"):
        return backend, "requested"
    ok, why = peer_support(group)
    if backend == "peer" and not ok:
        raise UnsupportedConfigError(
            f"llcomm.{what}(backend='peer'): {why}. Use backend='reference' "
            "(torch.distributed) for this configuration.")
    if not ok:
        log.info("llcomm: rank %d: %s uses the reference backend: %s", dist.get_rank(group),
                 what, why)
    return ("peer" if ok else "reference"), why
