"""llcomm's ops as ``torch.library`` custom ops, for ``torch.compile(fullgraph=True)``.

    import llcomm.ops as ops

    comm = llcomm.Communicator(group)                    # once; gets comm.op_handle
    y = ops.all_reduce(comm, x)                          # = comm.all_reduce(x), traceable
    recv_x, recv_count, ticket = ops.ep_dispatch(buf, x, topk_idx)
    out = ops.ep_combine(buf, expert_out, topk_idx, topk_weights, ticket)

A ``Communicator`` or ``EPBuffer`` cannot be an op argument, so each one registers itself at
construction under a small int, ``op_handle``, valid in this process only; the ops take that int
and look the object up. The functions below take the object and pass its handle, so they are what
compiled code should call; ``torch.ops.llcomm.<name>(handle, ...)`` is the same thing, raw.

| op | schema (``torch.ops.llcomm``) | method it runs |
|---|---|---|
| ``all_reduce`` | ``(int comm, Tensor x, str algo) -> Tensor`` | ``Communicator.all_reduce`` |
| ``broadcast_`` | ``(int comm, Tensor(a!) x, int src) -> ()`` | ``Communicator.broadcast`` (in place) |
| ``all_gather`` | ``(int comm, Tensor x) -> Tensor`` | ``Communicator.all_gather`` |
| ``all_gather_2d`` | ``(int comm, Tensor x) -> Tensor`` | ``Communicator.all_gather_2d`` |
| ``reduce_scatter`` | ``(int comm, Tensor x) -> Tensor`` | ``Communicator.reduce_scatter`` |
| ``all_reduce_residual_rmsnorm`` | ``(int comm, Tensor x, Tensor residual, Tensor weight, float eps, str algo) -> (Tensor, Tensor)`` | ``Communicator.all_reduce_residual_rmsnorm`` |
| ``all_reduce_rmsnorm`` | ``(int comm, Tensor x, Tensor weight, float eps, str algo) -> (Tensor, Tensor)`` | ``Communicator.all_reduce_rmsnorm`` |
| ``all_reduce_residual_rmsnorm_fp8`` | ``(int comm, Tensor x, Tensor residual, Tensor weight, float eps, Tensor scale, str algo) -> (Tensor, Tensor)`` | ``Communicator.all_reduce_residual_rmsnorm_fp8`` |
| ``all_reduce_residual_rmsnorm_fp8_per_group`` | ``(int comm, Tensor x, Tensor residual, Tensor weight, float eps, bool round_scale, str algo) -> (Tensor, Tensor, Tensor)`` | ``Communicator.all_reduce_residual_rmsnorm_fp8_per_group`` |
| ``ep_dispatch`` | ``(int buf, Tensor x, Tensor topk_idx) -> (Tensor, Tensor, Tensor)`` | ``EPBuffer.dispatch`` |
| ``ep_dispatch_fp8`` | ``(int buf, Tensor x, Tensor topk_idx, bool round_scale) -> (Tensor, Tensor, Tensor, Tensor)`` | ``EPBuffer.dispatch(use_fp8=True)`` |
| ``ep_combine`` | ``(int buf, Tensor y, Tensor topk_idx, Tensor w, Tensor ticket) -> Tensor`` | ``EPBuffer.combine`` |
| ``ep_src_info`` | ``(int buf, Tensor ticket) -> Tensor`` | ``EPHandle.src_info`` (a copy) |

EP under compile: ``EPBuffer.dispatch`` returns an ``EPHandle``, a Python object a graph cannot
carry. ``ep_dispatch`` keeps the handle here and returns a **ticket** in its place: a 0-d int64
CPU tensor holding the dispatch's index. ``ep_combine`` looks the handle up by the ticket (a host
read of a CPU tensor: no device synchronisation). The ticket also makes combine depend on its
dispatch in the graph, so the compiler cannot reorder them. A ticket lives as long as its handle
(two dispatches of the same buffer); an older one is refused with ValueError.

Outputs are fresh tensors (custom ops may not return views of their inputs or of each other), so
``ep_dispatch`` copies ``recv_count`` out of the handle slot (``[num_local_experts]`` int32) and
``out=`` arguments are not offered: the fused norms return a new ``residual_out`` rather than
updating ``residual`` in place. The ops have no autograd formula: call them on tensors that
do not require grad (inference). Fake (meta) implementations give every output's shape, dtype and
device, so the ops trace with dynamic shapes too. Validation and errors are the methods' own.

FP8: ``ep_dispatch(buf, x, topk_idx, use_fp8=True)`` calls ``ep_dispatch_fp8`` and returns
``((recv_x_fp8, recv_scales), recv_count, ticket)`` like the method. ``return_recv_hook`` is not
offered: a hook is a Python callable, which cannot cross a custom op's boundary (see
``ep_dispatch``).
"""  # noqa: E501  (the op table above: a markdown row is one line)
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .runtime.fp8_format import FP8_BLOCK, FP8_DTYPE, SCALE_DTYPE
from .runtime.registry import handle_of as _handle_of, lookup as _lookup, register

