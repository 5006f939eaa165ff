"""``Buffer(None, ..., comm=<mpi4py communicator>)``: the torch.distributed group of the
same processes. llcomm communicates through torch.distributed only, never through MPI, so a
communicator is accepted where it names the world torch.distributed already has."""
from __future__ import annotations

import torch.distributed as dist

from .checks import PREFIX


def group_of_comm(comm) -> dist.ProcessGroup:
    """The world group, when ``comm`` (an ``mpi4py.MPI.Comm``: ``Get_rank()`` and
    ``Get_size()`` are all that is read) spans the same processes with the same rank numbers
    as the initialised torch.distributed world.

    A collective over the world: the ranks exchange their ``comm`` ranks, so that every rank
    raises or none does. Raises TypeError (``comm`` lacks ``Get_rank`` / ``Get_size``),
    RuntimeError (torch.distributed is not initialised) or ValueError (another world, or other
    rank numbers), each naming ``comm`` and the alternative, ``group=``.
    """
    if not all(callable(getattr(comm, m, None)) for m in ("Get_rank", "Get_size")):
        raise TypeError(f"{PREFIX}: comm={comm!r} is not an mpi4py communicator (it has no "
                        "Get_rank / Get_size); pass group=, a torch.distributed process group")
    rank, size = comm.Get_rank(), comm.Get_size()
    if not dist.is_initialized():
        raise RuntimeError(
            f"{PREFIX}: comm= (an mpi4py communicator of {size} ranks) needs torch.distributed "
            "initialised over the same processes: llcomm communicates through torch.distributed, "
            "not MPI. Call torch.distributed.init_process_group first (then comm= maps to its "
            "world), or pass group=, a torch.distributed process group")
    world = dist.get_world_size()
    seen = [None] * world
    dist.all_gather_object(seen, (rank, size))
    if seen != [(r, world) for r in range(world)]:
        raise ValueError(
            f"{PREFIX}: comm= is not torch.distributed's world: the ranks' (comm rank, comm "
            f"size) are {seen}, where the world of {world} ranks needs (r, {world}) on world "
            "rank r. llcomm maps a communicator only onto the whole world with the same rank "
            "numbers; for another set of ranks pass group=, a torch.distributed process group of "
            "them")
    return dist.group.WORLD
