"""Argument validation of ``Communicator`` on the reference backend.

Every rejected call must raise the documented type (TypeError for a wrong type or dtype,
ValueError for a wrong value, UnsupportedConfigError for a backend this host cannot run) with a
message that starts with the function's name and names the argument, before any buffer is
touched; the communicator must keep working afterwards.

Most cases run in a one-rank gloo world inside the pytest process (cheap, one test each); the
whole table runs again in two spawned ranks, each rejected call followed by a checked all_reduce.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import llcomm
from _dist import run_distributed
from llcomm.runtime import protocol as P

SMALL_MAX_BYTES = 1024  # bytes; the communicator of the max_bytes cases


@pytest.fixture
def world1():
    """A one-rank gloo world in this process, torn down after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def f32(*shape):
    return torch.ones(shape, dtype=torch.float32)


# (id, call(comm, ws), exception type, regex the message must match). Each regex names the
# argument as the message does, after the function's name.
CASES = [
    # dtype of x: the reductions sum bf16 / fp16 / fp32 and say why; the movement ops take any
    # plain dtype (test_movement_accepts_every_dtype), not a quantized or sub-byte one
    ("all_reduce-int32", lambda c, ws: c.all_reduce(torch.ones(8, dtype=torch.int32)),
     TypeError,
     r"llcomm\.all_reduce: x has dtype int32; expected one of bfloat16, float16, float32"),
    ("all_reduce-int64", lambda c, ws: c.all_reduce(torch.ones(8, dtype=torch.int64)),
     TypeError, r"^llcomm\.all_reduce: x has dtype int64; expected one of bfloat16, float16, "
                r"float32 \(a reduction sums, so it needs a float type; broadcast, all_gather and "
                r"all_gather_2d copy bytes and take any dtype\)$"),
    ("all_reduce-float64", lambda c, ws: c.all_reduce(torch.ones(8, dtype=torch.float64)),
     TypeError, r"llcomm\.all_reduce: x has dtype float64.*needs a float type"),
    ("all_reduce-bool", lambda c, ws: c.all_reduce(torch.ones(8, dtype=torch.bool)),
     TypeError, r"llcomm\.all_reduce: x has dtype bool.*needs a float type"),
    ("all_reduce-float8", lambda c, ws: c.all_reduce(torch.ones(8, dtype=torch.float8_e4m3fn)),
     TypeError, r"llcomm\.all_reduce: x has dtype float8_e4m3fn.*needs a float type"),
    ("reduce_scatter-float64",
     lambda c, ws: c.reduce_scatter(torch.ones(2 * ws, dtype=torch.float64)),
     TypeError, r"llcomm\.reduce_scatter: x has dtype float64"),
    ("reduce_scatter-int32",
     lambda c, ws: c.reduce_scatter(torch.ones(2 * ws, dtype=torch.int32)),
     TypeError, r"llcomm\.reduce_scatter: x has dtype int32; expected one of bfloat16, float16, "
                r"float32 \(a reduction sums, so it needs a float type; broadcast, all_gather"),
    ("broadcast-bits8", lambda c, ws: c.broadcast(torch.zeros(8, dtype=torch.bits8), 0),
     TypeError, r"llcomm\.broadcast: x has dtype bits8; expected one of float32, .*int64.*bool"
                r".*float8_e4m3fn.* \(the movement ops copy the bytes of any plain dtype"),
    ("all_gather-uint4", lambda c, ws: c.all_gather(torch.empty(8, dtype=torch.uint4)),
     TypeError, r"llcomm\.all_gather: x has dtype uint4; expected one of"),
    ("all_gather_2d-bits8",
     lambda c, ws: c.all_gather_2d(torch.zeros(2, 4, dtype=torch.bits8)),
     TypeError, r"llcomm\.all_gather_2d: x has dtype bits8"),
    ("all_gather-out-dtype-int",
     lambda c, ws: c.all_gather(torch.ones(8, dtype=torch.int64),
                                out=torch.ones(8 * ws, dtype=torch.float64)),
     TypeError, r"llcomm\.all_gather: out has dtype torch\.float64; expected torch\.int64"),
    ("all_reduce-not-a-tensor", lambda c, ws: c.all_reduce([1.0, 2.0]),
     TypeError, r"llcomm\.all_reduce: x must be a torch\.Tensor, got list"),
    # device: a meta tensor is on another device than the communicator's (cpu)
    ("all_reduce-meta", lambda c, ws: c.all_reduce(torch.empty(8, device="meta")),
     ValueError, r"llcomm\.all_reduce: x is on meta; expected cpu"),
    ("broadcast-meta", lambda c, ws: c.broadcast(torch.empty(8, device="meta"), 0),
     ValueError, r"llcomm\.broadcast: x is on meta"),
    ("all_reduce-out-meta", lambda c, ws: c.all_reduce(f32(8), out=torch.empty(8, device="meta")),
     ValueError, r"llcomm\.all_reduce: out is on meta"),
    # contiguity
    ("all_reduce-strided", lambda c, ws: c.all_reduce(f32(4, 8)[:, ::2]),
     ValueError, r"llcomm\.all_reduce: x is not contiguous; pass x\.contiguous\(\)$"),
    ("all_gather_2d-transposed", lambda c, ws: c.all_gather_2d(f32(4, 8).t()),
     ValueError, r"llcomm\.all_gather_2d: x is not contiguous"),
    ("broadcast-strided", lambda c, ws: c.broadcast(f32(16)[::2], 0),
     ValueError, r"llcomm\.broadcast: x is not contiguous"),
    ("all_reduce-out-strided", lambda c, ws: c.all_reduce(f32(4, 4), out=f32(4, 8)[:, ::2]),
     ValueError, r"llcomm\.all_reduce: out is not contiguous; the result is written into it, "
                 r"so pass a contiguous tensor \(a copy made by \.contiguous\(\) would not be "
                 r"the one you hold\)$"),
    # out: shape, dtype, type
    ("all_reduce-out-shape", lambda c, ws: c.all_reduce(f32(8), out=f32(9)),
     ValueError, r"llcomm\.all_reduce: out has shape \(9,\); expected \(8,\)"),
    ("all_reduce-out-dtype",
     lambda c, ws: c.all_reduce(f32(8), out=torch.ones(8, dtype=torch.float16)),
     TypeError, r"llcomm\.all_reduce: out has dtype torch\.float16; expected torch\.float32"),
    ("all_reduce-out-not-a-tensor", lambda c, ws: c.all_reduce(f32(8), out=[0.0] * 8),
     TypeError, r"llcomm\.all_reduce: out must be a torch\.Tensor"),
    ("all_gather-out-shape", lambda c, ws: c.all_gather(f32(8), out=f32(8 * ws + 1)),
     ValueError, r"llcomm\.all_gather: out has shape"),
    ("all_gather-out-dtype",
     lambda c, ws: c.all_gather(f32(8), out=torch.ones(8 * ws, dtype=torch.bfloat16)),
     TypeError, r"llcomm\.all_gather: out has dtype"),
    ("all_gather_2d-out-shape", lambda c, ws: c.all_gather_2d(f32(3, 4), out=f32(3, 4 * ws + 1)),
     ValueError, r"llcomm\.all_gather_2d: out has shape \(3, \d+\); expected \(3, \d+\)"),
    ("reduce_scatter-out-shape", lambda c, ws: c.reduce_scatter(f32(4 * ws), out=f32(5)),
     ValueError, r"llcomm\.reduce_scatter: out has shape \(5,\); expected \(4,\)"),
    ("reduce_scatter-out-dtype",
     lambda c, ws: c.reduce_scatter(f32(4 * ws), out=torch.ones(4, dtype=torch.float16)),
     TypeError, r"llcomm\.reduce_scatter: out has dtype"),
    # shapes each op needs
    ("all_gather_2d-1d", lambda c, ws: c.all_gather_2d(f32(8)),
     ValueError, r"llcomm\.all_gather_2d: x has shape \(8,\); expected 2-D"),
    ("all_gather_2d-3d", lambda c, ws: c.all_gather_2d(f32(2, 3, 4)),
     ValueError, r"llcomm\.all_gather_2d: x has shape \(2, 3, 4\); expected 2-D"),
    ("reduce_scatter-0d", lambda c, ws: c.reduce_scatter(torch.tensor(1.0)),
     ValueError,
     r"llcomm\.reduce_scatter: x has shape \(\); dim 0 must be a multiple of world_size"),
    # broadcast src
    ("broadcast-src-too-big", lambda c, ws: c.broadcast(f32(8), ws),
     ValueError, r"llcomm\.broadcast: src=\d+; expected a rank in \[0, \d+\)"),
    ("broadcast-src-negative", lambda c, ws: c.broadcast(f32(8), -1),
     ValueError, r"llcomm\.broadcast: src=-1"),
    ("broadcast-src-bool", lambda c, ws: c.broadcast(f32(8), True),
     ValueError, r"llcomm\.broadcast: src=True"),
    ("broadcast-src-float", lambda c, ws: c.broadcast(f32(8), 0.0),
     ValueError, r"llcomm\.broadcast: src=0\.0"),
    ("broadcast-src-str", lambda c, ws: c.broadcast(f32(8), "0"),
     ValueError, r"llcomm\.broadcast: src='0'"),
    ("broadcast-src-tensor", lambda c, ws: c.broadcast(f32(8), torch.tensor(0)),
     ValueError, r"llcomm\.broadcast: src=tensor"),
    # algo
    ("all_reduce-algo-unknown", lambda c, ws: c.all_reduce(f32(8), algo="ring"),
     ValueError,
     r"llcomm\.all_reduce: algo='ring'; expected one of auto, one_shot, two_shot, lamport"),
    ("all_reduce-algo-none", lambda c, ws: c.all_reduce(f32(8), algo=None),
     ValueError, r"llcomm\.all_reduce: algo=None"),
    # all_reduce_residual_rmsnorm: every argument
    *[(f"fused-{name}", call, exc, r"llcomm\.all_reduce_residual_rmsnorm: " + pattern)
      for name, call, exc, pattern in [
          ("x-1d", lambda c, ws: c.all_reduce_residual_rmsnorm(f32(8), f32(8), f32(8)),
           ValueError, r"x has shape \(8,\); expected 2-D \[tokens, hidden\]"),
          ("x-int32", lambda c, ws: c.all_reduce_residual_rmsnorm(
              torch.ones(2, 8, dtype=torch.int32), f32(2, 8), f32(8)),
           TypeError, r"x has dtype int32; expected one of bfloat16, float16, float32 \(a "
                      r"reduction sums, so it needs a float type"),
          ("x-hidden-too-long", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(1, 16385), f32(1, 16385), f32(16385)),
           ValueError, r"x has hidden=16385; at most 16384"),
          ("x-hidden-0", lambda c, ws: c.all_reduce_residual_rmsnorm(f32(2, 0), f32(2, 0), f32(0)),
           ValueError, r"x has shape \(2, 0\); expected 2-D \[tokens, hidden\], hidden >= 1"),
          ("residual-shape", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(3, 8), f32(8)),
           ValueError, r"residual has shape \(3, 8\); expected \(2, 8\)"),
          ("residual-dtype", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), torch.ones(2, 8, dtype=torch.bfloat16), f32(8)),
           TypeError, r"residual has dtype torch\.bfloat16; expected torch\.float32"),
          ("residual-strided", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 16)[:, ::2], f32(8)),
           ValueError, r"residual is not contiguous; pass residual\.contiguous\(\)$"),
          ("weight-strided", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(16)[::2]),
           ValueError, r"weight is not contiguous; pass weight\.contiguous\(\)$"),
          ("residual_out-strided", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), residual_out=f32(2, 16)[:, ::2]),
           ValueError, r"residual_out is not contiguous; the result is written into it, so pass "
                       r"a contiguous tensor"),
          ("weight-length", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(7)),
           ValueError, r"weight has shape \(7,\); expected \(8,\)"),
          ("weight-2d", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(1, 8)),
           ValueError, r"weight has shape \(1, 8\); expected \(8,\)"),
          ("weight-float64", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), torch.ones(8, dtype=torch.float64)),
           TypeError, r"weight has dtype float64"),
          ("weight-meta", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), torch.empty(8, device="meta")),
           ValueError, r"weight is on meta"),
          ("eps-zero", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), 0.0),
           ValueError, r"eps=0\.0; expected a positive finite float"),
          ("eps-negative", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), -1e-6),
           ValueError, r"eps=-1e-06"),
          ("eps-nan", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), float("nan")),
           ValueError, r"eps=nan"),
          ("eps-str", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), "1e-6"),
           TypeError, r"eps='1e-6'"),
          ("eps-bool", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), True),
           TypeError, r"eps=True"),
          ("out-shape", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), out=f32(2, 9)),
           ValueError, r"out has shape \(2, 9\); expected \(2, 8\)"),
          ("residual_out-dtype", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), residual_out=torch.ones(2, 8, dtype=torch.float16)),
           TypeError, r"residual_out has dtype torch\.float16; expected torch\.float32"),
          ("out-is-residual_out", lambda c, ws: (lambda o: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), out=o, residual_out=o))(f32(2, 8)),
           ValueError, r"out and residual_out are the same memory"),
          ("algo", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 8), f32(8), algo="two_shot"),
           ValueError, r"algo='two_shot'; expected one of auto, one_shot, lamport"),
          ("several", lambda c, ws: c.all_reduce_residual_rmsnorm(
              f32(2, 8), f32(2, 7), f32(9), eps=-1.0),
           ValueError, r"residual has shape .*weight has shape .*eps=-1\.0"),
      ]],
    # the other fused joins: x [2, 128] float32 (the hot path has run that shape first)
    *[(f"rmsnorm-{name}", call, exc, r"llcomm\.all_reduce_rmsnorm: " + pattern)
      for name, call, exc, pattern in [
          ("x-1d", lambda c, ws: c.all_reduce_rmsnorm(f32(128), f32(128)),
           ValueError, r"x has shape \(128,\); expected 2-D"),
          ("weight-length", lambda c, ws: c.all_reduce_rmsnorm(f32(2, 128), f32(127)),
           ValueError, r"weight has shape \(127,\); expected \(128,\)"),
          ("eps-zero", lambda c, ws: c.all_reduce_rmsnorm(f32(2, 128), f32(128), 0.0),
           ValueError, r"eps=0\.0; expected a positive finite float"),
          ("out-dtype", lambda c, ws: c.all_reduce_rmsnorm(
              f32(2, 128), f32(128), out=torch.ones(2, 128, dtype=torch.float16)),
           TypeError, r"out has dtype torch\.float16; expected torch\.float32"),
          ("residual_out-shape", lambda c, ws: c.all_reduce_rmsnorm(
              f32(2, 128), f32(128), residual_out=f32(2, 127)),
           ValueError, r"residual_out has shape \(2, 127\)"),
          ("out-is-residual_out", lambda c, ws: (lambda o: c.all_reduce_rmsnorm(
              f32(2, 128), f32(128), out=o, residual_out=o))(f32(2, 128)),
           ValueError, r"out and residual_out are the same memory"),
          ("algo", lambda c, ws: c.all_reduce_rmsnorm(f32(2, 128), f32(128), algo="two_shot"),
           ValueError, r"algo='two_shot'; expected one of auto, one_shot, lamport"),
      ]],
    *[(f"fp8-{name}", call, exc, r"llcomm\.all_reduce_residual_rmsnorm_fp8: " + pattern)
      for name, call, exc, pattern in [
          ("scale-float64", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
              f32(2, 128), f32(2, 128), f32(128), scale=torch.tensor(1.0, dtype=torch.float64)),
           TypeError, r"scale has dtype float64; expected one of float32"),
          ("scale-two-elements", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
              f32(2, 128), f32(2, 128), f32(128), scale=f32(2)),
           ValueError, r"scale has shape \(2,\); expected one element"),
          ("scale-2d", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
              f32(2, 128), f32(2, 128), f32(128), scale=f32(1, 1)),
           ValueError, r"scale has shape \(1, 1\); expected one element"),
          ("scale-float", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
              f32(2, 128), f32(2, 128), f32(128), scale=0.5),
           TypeError, r"scale must be a torch\.Tensor, got float"),
          ("scale-meta", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
              f32(2, 128), f32(2, 128), f32(128), scale=torch.ones((), device="meta")),
           ValueError, r"scale is on meta; expected cpu"),
          ("out-float32", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
              f32(2, 128), f32(2, 128), f32(128), scale=f32(1), out=f32(2, 128)),
           TypeError, r"out has dtype torch\.float32; expected torch\.float8_e4m3fn"),
          ("out-shape", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
              f32(2, 128), f32(2, 128), f32(128), scale=f32(1),
              out=torch.empty(2, 64, dtype=torch.float8_e4m3fn)),
           ValueError, r"out has shape \(2, 64\); expected \(2, 128\)"),
          ("residual-dtype", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
              f32(2, 128), torch.ones(2, 128, dtype=torch.bfloat16), f32(128), scale=f32(1)),
           TypeError, r"residual has dtype torch\.bfloat16; expected torch\.float32"),
      ]],
    *[(f"fp8-group-{name}", call, exc,
       r"llcomm\.all_reduce_residual_rmsnorm_fp8_per_group: " + pattern)
      for name, call, exc, pattern in [
          ("hidden-not-a-multiple", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8_per_group(
              f32(2, 8), f32(2, 8), f32(8)),
           ValueError, r"x has hidden=8; the per-group FP8 output needs a multiple of 128"),
          ("scales_out-shape", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8_per_group(
              f32(2, 128), f32(2, 128), f32(128), scales_out=f32(2, 2)),
           ValueError, r"scales_out has shape \(2, 2\); expected \(2, 1\)"),
          ("scales_out-dtype", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8_per_group(
              f32(2, 128), f32(2, 128), f32(128),
              scales_out=torch.ones(2, 1, dtype=torch.bfloat16)),
           TypeError, r"scales_out has dtype torch\.bfloat16; expected torch\.float32"),
          ("round_scale-int", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8_per_group(
              f32(2, 128), f32(2, 128), f32(128), round_scale=1),
           TypeError, r"round_scale=1; expected True or False"),
          ("scales_out-in-out", lambda c, ws: (
              lambda o: c.all_reduce_residual_rmsnorm_fp8_per_group(
                  f32(2, 128), f32(2, 128), f32(128), out=o,
                  scales_out=o.view(torch.uint8).view(-1)[:8].view(torch.float32).view(2, 1)))(
              torch.empty(2, 128, dtype=torch.float8_e4m3fn)),
           ValueError, r"out and scales_out are the same memory"),
          ("several", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8_per_group(
              f32(2, 128), f32(3, 128), f32(128), eps=float("inf"), algo="ring",
              scales_out=f32(2)),
           ValueError, r"residual has shape .*scales_out has shape .*eps=inf.*algo='ring'"),
      ]],
    # every problem of one call is reported at once
    ("all_reduce-three-problems",
     lambda c, ws: c.all_reduce(torch.ones(4, 8, dtype=torch.int32)[:, ::2], algo="ring"),
     TypeError, r"x has dtype int32.*x is not contiguous.*algo='ring'"),
]
#: Only meaningful where world_size > 1 (any dim 0 is a multiple of 1).
CASES_MULTI_RANK = [
    ("reduce_scatter-indivisible", lambda c, ws: c.reduce_scatter(f32(3 * ws + 1)),
     ValueError, r"llcomm\.reduce_scatter: x has shape \(\d+,\); dim 0 must be a multiple of "
                 r"world_size=\d+"),
    ("reduce_scatter-indivisible-2d", lambda c, ws: c.reduce_scatter(f32(ws + 1, 4)),
     ValueError, r"llcomm\.reduce_scatter: .*dim 0 must be a multiple of world_size"),
]
#: Inputs over max_bytes, on a communicator with max_bytes=SMALL_MAX_BYTES (257 fp32 = 1028 B).
CASES_MAX_BYTES = [
    (f"{op}-over-max_bytes", call, ValueError,
     rf"llcomm\.{op}: x holds \d+ bytes, more than max_bytes={SMALL_MAX_BYTES}")
    for op, call in [
        ("all_reduce", lambda c, ws: c.all_reduce(f32(257))),
        ("broadcast", lambda c, ws: c.broadcast(f32(257), 0)),
        ("all_gather", lambda c, ws: c.all_gather(f32(257))),
        ("all_gather_2d", lambda c, ws: c.all_gather_2d(f32(1, 257))),
        ("reduce_scatter", lambda c, ws: c.reduce_scatter(f32(ws, 257))),
        ("all_reduce_residual_rmsnorm",
         lambda c, ws: c.all_reduce_residual_rmsnorm(f32(1, 257), f32(1, 257), f32(257))),
        ("all_reduce_rmsnorm", lambda c, ws: c.all_reduce_rmsnorm(f32(1, 257), f32(257))),
        ("all_reduce_residual_rmsnorm_fp8", lambda c, ws: c.all_reduce_residual_rmsnorm_fp8(
            f32(1, 257), f32(1, 257), f32(257), scale=f32(1))),
        ("all_reduce_residual_rmsnorm_fp8_per_group",
         lambda c, ws: c.all_reduce_residual_rmsnorm_fp8_per_group(
             f32(3, 128), f32(3, 128), f32(128))),
    ]
]


