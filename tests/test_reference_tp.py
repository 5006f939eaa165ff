"""The reference backend (gloo, CPU tensors) against an independent single-process oracle.

Every rank builds every rank's input itself, from generators seeded with the case's key and the
rank, so it knows the expected result without asking the library: the fp32 sum for reductions
(within the rounding bound of the dtype), the exact bytes for broadcast and the gathers. Outputs
are poisoned with NaN before each call (every payload here is finite, so a NaN left over is an
unwritten element), results are compared byte for byte across ranks, and inputs that must not
change are checked unchanged.

Movement payloads name their origin: the word at index i of rank r's input is
``((r + 1) << R | i mod 2**R) ^ salt`` (random salt per case and rank) with the top exponent bit
cleared so that it is always a finite number; a misplaced element is reported as "came from
rank r', element i'".
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.distributed as dist

import llcomm
from _dist import run_distributed

WORLD_SIZES = (2, 3, 4)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Element counts: one element, odd and non-power-of-two counts, and a few MB (4 MiB + 12 B in
#: fp32).
SIZES = (1, 7, 1000, 4097, (1 << 20) + 3)
#: all_gather_2d shapes [tokens, part] (the last one is about a million elements).
SHAPES_2D = ((1, 1), (7, 1), (1, 7), (8, 125), (17, 241), (1031, 1017))
#: Bound of every input: reduce_scatter's largest x is 4 ranks * (1 MiB + 3) fp32 elements.
MAX_BYTES = 32 << 20
ALGOS = ("auto", "one_shot", "two_shot", "lamport")

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# -- the oracle's inputs ----------------------------------------------------------------------
def gen(key: str, rank: int) -> torch.Generator:
    """A generator private to one test case and one rank (fresh inputs for every case)."""
    return torch.Generator().manual_seed(zlib.crc32(f"{key}/rank{rank}".encode()))


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def numbers(key: str, rank: int, shape, dtype) -> torch.Tensor:
    """Rank ``rank``'s input of a reduction: standard normal values, rounded to ``dtype``."""
    return torch.randn(shape, generator=gen(key, rank)).to(dtype)


_WORD = {2: (torch.int16, 11), 4: (torch.int32, 24)}  # bytes -> (int view, index bits R)


