"""Settings every rank must share are checked when a Communicator or EPBuffer is created.

Two gloo ranks (CPU) with their own environments: where a ranks-agree setting differs, every
rank's constructor raises UnsupportedConfigError naming the setting and each rank's value,
whichever backend was asked for; where the ranks agree (the same value, or one rank leaving it
unset and the other setting its default), or differ only in settings that are a rank's own
business (timeout, PDL), construction succeeds and the object works.
"""
from __future__ import annotations

import os

import pytest
import torch

from _dist import run_distributed

#: (what to build, backend, the setting, each rank's value (None: unset), what the error says
#: of each rank's value)
DIFFER = {
    "tp-reference": ("tp", "reference", "LLCOMM_LAMPORT_BYTES", ("16777216", "1048576"),
                     ("16777216", "1048576")),
    "tp-auto-unset": ("tp", "auto", "LLCOMM_NUM_BLOCKS", (None, "64"), ("128", "64")),
    "ep-reference": ("ep", "reference", "LLCOMM_EP_NUM_BLOCKS", ("32", "64"), ("32", "64")),
    "ep-auto-unset": ("ep", "auto", "LLCOMM_EP_LL", ("1", None), ("1", "unset")),
}


def _build(what: str, backend: str):
    import llcomm
    if what == "tp":
        return llcomm.Communicator(backend=backend, max_bytes=1 << 20)
    return llcomm.EPBuffer(num_experts=4, hidden=64, num_max_dispatch_tokens_per_rank=8,
                           backend=backend)


def _differ_body(rank, world_size, what, backend, name, values):
    import llcomm
    for other in ("LLCOMM_LAMPORT_BYTES", "LLCOMM_NUM_BLOCKS", "LLCOMM_EP_NUM_BLOCKS",
                  "LLCOMM_EP_LL"):
        os.environ.pop(other, None)
    if values[rank] is not None:
        os.environ[name] = values[rank]
    with pytest.raises(llcomm.UnsupportedConfigError) as e:
        _build(what, backend)
    return str(e.value)


@pytest.mark.parametrize("case", list(DIFFER))
def test_ranks_that_differ_are_refused_on_every_rank(case):
    what, backend, name, values, shown = DIFFER[case]
    messages = run_distributed(_differ_body, 2, what, backend, name, list(values))
    want = (f"{name} differs between ranks: rank 0: {shown[0]}, rank 1: {shown[1]}; every rank "
            "must use the same value")
    for rank, msg in enumerate(messages):
        assert want in msg, (rank, msg)
        assert msg.startswith("llcomm.Communicator:" if what == "tp" else "llcomm.EPBuffer:")
    assert messages[0] == messages[1]


def _agree_body(rank, world_size):
    # the same effective value (unset means 16 MiB at two ranks), and own-business settings
    # that differ
    os.environ.pop("LLCOMM_LAMPORT_BYTES", None)
    if rank == 1:
        os.environ["LLCOMM_LAMPORT_BYTES"] = str(16 << 20)
    os.environ["LLCOMM_TIMEOUT_MS"] = str(20000 + rank)
    os.environ["LLCOMM_PDL"] = str(rank)
    os.environ["LLCOMM_EP_NUM_BLOCKS"] = "32"
    os.environ["LLCOMM_EP_PROFILE"] = str(rank)
    for backend in ("reference", "auto"):
        comm = _build("tp", backend)
        assert comm.timeout_ms == 20000 + rank
        assert comm.settings.lamport_bytes == 16 << 20
        x = torch.full((5,), float(rank + 1))
        assert comm.all_reduce(x).eq(3.0).all()
        comm.close()
        buf = _build("ep", backend)
        assert buf.settings.num_blocks == 32
        buf.close()


def test_ranks_that_agree_construct():
    run_distributed(_agree_body, 2)