def _ids(cases):
    return [c[0] for c in cases]


def expect_rejected(comm, ws, case) -> None:
    """Run one case; it must raise exactly ``exc`` with a message matching ``pattern``."""
    name, call, exc, pattern = case
    try:
        call(comm, ws)
    except Exception as e:
        if type(e) is not exc:
            raise AssertionError(f"{name}: raised {type(e).__name__}({e}), expected "
                                 f"{exc.__name__}") from e
        if not re.search(pattern, str(e)):
            raise AssertionError(f"{name}: message {str(e)!r} does not match {pattern!r}") from e
        return
    raise AssertionError(f"{name}: was not rejected (expected {exc.__name__})")


def assert_all_reduce_works(comm, rank, ws, tag: str) -> None:
    """A valid all_reduce right after: exact on small integers, so any error shows."""
    x = torch.arange(64, dtype=torch.float32) * (rank + 1)
    out = torch.full((64,), float("nan"))
    comm.all_reduce(x, out=out)
    want = torch.arange(64, dtype=torch.float32) * (ws * (ws + 1) // 2)
    assert torch.equal(out, want), f"all_reduce after {tag} is wrong: {out[:4]} vs {want[:4]}"


# -- one rank, in this process ---------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_rejected_one_rank(world1, case):
    comm = llcomm.Communicator(backend="reference")
    expect_rejected(comm, 1, case)
    assert_all_reduce_works(comm, 0, 1, case[0])


#: Shapes and dtypes of the all_reduce cases above: ran once first, each makes its (shape,
#: dtype, algo) hot in Communicator.all_reduce, which then checks only the tensors themselves.
HOT_SHAPES = [(8,), (9,), (16,), (4, 4), (4, 8), (2, 4), (4,)]
#: The same for all_reduce_residual_rmsnorm: x [2, 8] float32 with each weight dtype.
HOT_FUSED_WEIGHTS = (torch.float32, torch.float16, torch.bfloat16)


def warm_hot_path(comm) -> None:
    for shape in HOT_SHAPES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for algo in ("auto", "one_shot", "two_shot", "lamport"):
                comm.all_reduce(torch.ones(shape, dtype=dtype), algo=algo)
                comm.all_reduce(torch.ones(shape, dtype=dtype), out=torch.empty(
                    shape, dtype=dtype), algo=algo)
    assert len(comm._hot_ar) == len(HOT_SHAPES) * 3 * 4
    x, res = torch.randn(2, 8), torch.randn(2, 8)
    for wdtype in HOT_FUSED_WEIGHTS:
        w = torch.rand(8).to(wdtype)
        for algo in ("auto", "one_shot", "lamport"):
            first = comm.all_reduce_residual_rmsnorm(x, res, w, 1e-6, algo=algo)   # full checks
            again = comm.all_reduce_residual_rmsnorm(                              # hot path
                x, res, w, 1e-6, out=torch.empty(2, 8), residual_out=torch.empty(2, 8), algo=algo)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len(comm._hot_fused) == len(HOT_FUSED_WEIGHTS) * 3
    # the other joins, x [2, 128] float32 (the shape of their rejected cases)
    x, res, w = torch.randn(2, 128), torch.randn(2, 128), torch.rand(128)
    for algo in ("auto", "one_shot", "lamport"):
        for _ in range(2):          # full checks, then the hot path
            comm.all_reduce_rmsnorm(x, w, algo=algo)
            comm.all_reduce_residual_rmsnorm_fp8(x, res, w, scale=torch.ones(()), algo=algo)
            comm.all_reduce_residual_rmsnorm_fp8_per_group(x, res, w, algo=algo)
    assert len(comm._hot_fused) == len(HOT_FUSED_WEIGHTS) * 3 + 3 * 3


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_rejected_after_the_same_shapes_ran(world1, case):
    """The hot paths must reject whatever the full checks reject: a meta, strided or
    transposed tensor of a shape and dtype that already ran, an out of another shape, out and
    residual_out in the same memory."""
    comm = llcomm.Communicator(backend="reference")
    warm_hot_path(comm)
    expect_rejected(comm, 1, case)
    assert_all_reduce_works(comm, 0, 1, case[0])


def test_every_op_refuses_a_closed_communicator(world1):
    comm = llcomm.Communicator(backend="reference")
    x = torch.ones(4, 8)
    comm.all_reduce(x)                          # (4, 8) float32 "auto" is now hot
    comm.close()
    comm.close()                                # twice: a no-op
    calls = {
        "all_reduce": lambda: comm.all_reduce(x),
        "all_reduce_residual_rmsnorm": lambda: comm.all_reduce_residual_rmsnorm(
            x, x, torch.ones(8)),
        "broadcast": lambda: comm.broadcast(x, 0),
        "all_gather": lambda: comm.all_gather(x),
        "all_gather_2d": lambda: comm.all_gather_2d(x),
        "reduce_scatter": lambda: comm.reduce_scatter(x),
    }
    for name, call in calls.items():
        with pytest.raises(llcomm.CommClosedError, match=rf"llcomm\.{name}: this Communicator "
                           "was closed"):
            call()
    assert torch.equal(x, torch.ones(4, 8))


@pytest.mark.parametrize("case", CASES_MAX_BYTES, ids=_ids(CASES_MAX_BYTES))
def test_over_max_bytes_one_rank(world1, case):
    comm = llcomm.Communicator(backend="reference", max_bytes=SMALL_MAX_BYTES)
    expect_rejected(comm, 1, case)
    # exactly max_bytes is fine
    x = torch.full((SMALL_MAX_BYTES // 4,), 2.0)
    assert torch.equal(comm.all_reduce(x), x)


def test_rejected_call_touches_no_buffer(world1):
    comm = llcomm.Communicator(backend="reference")
    x = torch.arange(8, dtype=torch.float32)
    out = torch.full((8,), float("nan"))
    for bad in (dict(algo="ring"), dict(out=out[:4])):
        with pytest.raises(ValueError):
            comm.all_reduce(x, out=bad.get("out", out), algo=bad.get("algo", "auto"))
        assert torch.equal(x, torch.arange(8, dtype=torch.float32))
        assert torch.isnan(out).all()
    res, w = torch.full((2, 4), 3.0), torch.ones(4)
    y, h = torch.full((2, 4), float("nan")), torch.full((2, 4), float("nan"))
    for bad in (dict(eps=0.0), dict(weight=torch.ones(5)), dict(algo="ring")):
        with pytest.raises(ValueError):
            comm.all_reduce_residual_rmsnorm(x.view(2, 4), res, bad.get("weight", w),
                                             bad.get("eps", 1e-6), out=y, residual_out=h,
                                             algo=bad.get("algo", "auto"))
        assert torch.equal(x, torch.arange(8, dtype=torch.float32))
        assert torch.equal(res, torch.full((2, 4), 3.0))
        assert torch.isnan(y).all() and torch.isnan(h).all()
    big = torch.full((5,), 7.0)
    with pytest.raises(ValueError):
        comm.broadcast(big, src=1)
    assert torch.equal(big, torch.full((5,), 7.0))


@pytest.mark.parametrize("name", ["x", "residual", "weight", "scale", "topk_idx",
                                  "topk_weights", "expert_out"])
def test_strided_hint_names_the_argument(name):
    """The hint for a strided input names that input (``pass topk_idx.contiguous()``, never
    another argument's name); for a tensor the op writes into (``written``) it asks for a
    contiguous tensor instead, since a copy would not be the one the caller holds."""
    from llcomm.runtime import validate as V
    strided = torch.randn(4, 6)[:, ::2]
    pr = V.Problems("op")
    assert not V.check_tensor(pr, name, strided, strided.device, dtypes=None)
    assert pr.items == [f"{name} is not contiguous; pass {name}.contiguous()"]
    pr = V.Problems("op")
    assert not V.check_tensor(pr, name, strided, strided.device, dtypes=None, written=True)
    assert len(pr.items) == 1 and pr.items[0].startswith(
        f"{name} is not contiguous; the result is written into it, so pass a contiguous tensor")
    pr = V.Problems("op")
    assert V.check_tensor(pr, name, strided.contiguous(), strided.device, dtypes=None)
    assert pr.items == []


def test_movement_accepts_every_dtype(world1):
    """broadcast, all_gather and all_gather_2d take every dtype of MOVE_DTYPES (int64 token ids
    among them) and return it unchanged in one rank's world; max_bytes counts bytes."""
    from _payloads import MOVE_DTYPES, payload, same_bytes
    comm = llcomm.Communicator(backend="reference", max_bytes=128)
    ids = torch.tensor([17, -1, 2 ** 40 + 3], dtype=torch.int64)   # sampled token ids
    assert comm.broadcast(ids, 0) is ids
    assert torch.equal(ids, torch.tensor([17, -1, 2 ** 40 + 3]))
    for dtype in MOVE_DTYPES:
        x = payload(dtype, (2, 3), ("accepts", str(dtype)))
        x0 = x.clone()
        assert comm.broadcast(x, src=0) is x and same_bytes(x, x0), dtype
        assert same_bytes(comm.all_gather(x), x0) and same_bytes(comm.all_gather_2d(x), x0), dtype
    with pytest.raises(ValueError, match=r"llcomm\.broadcast: x holds 136 bytes, more than "
                                         r"max_bytes=128"):
        comm.broadcast(torch.zeros(17, dtype=torch.int64), 0)
    assert comm.broadcast(torch.zeros(128, dtype=torch.bool), 0).dtype == torch.bool


# -- constructor -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["nccl", "gloo", "", None, "Reference"])
def test_unknown_backend(world1, backend):
    with pytest.raises(ValueError, match=r"llcomm\.Communicator: backend=.*expected one of auto, "
                                         r"peer, reference"):
        llcomm.Communicator(backend=backend)


@pytest.mark.parametrize("max_bytes", [0, -1, 1.5, "1024", None])
def test_bad_max_bytes(world1, max_bytes):
    with pytest.raises(ValueError,
                       match=r"llcomm\.Communicator: max_bytes=.*expected a positive int"):
        llcomm.Communicator(backend="reference", max_bytes=max_bytes)


def test_bool_max_bytes_rejected(world1):
    with pytest.raises(ValueError, match="max_bytes="):
        llcomm.Communicator(backend="reference", max_bytes=True)


def test_bad_backend_and_max_bytes_reported_together(world1):
    with pytest.raises(ValueError, match=r"backend='x'.*max_bytes=0"):
        llcomm.Communicator(backend="x", max_bytes=0)


@pytest.mark.parametrize("timeout_ms", [0, -5, 2.5, "100", True])
def test_bad_timeout_ms(world1, monkeypatch, timeout_ms):
    monkeypatch.delenv("LLCOMM_TIMEOUT_MS", raising=False)
    with pytest.raises(ValueError, match=r"timeout_ms=.*positive integer of milliseconds"):
        llcomm.Communicator(backend="reference", timeout_ms=timeout_ms)


@pytest.mark.parametrize("raw", ["soon", "", "0", "-1", "2.5"])
def test_bad_timeout_env(world1, monkeypatch, raw):
    monkeypatch.setenv("LLCOMM_TIMEOUT_MS", raw)
    with pytest.raises(ValueError, match=r"LLCOMM_TIMEOUT_MS=.*positive integer of milliseconds"):
        llcomm.Communicator(backend="reference")


def test_timeout_precedence(world1, monkeypatch):
    monkeypatch.delenv("LLCOMM_TIMEOUT_MS", raising=False)
    # the reference backend's host-side waits default to a bound for OS-scheduled processes
    assert llcomm.Communicator(backend="reference").timeout_ms == P.REFERENCE_DEFAULT_TIMEOUT_MS
    monkeypatch.setenv("LLCOMM_TIMEOUT_MS", "300")
    assert llcomm.Communicator(backend="reference").timeout_ms == 300
    assert llcomm.Communicator(backend="reference", timeout_ms=20).timeout_ms == 20


@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_bad_check_calls(world1, value):
    from llcomm.ep import EPBuffer
    with pytest.raises(TypeError, match=rf"llcomm\.Communicator: check_calls={value!r}; "
                                        "expected True, False or None"):
        llcomm.Communicator(backend="reference", check_calls=value)
    with pytest.raises(TypeError, match=rf"llcomm\.EPBuffer: check_calls={value!r}"):
        EPBuffer(num_experts=4, hidden=16, num_max_dispatch_tokens_per_rank=2,
                 backend="reference", check_calls=value)


def test_check_calls_default_is_on_over_gloo(world1):
    from llcomm.ep import EPBuffer
    ep_args = dict(num_experts=4, hidden=16, num_max_dispatch_tokens_per_rank=2,
                   backend="reference")
    assert llcomm.Communicator(backend="reference").check_calls is True
    assert EPBuffer(**ep_args).check_calls is True
    off = llcomm.Communicator(backend="reference", check_calls=False)
    assert off.check_calls is False and EPBuffer(**ep_args, check_calls=False).check_calls is False
    assert torch.equal(off.all_reduce(f32(3)), f32(3))      # a call without the check


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only host needed")
def test_peer_backend_refused_without_cuda(world1):
    with pytest.raises(llcomm.UnsupportedConfigError,
                       match=r"backend='peer'.*no CUDA device.*backend='reference'"):
        llcomm.Communicator(backend="peer")


def test_not_initialised():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        llcomm.Communicator(backend="reference")


# -- two ranks, spawned ------------------------------------------------------------------------
def _two_ranks(rank, ws):
    comm = llcomm.Communicator(backend="reference")
    small = llcomm.Communicator(backend="reference", max_bytes=SMALL_MAX_BYTES)
    failures = []
    ids = torch.tensor([5, 7 + rank], dtype=torch.int64)   # rank 0's sampled ids, every rank
    assert comm.broadcast(ids, 0) is ids and ids.tolist() == [5, 7]
    for c, cases in ((comm, CASES + CASES_MULTI_RANK), (small, CASES_MAX_BYTES)):
        for case in cases:
            try:
                expect_rejected(c, ws, case)
            except AssertionError as e:
                failures.append(str(e))
            # every rank ran the same calls: the next collective lines up and must be right
            assert_all_reduce_works(comm, rank, ws, case[0])
            assert_all_reduce_works(small, rank, ws, case[0])
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_rejected_two_ranks_and_communicator_still_works():
    run_distributed(_two_ranks, 2)
