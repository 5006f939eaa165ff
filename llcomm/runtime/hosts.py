"""Which ranks of a group form each host: detected from the ranks' host names, or declared.

A topology is regular: ``num_hosts`` hosts of ``ranks_per_host`` consecutive ranks each, host h
holding ranks ``[h * ranks_per_host, (h + 1) * ranks_per_host)`` of the group; a rank's *local
rank* is its index inside its host, and the ranks of one local rank across the hosts form a
*rail* (the GPUs that share a NIC rail on a cluster). ``EPBuffer`` uses it to choose between the
single-host exchange and the two-level one (docs/multihost.md).

Detected (the default): every rank's host name and device count travel in the construction's
one exchange (``runtime/backend.py``), and ranks with the same host name form a host. Declared
(``LLCOMM_EP_RANKS_PER_HOST=N``): every N consecutive ranks form a host, whatever the host
names say, so that one machine can run as several hosts (tests, CI, trying the multi-host path).
A topology that is not regular raises ``UnsupportedConfigError`` on every rank (every rank
decides from the same exchanged values).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from ..errors import UnsupportedConfigError

#: The setting that declares the topology (``EPSettings.ranks_per_host``).
RANKS_PER_HOST_ENV = "LLCOMM_EP_RANKS_PER_HOST"

#: What each rank tells the others about its host: (host name, CUDA device count).
HostInfo = tuple[str, int]


def this_host() -> HostInfo:
    """This process's host name and the CUDA devices it sees (0 without CUDA)."""
    return socket.gethostname(), torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Hosts:
    """A regular topology of ``num_hosts`` hosts of ``ranks_per_host`` consecutive ranks.

    ``source`` says where it came from: ``"detected"`` or ``"declared"`` (the setting)."""

    num_hosts: int
    ranks_per_host: int
    source: str

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    @property
    def spans_hosts(self) -> bool:
        return self.num_hosts > 1

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_host

    def host_ranks(self, host: int) -> list[int]:
        """Group ranks of ``host``, in rank order."""
        return list(range(host * self.ranks_per_host, (host + 1) * self.ranks_per_host))

    def rail_ranks(self, local_rank: int) -> list[int]:
        """Group ranks of local rank ``local_rank`` on every host, in host order (a rail)."""
        return [h * self.ranks_per_host + local_rank for h in range(self.num_hosts)]

    def describe(self) -> str:
        how = (f"declared by {RANKS_PER_HOST_ENV}={self.ranks_per_host}"
               if self.source == "declared" else "detected from the host names")
        return (f"{self.num_hosts} host{'s' if self.num_hosts != 1 else ''} of "
                f"{self.ranks_per_host} rank{'s' if self.ranks_per_host != 1 else ''} ({how})")


def declared_hosts(what: str, world_size: int, ranks_per_host: int) -> Hosts:
    """The topology ``LLCOMM_EP_RANKS_PER_HOST=ranks_per_host`` declares for ``world_size``
    ranks; UnsupportedConfigError unless it divides the world size."""
    if world_size % ranks_per_host:
        raise UnsupportedConfigError(
            f"llcomm.{what}: {RANKS_PER_HOST_ENV}={ranks_per_host} does not divide the group's "
            f"{world_size} ranks; expected a divisor of {world_size} (hosts of equal size, "
            "consecutive ranks per host: docs/multihost.md)")
    return Hosts(world_size // ranks_per_host, ranks_per_host, "declared")


def detected_hosts(what: str, infos: list[HostInfo]) -> Hosts:
    """The topology of the ranks' ``this_host()`` (by rank): ranks with one host name form a
    host. UnsupportedConfigError naming the setting unless the hosts are regular."""
    names = [name for name, _ in infos]
    order = list(dict.fromkeys(names))          # host names in order of their first rank
    sizes = [names.count(n) for n in order]
    per_host = sizes[0]
    problems = []
    if len(set(sizes)) != 1:
        problems.append("hosts of different sizes (" + ", ".join(
            f"{n}: {c} ranks" for n, c in zip(order, sizes)) + ")")
    else:
        scattered = [r for r, n in enumerate(names) if order.index(n) != r // per_host]
        if scattered:
            problems.append(f"ranks of one host are not consecutive (rank {scattered[0]} is on "
                            f"{names[scattered[0]]!r})")
    if problems:
        raise UnsupportedConfigError(
            f"llcomm.{what}: the ranks' hosts, detected from their host names, are not a "
            f"regular topology: {problems[0]}; llcomm expects every host to hold the same number "
            "of consecutive ranks. Start the ranks that way, or declare the hosts with "
            f"{RANKS_PER_HOST_ENV} (set it to the group size to run as one host; "
            "docs/multihost.md)")
    return Hosts(len(order), per_host, "detected")


def resolve_hosts(what: str, infos: list[HostInfo], ranks_per_host: int | None) -> Hosts:
    """The group's topology: declared when ``ranks_per_host`` (the setting) is given, else
    detected from ``infos``. Every rank calls it with the same values, so every rank gets the
    same topology or the same exception."""
    if ranks_per_host is not None:
        return declared_hosts(what, len(infos), ranks_per_host)
    return detected_hosts(what, infos)
