"""The backend choice refuses a Triton that cannot compile the peer kernels, alike on every rank.

``triton_problem`` reads this process's Triton: older than ``MIN_TRITON`` (3.4 and 3.5 fail in
ptxas on the kernels' 64-bit compare-and-swap) or not importable is a reason, newer or equal is
not. ``choose_backend`` gathers every rank's verdict in its one exchange, so two gloo ranks with
peer access faked (a CPU host has none) and an old Triton on one rank only both get the
reference backend for "auto", and both get UnsupportedConfigError naming that rank for "peer";
with the same, new enough Triton both get the peer backend. ``llcomm doctor`` predicts the same.
"""
from __future__ import annotations

import sys

import pytest

from _dist import run_distributed
from llcomm.commands import doctor
from llcomm.runtime import backend as B


@pytest.mark.parametrize("version, ok", [("3.6.0", True), ("3.10.0+git1a2b", True),
                                         ("4.0.1", True), ("3.5.1", False), ("3.4.0", False),
                                         ("2.3.1", False), ("nightly", False)])
def test_triton_problem_by_version(monkeypatch, version, ok):
    import triton
    monkeypatch.setattr(triton, "__version__", version)
    problem = B.triton_problem()
    if ok:
        assert problem is None
    else:
        assert problem == (f"Triton {version} is older than 3.6, the oldest that compiles "
                           "llcomm's peer kernels")


def test_triton_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)      # import triton raises ImportError
    assert B.triton_problem().startswith("Triton cannot be imported (ModuleNotFoundError")


def _choice_body(rank, world_size, versions, backend):
    import torch.distributed as dist

    import llcomm
    import triton
    B.this_place = lambda: ("host", f"gpu-{rank}", rank)       # a GPU each, one host
    B.peer_support = lambda places: (True, "faked: peer access")
    triton.__version__ = versions[rank]
    try:
        return B.choose_backend(dist.group.WORLD, backend, "Test")
    except llcomm.UnsupportedConfigError as e:
        return "refused", str(e)


@pytest.mark.parametrize("versions, backend, want", [
    (["3.9.0", "3.9.0"], "auto", ("peer", "faked: peer access")),
    (["3.9.0", "3.5.1"], "auto", ("reference", "rank 1: Triton 3.5.1 is older than 3.6, the "
                                  "oldest that compiles llcomm's peer kernels")),
    (["3.4.0", "3.9.0"], "peer", ("refused", "llcomm.Test(backend='peer'): rank 0: Triton "
                                  "3.4.0 is older than 3.6, the oldest that compiles llcomm's "
                                  "peer kernels. Use backend='reference' (torch.distributed) "
                                  "for this configuration.")),
])
def test_every_rank_chooses_alike(versions, backend, want):
    assert run_distributed(_choice_body, 2, versions, backend) == [want, want]


def test_doctor_predicts_the_reference_backend_without_a_usable_triton():
    backend, why = doctor.predict_backend(2, [[True, True], [True, True]], False)
    assert backend == "reference" and "triton" in why
    assert doctor.predict_backend(2, [[True, True], [True, True]], True)[0] == "peer"


def _hosts_choice_body(rank, world_size, shmem, backend):
    import torch.distributed as dist

    import llcomm
    B.this_place = lambda: (f"host-{rank}", f"gpu-{rank}", 0)   # a GPU each, a host each
    B.this_host = lambda: (f"host-{rank}", 1)
    B.shmem_problem = lambda: shmem[rank]
    try:
        return B.choose_backend_hosts(dist.group.WORLD, backend, "Test", (), None)[:2]
    except llcomm.UnsupportedConfigError as e:
        return "refused", str(e)


SPAN = "the ranks span 2 hosts of 1 rank (detected from the host names)"


@pytest.mark.parametrize("shmem, backend, want", [
    ([None, None], "auto", ("shmem", f"{SPAN}: the two-level kernels on SHMEM")),
    ([None, None], "peer", ("shmem", f"{SPAN}: the two-level kernels on SHMEM")),
    ([None, "no NVSHMEM here"], "auto",
     ("reference", f"{SPAN}: the two-level reference exchange (rank 1: no NVSHMEM here, so the "
                   "two-level kernels on SHMEM cannot run)")),
    (["no NVSHMEM here", None], "peer",
     ("refused", f"llcomm.Test(backend='peer'): {SPAN}, and the two-level kernels on SHMEM "
                 "cannot run: rank 0: no NVSHMEM here. Use backend='reference' "
                 "(torch.distributed) for this configuration.")),
    ([None, None], "reference", ("reference", f"requested; {SPAN}: the two-level exchange")),
])
def test_ranks_on_several_hosts_choose_alike(shmem, backend, want):
    """Across hosts every rank picks the two-level kernels on SHMEM only when every rank can
    run them (each rank's verdict travels in the one exchange), else the two-level reference
    exchange, which backend='peer' refuses, naming the rank and why."""
    assert run_distributed(_hosts_choice_body, 2, shmem, backend) == [want, want]