def payload(key: str, rank: int, shape, dtype) -> torch.Tensor:
    """Rank ``rank``'s input of a movement op: words that encode (rank, index), see the top."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    ityp, R = _WORD[itemsize]
    bits = 8 * itemsize
    n = math.prod(shape)
    idx = torch.arange(n, dtype=torch.int64)
    code = ((rank + 1) << R) | (idx & ((1 << R) - 1))
    salt = torch.randint(0, 1 << bits, (n,), generator=gen(key, rank), dtype=torch.int64)
    w = (code ^ salt) & ~(1 << (bits - 2))        # top exponent bit clear: never inf or NaN
    w = torch.where(w >= 1 << (bits - 1), w - (1 << bits), w)  # two's complement of the int view
    return w.to(ityp).view(dtype).reshape(shape)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


# -- checks -----------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def assert_written(out: torch.Tensor, case: str) -> None:
    nan = torch.isnan(out.float())
    if nan.any():
        i = int(nan.reshape(-1).nonzero()[0])
        raise AssertionError(f"{case}: {int(nan.sum())} of {out.numel()} elements of out were "
                             f"never written (still NaN), first at flat index {i}")


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, case: str, sources=()) -> None:
    """Byte-exact comparison; on failure say where the first wrong element came from.

    ``sources``: the inputs of every rank, searched for the wrong word to name its origin."""
    assert got.shape == want.shape, f"{case}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{case}: dtype {got.dtype} != {want.dtype}"
    if torch.equal(_bytes(got), _bytes(want)):
        return
    ityp = _WORD[got.element_size()][0]
    g, w = got.reshape(-1).view(ityp), want.reshape(-1).view(ityp)
    bad = (g != w).nonzero().reshape(-1)
    i = int(bad[0])
    origin = "matches no rank's input"
    for r, src in enumerate(sources):
        hits = (src.reshape(-1).view(ityp) == g[i]).nonzero().reshape(-1)
        if len(hits):
            origin = f"came from rank {r}'s element {int(hits[0])}"
            break
    if torch.isnan(got.reshape(-1)[i].float()):
        origin = "NaN: the poison, never written"
    mask = (1 << 8 * got.element_size()) - 1
    raise AssertionError(f"{case}: {len(bad)} of {g.numel()} elements differ; first at flat index "
                         f"{i}: got word {int(g[i]) & mask:#x} ({origin}), expected "
                         f"{int(w[i]) & mask:#x}")


def assert_close_to_sum(got: torch.Tensor, inputs: list[torch.Tensor], case: str) -> None:
    """``got`` is the sum of ``inputs`` up to the rounding of ``got.dtype``.

    Bound: each of the ``n - 1`` partial sums and the final result may round once, by at most
    u * sum|x_i| each (u = unit roundoff), whatever order and accumulation type the backend
    uses; plus half an ulp of the subnormal range per step."""
    assert_written(got, case)
    fi = torch.finfo(got.dtype)
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    mag = torch.stack([x.double().abs() for x in inputs]).sum(0)
    tol = len(inputs) * (fi.eps / 2 * mag + fi.tiny * fi.eps)
    err = (got.double() - exact).abs()
    if (err <= tol).all():
        return
    over = (err - tol).reshape(-1)
    i = int(over.argmax())
    raise AssertionError(f"{case}: {int((err > tol).sum())} of {got.numel()} elements off the fp32 "
                         f"sum; worst at flat index {i}: got {got.reshape(-1)[i].item()!r}, "
                         f"expected {exact.reshape(-1)[i].item()!r} (tolerance "
                         f"{tol.reshape(-1)[i].item():.3g})")


def assert_same_on_all_ranks(t: torch.Tensor, case: str) -> None:
    """Every rank holds the same bytes in ``t`` (checked with torch.distributed itself)."""
    ws, mine = dist.get_world_size(), _bytes(t.contiguous())
    every = torch.empty(ws * mine.numel(), dtype=torch.uint8)
    _all_gather_flat(every, mine)
    for r, theirs in enumerate(every.view(ws, -1)):
        if not torch.equal(theirs, mine):
            diff = int((theirs != mine).sum())
            raise AssertionError(f"{case}: rank {dist.get_rank()} and rank {r} differ in {diff} "
                                 "bytes of the result")


def make_comm(**kw) -> llcomm.Communicator:
    comm = llcomm.Communicator(backend="reference", max_bytes=MAX_BYTES, **kw)
    assert comm.backend == "reference" and comm.device == torch.device("cpu")
    return comm


# -- the ops, run inside every rank -------------------------------------------------------------
def _all_reduce(rank, ws):
    comm = make_comm()
    for dtype in DTYPES:
        for n in SIZES:
            for algo in ALGOS:
                case = f"all_reduce ws={ws} {dname(dtype)} n={n} algo={algo}"
                xs = [numbers(case, r, (n,), dtype) for r in range(ws)]
                x, x_before = xs[rank].clone(), xs[rank].clone()
                out = poisoned((n,), dtype)
                y = comm.all_reduce(x, out=out, algo=algo)
                assert y is out, f"{case}: did not return out"
                assert torch.equal(_bytes(x), _bytes(x_before)), f"{case}: x was modified"
                assert_close_to_sum(out, xs, case)
                assert_same_on_all_ranks(out, case)
            # out=None allocates; out=x works in place.
            case = f"all_reduce ws={ws} {dname(dtype)} n={n} out=None"
            xs = [numbers(case, r, (n,), dtype) for r in range(ws)]
            y = comm.all_reduce(xs[rank].clone())
            assert y.shape == (n,) and y.dtype == dtype, f"{case}: got {y.shape} {y.dtype}"
            assert_close_to_sum(y, xs, case)
            assert_same_on_all_ranks(y, case)
            case = f"all_reduce ws={ws} {dname(dtype)} n={n} in place"
            xs = [numbers(case, r, (n,), dtype) for r in range(ws)]
            x = xs[rank].clone()
            y = comm.all_reduce(x, out=x)
            assert y is x, f"{case}: did not return x"
            assert_close_to_sum(x, xs, case)
        case = f"all_reduce ws={ws} {dname(dtype)} shape=(3, 5, 7)"
        xs = [numbers(case, r, (3, 5, 7), dtype) for r in range(ws)]
        out = poisoned((3, 5, 7), dtype)
        comm.all_reduce(xs[rank].clone(), out=out)
        assert_close_to_sum(out, xs, case)
    # Repeated calls on the same buffers give the same bits (no state carried between calls).
    case = f"all_reduce ws={ws} repeat"
    xs = [numbers(case, r, (4097,), torch.bfloat16) for r in range(ws)]
    first = comm.all_reduce(xs[rank])
    for _ in range(3):
        assert torch.equal(_bytes(comm.all_reduce(xs[rank])), _bytes(first)), f"{case}: differs"
    comm.close()


def _broadcast(rank, ws):
    comm = make_comm()
    for dtype in DTYPES:
        for n in SIZES:
            for src in range(ws):
                case = f"broadcast ws={ws} {dname(dtype)} n={n} src={src}"
                sent = payload(case, src, (n,), dtype)
                x = sent.clone() if rank == src else poisoned((n,), dtype)
                y = comm.broadcast(x, src)
                assert y is x, f"{case}: did not return x"
                assert_bytes_equal(x, sent, case, [sent])
                assert_same_on_all_ranks(x, case)
    case = f"broadcast ws={ws} shape=(2, 3, 5)"
    sent = payload(case, ws - 1, (2, 3, 5), torch.float16)
    x = sent.clone() if rank == ws - 1 else poisoned((2, 3, 5), torch.float16)
    comm.broadcast(x, ws - 1)
    assert_bytes_equal(x, sent, case, [sent])
    comm.close()


def _all_gather(rank, ws):
    comm = make_comm()
    shapes = [(n,) for n in SIZES] + [(5, 3, 7), ()]
    for dtype in DTYPES:
        for shape in shapes:
            case = f"all_gather ws={ws} {dname(dtype)} shape={shape}"
            parts = [payload(case, r, shape, dtype) for r in range(ws)]
            want = torch.cat([p.reshape(1, *shape) if not shape else p for p in parts])
            x = parts[rank].clone()
            out = poisoned(tuple(want.shape), dtype)
            y = comm.all_gather(x, out=out)
            assert y is out, f"{case}: did not return out"
            assert torch.equal(_bytes(x), _bytes(parts[rank])), f"{case}: x was modified"
            assert_bytes_equal(out, want, case, parts)
            assert_same_on_all_ranks(out, case)
        case = f"all_gather ws={ws} {dname(dtype)} out=None"
        parts = [payload(case, r, (4097,), dtype) for r in range(ws)]
        assert_bytes_equal(comm.all_gather(parts[rank].clone()), torch.cat(parts), case, parts)
    comm.close()


def _all_gather_2d(rank, ws):
    comm = make_comm()
    for dtype in DTYPES:
        for tokens, part in SHAPES_2D:
            case = f"all_gather_2d ws={ws} {dname(dtype)} x=[{tokens}, {part}]"
            parts = [payload(case, r, (tokens, part), dtype) for r in range(ws)]
            want = torch.cat(parts, dim=1)  # rank r's part of token t at [t, r*part:(r+1)*part]
            x = parts[rank].clone()
            out = poisoned((tokens, ws * part), dtype)
            y = comm.all_gather_2d(x, out=out)
            assert y is out, f"{case}: did not return out"
            assert torch.equal(_bytes(x), _bytes(parts[rank])), f"{case}: x was modified"
            assert_bytes_equal(out, want, case, parts)
            assert_same_on_all_ranks(out, case)
        case = f"all_gather_2d ws={ws} {dname(dtype)} out=None"
        parts = [payload(case, r, (9, 33), dtype) for r in range(ws)]
        got = comm.all_gather_2d(parts[rank].clone())
        assert_bytes_equal(got, torch.cat(parts, dim=1), case, parts)
    comm.close()


def _reduce_scatter(rank, ws):
    comm = make_comm()
    shapes = [(n,) for n in SIZES] + [(5, 3)]
    for dtype in DTYPES:
        for part in shapes:
            full = (ws * part[0], *part[1:])
            case = f"reduce_scatter ws={ws} {dname(dtype)} out={part}"
            xs = [numbers(case, r, full, dtype) for r in range(ws)]
            x, x_before = xs[rank].clone(), xs[rank].clone()
            out = poisoned(part, dtype)
            y = comm.reduce_scatter(x, out=out)
            assert y is out, f"{case}: did not return out"
            assert torch.equal(_bytes(x), _bytes(x_before)), f"{case}: x was modified"
            mine = [xi[rank * part[0]:(rank + 1) * part[0]] for xi in xs]
            assert_close_to_sum(out, mine, case)
        case = f"reduce_scatter ws={ws} {dname(dtype)} out=None"
        xs = [numbers(case, r, (ws * 7, 2), dtype) for r in range(ws)]
        y = comm.reduce_scatter(xs[rank].clone())
        assert y.shape == (7, 2), f"{case}: shape {tuple(y.shape)}"
        assert_close_to_sum(y, [xi[rank * 7:(rank + 1) * 7] for xi in xs], case)
    comm.close()


OPS = {"all_reduce": _all_reduce, "broadcast": _broadcast, "all_gather": _all_gather,
       "all_gather_2d": _all_gather_2d, "reduce_scatter": _reduce_scatter}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_op_matches_oracle(op, world_size):
    run_distributed(OPS[op], world_size)


# -- a sub-group: group ranks, not global ranks --------------------------------------------------
SUBGROUP = [1, 2, 3]  # of a world of 4; group rank g is global rank g + 1


def _subgroup(rank, ws):
    group = dist.new_group(SUBGROUP)  # a collective of the whole world
    if rank not in SUBGROUP:
        return
    g, gs = SUBGROUP.index(rank), len(SUBGROUP)
    comm = llcomm.Communicator(group, backend="reference", max_bytes=MAX_BYTES)
    assert (comm.rank, comm.world_size) == (g, gs)
    dtype, n = torch.bfloat16, 1000
    for src in range(gs):
        case = f"subgroup broadcast src={src}"
        sent = payload(case, src, (n,), dtype)
        x = sent.clone() if g == src else poisoned((n,), dtype)
        comm.broadcast(x, src)
        assert_bytes_equal(x, sent, case, [sent])
    case = "subgroup all_gather"
    parts = [payload(case, r, (n,), dtype) for r in range(gs)]
    assert_bytes_equal(comm.all_gather(parts[g].clone()), torch.cat(parts), case, parts)
    case = "subgroup all_gather_2d"
    parts = [payload(case, r, (3, 5), dtype) for r in range(gs)]
    assert_bytes_equal(comm.all_gather_2d(parts[g].clone()), torch.cat(parts, 1), case, parts)
    case = "subgroup all_reduce"
    xs = [numbers(case, r, (n,), dtype) for r in range(gs)]
    assert_close_to_sum(comm.all_reduce(xs[g].clone()), xs, case)
    case = "subgroup reduce_scatter"
    xs = [numbers(case, r, (gs * 4,), dtype) for r in range(gs)]
    assert_close_to_sum(comm.reduce_scatter(xs[g].clone()),
                        [xi[g * 4:(g + 1) * 4] for xi in xs], case)
    comm.close()


def test_subgroup_uses_group_ranks():
    run_distributed(_subgroup, 4)


# -- backend selection on a CPU machine ----------------------------------------------------------
def _auto_backend(rank, ws):
    comm = llcomm.Communicator()  # backend="auto"
    assert comm.backend == "reference", comm.backend
    assert comm.backend_reason, "auto should say why it chose the reference backend"
    xs = [numbers("auto", r, (7,), torch.float32) for r in range(ws)]
    assert_close_to_sum(comm.all_reduce(xs[rank].clone()), xs, "auto all_reduce")
    with comm:
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks the peer backend where CUDA is")
def test_auto_backend_is_reference_without_cuda():
    run_distributed(_auto_backend, 2)