if TYPE_CHECKING:
    from .ep import EPBuffer
    from .tp import Communicator

#: Dispatch handles kept per EPBuffer for ``ep_combine``; the buffer itself refuses a handle
#: older than its slots (two, four with ``sends_in_flight=2``), so one more than the most is
#: enough to give its message.
KEPT_HANDLES = 5
_ep_handles: dict[int, dict[int, object]] = {}      # buffer handle -> {dispatch index: EPHandle}


# -- TP ops -------------------------------------------------------------------------------------
@torch.library.custom_op("llcomm::all_reduce", mutates_args=())
def _all_reduce(comm: int, x: torch.Tensor, algo: str) -> torch.Tensor:
    return _lookup(comm, "all_reduce").all_reduce(x, algo=algo)


@_all_reduce.register_fake
def _(comm, x, algo):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("llcomm::broadcast_", mutates_args=("x",))
def _broadcast_(comm: int, x: torch.Tensor, src: int) -> None:
    _lookup(comm, "broadcast").broadcast(x, src)


@_broadcast_.register_fake
def _(comm, x, src):
    return None


@torch.library.custom_op("llcomm::all_gather", mutates_args=())
def _all_gather(comm: int, x: torch.Tensor) -> torch.Tensor:
    return _lookup(comm, "all_gather").all_gather(x)


@_all_gather.register_fake
def _(comm, x):
    ws = _lookup(comm, "all_gather").world_size
    shape = (ws * x.shape[0], *x.shape[1:]) if x.dim() else (ws,)
    return x.new_empty(shape)


@torch.library.custom_op("llcomm::all_gather_2d", mutates_args=())
def _all_gather_2d(comm: int, x: torch.Tensor) -> torch.Tensor:
    return _lookup(comm, "all_gather_2d").all_gather_2d(x)


@_all_gather_2d.register_fake
def _(comm, x):
    ws = _lookup(comm, "all_gather_2d").world_size
    torch._check(x.dim() == 2, lambda: "llcomm.ops.all_gather_2d: x must be 2-D [tokens, part]")
    return x.new_empty((x.shape[0], ws * x.shape[1]))


@torch.library.custom_op("llcomm::reduce_scatter", mutates_args=())
def _reduce_scatter(comm: int, x: torch.Tensor) -> torch.Tensor:
    return _lookup(comm, "reduce_scatter").reduce_scatter(x)


