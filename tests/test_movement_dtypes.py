"""broadcast, all_gather and all_gather_2d take every dtype, byte-exact (reference backend,
gloo, CPU), and the custom ops (``llcomm.ops``) trace them.

Every rank builds every rank's payload itself (``_payloads.payload``: NaN payloads, -0.0,
subnormals, all 256 float8 patterns, random bytes), outputs are poisoned before each call, and
results are compared as bytes. Sizes include a single element and odd byte counts (3 bytes of an
int8 or bool: gloo moves bytes, so nothing may round them up to words). Ranks that pass
different dtypes of the same byte count are a mismatch (the choice both backends make).
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_distributed
from _payloads import MOVE_DTYPES, payload, poisoned, same_bytes

#: Shapes of broadcast's and all_gather's x: 0-d, one element, 3 elements (3 bytes of a 1-byte
#: dtype), a 2-D one of odd row bytes.
SHAPES = ((), (1,), (3,), (5, 7))
#: all_gather_2d's [tokens, part]: single tokens and parts, 3-element parts.
SHAPES_2D = ((1, 1), (1, 3), (3, 1), (4, 3))
MAX_BYTES = 1 << 16


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fail(case: str, got: torch.Tensor, want: torch.Tensor) -> str:
    g, w = got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
    if g.shape != w.shape:
        return f"{case}: {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    bad = (g != w).nonzero().reshape(-1)
    return f"{case}: {len(bad)} of {g.numel()} bytes differ, first at byte {int(bad[0])}"


def _cat(parts, dim: int) -> torch.Tensor:
    """torch.cat on the bytes (torch has no cat for some of these dtypes, e.g. float4)."""
    dtype = parts[0].dtype
    b = [p.reshape(p.shape[:-1] + (-1,)).view(torch.uint8) if p.dim() else
         p.reshape(1).view(torch.uint8) for p in parts]
    return torch.cat(b, dim).view(dtype)


def _every_dtype(rank, ws):
    import llcomm
    comm = llcomm.Communicator(backend="reference", max_bytes=MAX_BYTES)
    fails = []

    def check(case, got, want):
        if not same_bytes(got, want):
            fails.append(_fail(case, got, want))

    for dtype in MOVE_DTYPES:
        for shape in SHAPES:
            for src in range(ws):
                case = f"broadcast {_name(dtype)} {shape} src={src}"
                sent = payload(dtype, shape, (case, src))
                x = sent.clone() if rank == src else poisoned(shape, dtype)
                check(case, comm.broadcast(x, src), sent)
            case = f"all_gather {_name(dtype)} {shape}"
            parts = [payload(dtype, shape, (case, r)).reshape(-1 if shape == () else shape)
                     for r in range(ws)]
            x = parts[rank].reshape(shape).clone()
            want = _cat(parts, 0)
            check(case, comm.all_gather(x), want)
            check(case + " out=", comm.all_gather(x, out=poisoned(want.shape, dtype)), want)
            check(case + " (input)", x, parts[rank].reshape(shape))
        for shape in SHAPES_2D:
            case = f"all_gather_2d {_name(dtype)} {shape}"
            parts = [payload(dtype, shape, (case, r)) for r in range(ws)]
            want = _cat(parts, 1)
            x = parts[rank].clone()
            check(case, comm.all_gather_2d(x, out=poisoned(want.shape, dtype)), want)
            check(case + " (input)", x, parts[rank])
    comm.close()
    return fails


@pytest.mark.parametrize("world_size", (2, 3))
def test_every_dtype_is_byte_exact(world_size):
    fails = [f for rank_fails in run_distributed(_every_dtype, world_size, timeout=300)
             for f in rank_fails]
    assert not fails, "\n".join(fails[:20])


def test_every_dtype_has_its_own_code():
    """The call check and the peer tags tell dtypes apart by their code: every dtype the
    movement ops take has one, and no two share one."""
    from llcomm.runtime import protocol as P
    assert len(MOVE_DTYPES) >= 12
    assert {_name(d) for d in MOVE_DTYPES} == set(P.DTYPE_CODES)
    assert len(set(P.DTYPE_CODES.values())) == len(P.DTYPE_CODES)
    for d in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.float8_e4m3fn, torch.float8_e5m2, torch.float64, torch.bfloat16,
              torch.float16, torch.float32):
        assert d in MOVE_DTYPES, d


#: name: (rank 0's x, rank 1's x): the same bytes, different dtypes.
DTYPE_MISMATCHES = {
    "int32-vs-float32": ((8,), torch.int32, (8,), torch.float32),
    "int8-vs-bool": ((3,), torch.int8, (3,), torch.bool),
    "float8_e4m3fn-vs-float8_e5m2": ((4,), torch.float8_e4m3fn, (4,), torch.float8_e5m2),
    "int64-vs-int32": ((4,), torch.int64, (8,), torch.int32),
}


def _mismatch(rank, ws, op, cases):
    import llcomm
    from llcomm.errors import CommMismatchError
    seen = {}
    for name, case in cases.items():
        shape, dtype = case[2 * rank], case[2 * rank + 1]
        comm = llcomm.Communicator(backend="reference", max_bytes=MAX_BYTES)
        x = payload(dtype, shape, (name, rank))
        x0 = x.clone()
        try:
            if op == "broadcast":
                comm.broadcast(x, 0)
            else:
                getattr(comm, op)(x.view(1, -1) if op == "all_gather_2d" else x)
            seen[name] = "ran"
        except CommMismatchError as e:
            seen[name] = "mismatch" if "dtype=" in str(e) and same_bytes(x, x0) else str(e)
        comm.close()
    return seen


@pytest.mark.parametrize("op", ("broadcast", "all_gather", "all_gather_2d"))
def test_different_dtypes_of_the_same_bytes_are_a_mismatch(op):
    """Byte-wise the move would be the same, but the call is not: CommMismatchError on every
    rank, naming the dtypes, nothing moved (the peer backend's tags agree: test_protocol.py)."""
    for seen in run_distributed(_mismatch, 2, op, DTYPE_MISMATCHES):
        assert seen == {name: "mismatch" for name in DTYPE_MISMATCHES}, seen


# -- the custom ops ------------------------------------------------------------------------------
OPS_DTYPES = (torch.int64, torch.bool, torch.float8_e4m3fn, torch.int8)


def _ops(rank, ws):
    import llcomm
    import llcomm.ops as ops
    from torch.library import opcheck
    comm = llcomm.Communicator(backend="reference", max_bytes=MAX_BYTES)
    L = torch.ops.llcomm
    for dtype in OPS_DTYPES:
        parts = [payload(dtype, (2, 3), ("ops", _name(dtype), r)) for r in range(ws)]
        x = parts[rank]
        got = ops.all_gather(comm, x)
        assert same_bytes(got, torch.cat(parts)), dtype
        got = ops.all_gather_2d(comm, x)
        assert same_bytes(got, torch.cat(parts, 1)), dtype
        y = x.clone()
        assert ops.broadcast(comm, y, 1) is y and same_bytes(y, parts[1]), dtype
        # schema and fake implementations (the output's shape and dtype) for this dtype; the
        # schema test compares with torch.allclose, which torch lacks for float8 on the CPU
        utils = ("test_faketensor",) + (("test_schema",) if dtype.itemsize > 1 or
                                        not dtype.is_floating_point else ())
        opcheck(L.broadcast_.default, (comm.op_handle, x.clone(), 0), test_utils=utils)
        opcheck(L.all_gather.default, (comm.op_handle, x), test_utils=utils)
        opcheck(L.all_gather_2d.default, (comm.op_handle, x), test_utils=utils)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fx = mode.from_tensor(x)
            g, g2 = L.all_gather(comm.op_handle, fx), L.all_gather_2d(comm.op_handle, fx)
            assert (g.shape, g.dtype) == ((2 * ws, 3), dtype)
            assert (g2.shape, g2.dtype) == ((2, 3 * ws), dtype)
    comm.close()


def test_ops_take_every_dtype():
    run_distributed(_ops, 2, timeout=300)
