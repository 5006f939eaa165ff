"""Argument checks shared by every backend. Problems are collected and raised once, as one
ValueError/TypeError naming each argument and what was expected, before any buffer is touched."""
from __future__ import annotations

import torch

from ..errors import CommClosedError
from . import protocol as P

#: Dtypes of the reductions (all_reduce, reduce_scatter, all_reduce_residual_rmsnorm): they sum.
REDUCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Dtypes of the movement ops (broadcast, all_gather, all_gather_2d): they copy bytes, so any
#: dense dtype with a code in ``protocol.DTYPE_CODES`` (its name there is ``str(dtype)``
#: without ``torch.``). Quantized and sub-byte dtypes are not among them.
MOVE_DTYPES = tuple(getattr(torch, name) for name in P.DTYPE_CODES)
#: Why a reduction refuses a dtype (the end of its message).
REDUCE_ONLY = ("a reduction sums, so it needs a float type; broadcast, all_gather and "
               "all_gather_2d copy bytes and take any dtype")
#: Why a movement op refuses a dtype.
MOVE_ONLY = "the movement ops copy the bytes of any plain dtype; not quantized or sub-byte ones"


class Problems:
    """Collects problems of one call; ``raise_if_any`` raises them together."""

    def __init__(self, fn: str):
        self.fn = fn
        self.items: list[str] = []
        self.type_error = False

    def add(self, msg: str, *, type_error: bool = False) -> None:
        self.items.append(msg)
        self.type_error |= type_error

    def raise_if_any(self) -> None:
        if not self.items:
            return
        text = f"llcomm.{self.fn}: " + "; ".join(self.items)
        raise (TypeError if self.type_error else ValueError)(text)


#: Why an object on a gloo group takes CPU tensors, and what to pass instead.
CPU_GROUP_HINT = (
    ": it runs on the reference backend over a group that carries CPU tensors only (gloo, as "
    "an engine's CPU group is), so its tensors live on the CPU; for GPU tensors create it with "
    "a group argument whose backend carries them: an NCCL group, or a mixed one such as "
    "torch.distributed.new_group(ranks, backend=\"cpu:gloo,cuda:nccl\") (the peer backend, "
    "where every rank has its own GPU on one host, runs over either)")


def check_tensor(pr: Problems, name: str, t, device: torch.device, *, dtypes=REDUCE_DTYPES,
                 max_bytes: int | None = None, why: str | None = None,
                 written: bool = False) -> bool:
    """Check that ``t`` is a contiguous tensor of one of ``dtypes`` (None: any) on ``device``.
    ``why`` follows the list of dtypes in the message of a dtype that is not among them.
    ``name`` is the argument as the caller wrote it; ``written``: the op writes into ``t`` (an
    ``out=``), so the hint for a strided one is a contiguous tensor, not a copy of it."""
    if not isinstance(t, torch.Tensor):
        pr.add(f"{name} must be a torch.Tensor, got {type(t).__name__}", type_error=True)
        return False
    ok = True
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        pr.add(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; expected one of {names}"
               + (f" ({why})" if why else ""), type_error=True)
        ok = False
    if t.device != device:
        pr.add(f"{name} is on {t.device}; expected {device} (this communicator's device)"
               + (CPU_GROUP_HINT if device.type == "cpu" and t.device.type != "cpu" else ""))
        ok = False
    if not t.is_contiguous():
        pr.add(f"{name} is not contiguous; " + (
            "the result is written into it, so pass a contiguous tensor (a copy made by "
            ".contiguous() would not be the one you hold)" if written else
            f"pass {name}.contiguous()"))
        ok = False
    if max_bytes is not None and t.numel() * t.element_size() > max_bytes:
        pr.add(f"{name} holds {t.numel() * t.element_size()} bytes, more than max_bytes="
               f"{max_bytes} the communicator was created with: this would overrun the "
               "workspace; create the Communicator with a larger max_bytes")
        ok = False
    return ok


def check_out(pr: Problems, out, x: torch.Tensor, shape: tuple, device: torch.device, *,
              name: str = "out") -> None:
    """``out`` (when given) must match the expected shape, x's dtype, and be contiguous.
    ``name`` is the argument's name in messages."""
    if out is None:
        return
    if not check_tensor(pr, name, out, device, dtypes=None, written=True):
        return
    if tuple(out.shape) != tuple(shape):
        pr.add(f"{name} has shape {tuple(out.shape)}; expected {tuple(shape)}")
    if out.dtype != x.dtype:
        pr.add(f"{name} has dtype {out.dtype}; expected {x.dtype} (the dtype of x)",
               type_error=True)


def check_open(closed: bool, fn: str, what: str) -> None:
    """Raise CommClosedError for a call of ``fn`` on ``what`` (its class name) after its
    ``close()``: a kernel launched on a released workspace would write into memory that is no
    longer mapped."""
    if closed:
        raise CommClosedError(f"llcomm.{fn}: this {what} was closed; create a new one")


def check_optional_bool(pr: Problems, name: str, value) -> None:
    """``value`` is True, False or None (an argument whose None means "the default")."""
    if value is not None and not isinstance(value, bool):
        pr.add(f"{name}={value!r}; expected True, False or None", type_error=True)