@_reduce_scatter.register_fake
def _(comm, x):
    ws = _lookup(comm, "reduce_scatter").world_size
    return x.new_empty((x.shape[0] // ws, *x.shape[1:]))


# the fused norms: every output new (the methods allocate them)
@torch.library.custom_op("llcomm::all_reduce_residual_rmsnorm", mutates_args=())
def _all_reduce_residual_rmsnorm(comm: int, x: torch.Tensor, residual: torch.Tensor,
                                 weight: torch.Tensor, eps: float, algo: str
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _lookup(comm, "all_reduce_residual_rmsnorm").all_reduce_residual_rmsnorm(
        x, residual, weight, eps, algo=algo)


def _rows_fake(x: torch.Tensor, fn: str) -> None:
    torch._check(x.dim() == 2, lambda: f"llcomm.ops.{fn}: x must be 2-D [tokens, hidden]")


@_all_reduce_residual_rmsnorm.register_fake
def _(comm, x, residual, weight, eps, algo):
    _rows_fake(x, "all_reduce_residual_rmsnorm")
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("llcomm::all_reduce_rmsnorm", mutates_args=())
def _all_reduce_rmsnorm(comm: int, x: torch.Tensor, weight: torch.Tensor, eps: float, algo: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return _lookup(comm, "all_reduce_rmsnorm").all_reduce_rmsnorm(x, weight, eps, algo=algo)


@_all_reduce_rmsnorm.register_fake
def _(comm, x, weight, eps, algo):
    _rows_fake(x, "all_reduce_rmsnorm")
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("llcomm::all_reduce_residual_rmsnorm_fp8", mutates_args=())
def _all_reduce_residual_rmsnorm_fp8(comm: int, x: torch.Tensor, residual: torch.Tensor,
                                     weight: torch.Tensor, eps: float, scale: torch.Tensor,
                                     algo: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _lookup(comm, "all_reduce_residual_rmsnorm_fp8").all_reduce_residual_rmsnorm_fp8(
        x, residual, weight, eps, scale=scale, algo=algo)


@_all_reduce_residual_rmsnorm_fp8.register_fake
def _(comm, x, residual, weight, eps, scale, algo):
    _rows_fake(x, "all_reduce_residual_rmsnorm_fp8")
    return torch.empty_like(x, dtype=FP8_DTYPE), torch.empty_like(x)


@torch.library.custom_op("llcomm::all_reduce_residual_rmsnorm_fp8_per_group", mutates_args=())
def _all_reduce_residual_rmsnorm_fp8_per_group(
        comm: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        round_scale: bool, algo: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _lookup(comm, "all_reduce_residual_rmsnorm_fp8_per_group")
    return c.all_reduce_residual_rmsnorm_fp8_per_group(x, residual, weight, eps,
                                                       round_scale=round_scale, algo=algo)


@_all_reduce_residual_rmsnorm_fp8_per_group.register_fake
def _(comm, x, residual, weight, eps, round_scale, algo):
    _rows_fake(x, "all_reduce_residual_rmsnorm_fp8_per_group")
    return (torch.empty_like(x, dtype=FP8_DTYPE),
            x.new_empty((x.shape[0], x.shape[1] // FP8_BLOCK), dtype=SCALE_DTYPE),
            torch.empty_like(x))


# -- EP ops -------------------------------------------------------------------------------------
@torch.library.custom_op("llcomm::ep_dispatch", mutates_args=())
def _ep_dispatch(buf: int, x: torch.Tensor, topk_idx: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recv_x, recv_count, handle = _lookup(buf, "ep_dispatch").dispatch(x, topk_idx)
    return recv_x, recv_count.clone(), _keep(buf, handle)


def _keep(buf: int, handle) -> torch.Tensor:
    """Keep ``handle`` for ep_combine / ep_src_info (the newest KEPT_HANDLES); its ticket."""
    kept = _ep_handles.setdefault(buf, {})
    kept[handle.index] = handle
    for old in [i for i in kept if i <= handle.index - KEPT_HANDLES]:
        del kept[old]
    return torch.tensor(handle.index, dtype=torch.int64, device="cpu")


@_ep_dispatch.register_fake
def _(buf, x, topk_idx):
    b = _lookup(buf, "ep_dispatch")
    recv_x = x.new_empty((b.num_local_experts, b.num_ranks * b.max_tokens, b.hidden),
                         dtype=b.dtype)
    recv_count = x.new_empty((b.num_local_experts,), dtype=torch.int32)
    return recv_x, recv_count, torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("llcomm::ep_dispatch_fp8", mutates_args=())
def _ep_dispatch_fp8(buf: int, x: torch.Tensor, topk_idx: torch.Tensor, round_scale: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    (recv_x, scales), recv_count, handle = _lookup(buf, "ep_dispatch").dispatch(
        x, topk_idx, use_fp8=True, round_scale=round_scale)
    return recv_x, scales, recv_count.clone(), _keep(buf, handle)


@_ep_dispatch_fp8.register_fake
def _(buf, x, topk_idx, round_scale):
    b = _lookup(buf, "ep_dispatch")
    shape = (b.num_local_experts, b.num_ranks * b.max_tokens, b.hidden)
    return (x.new_empty(shape, dtype=FP8_DTYPE),
            x.new_empty((*shape[:2], b.hidden // FP8_BLOCK), dtype=SCALE_DTYPE),
            x.new_empty((b.num_local_experts,), dtype=torch.int32),
            torch.empty((), dtype=torch.int64, device="cpu"))


def _ticket_handle(buf: int, ticket: torch.Tensor, fn: str):
    if not isinstance(ticket, torch.Tensor) or ticket.numel() != 1 or ticket.device.type != "cpu" \
            or ticket.dtype != torch.int64:
        raise TypeError(f"llcomm.ops.{fn}: ticket must be the 0-d int64 CPU tensor ep_dispatch "
                        "returned")
    index = int(ticket)
    handle = _ep_handles.get(buf, {}).get(index)
    if handle is None:
        raise ValueError(f"llcomm.ops.{fn}: ticket {index} names no recent ep_dispatch of this "
                         f"EPBuffer (op_handle={buf}); a ticket lives as long as its handle, two "
                         "dispatches: combine before dispatching again")
    return handle


@torch.library.custom_op("llcomm::ep_combine", mutates_args=())
def _ep_combine(buf: int, expert_out: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, ticket: torch.Tensor) -> torch.Tensor:
    b = _lookup(buf, "ep_combine")
    return b.combine(expert_out, topk_idx, topk_weights, _ticket_handle(buf, ticket, "ep_combine"))


@_ep_combine.register_fake
def _(buf, expert_out, topk_idx, topk_weights, ticket):
    b = _lookup(buf, "ep_combine")
    return expert_out.new_empty((topk_idx.shape[0], b.hidden), dtype=b.dtype)


@torch.library.custom_op("llcomm::ep_src_info", mutates_args=())
def _ep_src_info(buf: int, ticket: torch.Tensor) -> torch.Tensor:
    return _ticket_handle(buf, ticket, "ep_src_info").src_info.clone()


@_ep_src_info.register_fake
def _(buf, ticket):
    b = _lookup(buf, "ep_src_info")
    return torch.empty((b.num_local_experts, b.num_ranks * b.max_tokens), dtype=torch.int32,
                       device=b.device)


# -- the API compiled code calls ----------------------------------------------------------------
def all_reduce(comm: "Communicator", x: torch.Tensor, *, algo: str = "auto") -> torch.Tensor:
    """``comm.all_reduce(x, algo=algo)`` as a custom op: a new tensor, the sum over ranks.

    x: any shape, bf16 / fp16 / fp32 on ``comm.device``, at most ``comm.max_bytes``; not
    modified. Runs on the current stream; the result is bitwise the method's.
    """
    return torch.ops.llcomm.all_reduce(_handle_of(comm), x, algo)


def broadcast(comm: "Communicator", x: torch.Tensor, src: int) -> torch.Tensor:
    """``comm.broadcast(x, src)``: rank ``src``'s ``x`` into ``x`` on every rank, in place; any
    dtype, byte-exact.

    Declared as mutating ``x`` (``torch.ops.llcomm.broadcast_``), so compiled code sees the
    write. Returns ``x``.
    """
    torch.ops.llcomm.broadcast_(_handle_of(comm), x, src)
    return x


def all_gather(comm: "Communicator", x: torch.Tensor) -> torch.Tensor:
    """``comm.all_gather(x)``: x ``[d0, ...]`` -> new ``[world_size * d0, ...]``, rank order;
    any dtype, byte-exact."""
    return torch.ops.llcomm.all_gather(_handle_of(comm), x)


def all_gather_2d(comm: "Communicator", x: torch.Tensor) -> torch.Tensor:
    """``comm.all_gather_2d(x)``: x ``[tokens, part]`` -> new ``[tokens, world_size * part]``;
    any dtype, byte-exact."""
    return torch.ops.llcomm.all_gather_2d(_handle_of(comm), x)


def reduce_scatter(comm: "Communicator", x: torch.Tensor) -> torch.Tensor:
    """``comm.reduce_scatter(x)``: x ``[world_size * d0, ...]`` -> new ``[d0, ...]``."""
    return torch.ops.llcomm.reduce_scatter(_handle_of(comm), x)


def _scalar_args(fn: str, eps, round_scale=False) -> None:
    """The Python scalars of a fused-norm op, named when they are of the wrong type (the
    schema would refuse them with a message of its own)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"llcomm.ops.{fn}: eps={eps!r}; expected a positive finite float")
    if not isinstance(round_scale, bool):
        raise TypeError(f"llcomm.ops.{fn}: round_scale={round_scale!r}; expected True or False")


def all_reduce_residual_rmsnorm(comm: "Communicator", x: torch.Tensor, residual: torch.Tensor,
                                weight: torch.Tensor, eps: float = 1e-6, *,
                                algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``comm.all_reduce_residual_rmsnorm(x, residual, weight, eps, algo=algo)``: new
    ``(out, residual_out)``, bitwise the method's (``residual`` is not updated in place)."""
    _scalar_args("all_reduce_residual_rmsnorm", eps)
    return torch.ops.llcomm.all_reduce_residual_rmsnorm(_handle_of(comm), x, residual, weight,
                                                        float(eps), algo)


def all_reduce_rmsnorm(comm: "Communicator", x: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, *, algo: str = "auto"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``comm.all_reduce_rmsnorm(x, weight, eps, algo=algo)``: new ``(out, residual_out)``
    (``residual_out`` the all-reduced x: the first layer's residual stream)."""
    _scalar_args("all_reduce_rmsnorm", eps)
    return torch.ops.llcomm.all_reduce_rmsnorm(_handle_of(comm), x, weight, float(eps), algo)


def all_reduce_residual_rmsnorm_fp8(comm: "Communicator", x: torch.Tensor,
                                    residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float = 1e-6, *, scale: torch.Tensor,
                                    algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``comm.all_reduce_residual_rmsnorm_fp8(x, residual, weight, eps, scale=scale)``: new
    ``(out [tokens, hidden] float8_e4m3fn, residual_out)``. ``scale``: a one-element float32
    tensor on ``comm.device``, an input of the graph (its value is read on the device)."""
    _scalar_args("all_reduce_residual_rmsnorm_fp8", eps)
    return torch.ops.llcomm.all_reduce_residual_rmsnorm_fp8(_handle_of(comm), x, residual,
                                                            weight, float(eps), scale, algo)


def all_reduce_residual_rmsnorm_fp8_per_group(
        comm: "Communicator", x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        eps: float = 1e-6, *, round_scale: bool = False, algo: str = "auto"
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``comm.all_reduce_residual_rmsnorm_fp8_per_group(x, residual, weight, eps,
    round_scale=round_scale)``: new ``(out [tokens, hidden] float8_e4m3fn, scales [tokens,
    hidden // 128] float32, residual_out)``. ``round_scale`` is a Python bool, fixed when the
    graph is traced."""
    _scalar_args("all_reduce_residual_rmsnorm_fp8_per_group", eps, round_scale)
    return torch.ops.llcomm.all_reduce_residual_rmsnorm_fp8_per_group(
        _handle_of(comm), x, residual, weight, float(eps), round_scale, algo)


def ep_dispatch(buf: "EPBuffer", x: torch.Tensor, topk_idx: torch.Tensor, *,
                use_fp8: bool = False, round_scale: bool = False):
    """``buf.dispatch(x, topk_idx, use_fp8=use_fp8, round_scale=round_scale)`` with a ticket in
    place of the handle.

    Args:
        buf: an ``EPBuffer``.
        x: ``[num_tokens, hidden]`` in the buffer's dtype, on its device.
        topk_idx: ``[num_tokens, topk]`` int64 global expert ids, -1 for none.
        use_fp8: FP8 dispatch, as ``EPBuffer.dispatch`` (``hidden`` a multiple of 128; the
            format is docs/ep.md's). A Python bool, fixed when the graph is traced: True runs
            the op ``ep_dispatch_fp8``, False ``ep_dispatch``.
        round_scale: with ``use_fp8``, power-of-two scales (a Python bool, as ``use_fp8``).
    Returns:
        recv_x: ``[num_local_experts, num_ranks * max_tokens, hidden]``, as ``dispatch``; with
            ``use_fp8`` the pair ``(recv_x_fp8, recv_scales)``: float8_e4m3fn of that shape and
            float32 ``[num_local_experts, num_ranks * max_tokens, hidden // 128]``.
        recv_count: ``[num_local_experts]`` int32 (a copy, on the buffer's device).
        ticket: 0-d int64 CPU tensor for ``ep_combine`` / ``ep_src_info``; valid for two
            dispatches of ``buf``, like the handle it stands for.

    No ``return_recv_hook``: the hook is a Python callable, which no custom op can return or
    take, and a graph could not call it between two ops anyway. Split-phase overlap under
    ``torch.compile`` would need the send and receive halves as two ops linked by a ticket;
    until then, use the method (eagerly, or in a CUDA graph captured around it).
    """
    for name, v in (("use_fp8", use_fp8), ("round_scale", round_scale)):
        if not isinstance(v, bool):
            raise TypeError(f"llcomm.ops.ep_dispatch: {name}={v!r}; expected True or False")
    if round_scale and not use_fp8:
        raise ValueError("llcomm.ops.ep_dispatch: round_scale=True needs use_fp8=True (it "
                         "rounds the FP8 scales)")
    if not use_fp8:
        return torch.ops.llcomm.ep_dispatch(_handle_of(buf), x, topk_idx)
    recv_x, scales, recv_count, ticket = torch.ops.llcomm.ep_dispatch_fp8(
        _handle_of(buf), x, topk_idx, round_scale)
    return (recv_x, scales), recv_count, ticket


def ep_combine(buf: "EPBuffer", expert_out: torch.Tensor, topk_idx: torch.Tensor,
               topk_weights: torch.Tensor, ticket: torch.Tensor) -> torch.Tensor:
    """``buf.combine(expert_out, topk_idx, topk_weights, handle)`` for the ticket's dispatch.

    expert_out ``[num_local_experts, num_ranks * max_tokens, hidden]``, topk_idx and
    topk_weights ``[num_tokens, topk]`` (int64, float32) as given to the dispatch. Returns a new
    ``[num_tokens, hidden]`` tensor, bitwise the method's result.
    """
    return torch.ops.llcomm.ep_combine(_handle_of(buf), expert_out, topk_idx, topk_weights,
                                       ticket)


def ep_src_info(buf: "EPBuffer", ticket: torch.Tensor) -> torch.Tensor:
    """A copy of the ticket's ``EPHandle.src_info``: ``[num_local_experts, num_ranks *
    max_tokens]`` int32, ``source_rank * max_tokens + source_token`` per filled row."""
    return torch.ops.llcomm.ep_src_info(_handle_of(buf), ticket)


__all__ = ["register", "all_reduce", "broadcast", "all_gather", "all_gather_2d",
           "reduce_scatter", "all_reduce_residual_rmsnorm", "all_reduce_rmsnorm",
           "all_reduce_residual_rmsnorm_fp8", "all_reduce_residual_rmsnorm_fp8_per_group",
           "ep_dispatch", "ep_combine", "ep_src_info"]
