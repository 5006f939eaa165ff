"""``Communicator``: the tensor-parallel joins of a decode step.

    comm = llcomm.Communicator(group, max_bytes=8 << 20)   # once, at start-up (a collective)
    y = comm.all_reduce(x)                                  # every layer, any stream, graphable

Backends: ``"peer"`` (Triton kernels over a symmetric NVLink workspace, one host),
``"reference"`` (torch.distributed: NCCL or gloo), ``"auto"`` (peer where every rank has its own
GPU and peer access works both ways, reference otherwise, with the reason logged).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..runtime import validate as V
from . import algo_table
from ..runtime import protocol as P
from ..runtime import settings as S
from ..runtime.backend import choose_backend, reference_device
from ..runtime.registry import register
from ..runtime.bounded import default_check_calls
from .fused import FusedJoins
from .reference import ReferenceBackend

log = logging.getLogger("llcomm")

#: Default workspace bound: the largest input, in bytes, of any op (16 MiB).
DEFAULT_MAX_BYTES = 16 << 20
BACKENDS = ("auto", "peer", "reference")
ALGOS = ("auto", "one_shot", "two_shot", "lamport")
#: all_reduce calls remembered for the hot path (one per shape, dtype and algo seen; past this
#: many the memory starts over, so an endless variety of shapes cannot grow it without bound).
HOT_CACHE_MAX = 4096

#: all_reduce(algo="auto") where no measured table applies (llcomm/tp/algo_table.py: the user's
#: `llcomm tune` table, then llcomm/tp/tables/*.json, then this rule): (world_size, largest bytes,
#: algo) rows, first match wins, two_shot beyond. World size 2 is measured on 2xH200 (the
#: pipelined Lamport fastest to 8 MiB, two-shot above; bench/results/ab/2026-11-30-lamport-chunk/).
#: Other world sizes are a rule until measured: the one-shot's remote traffic grows as
#: (W - 1) * bytes, so it gives way to two-shot earlier.
AUTO_TABLE = (
    (2, 8 << 20, "lamport"),
    (None, 256 << 10, "lamport"),
    (None, 1 << 20, "one_shot"),
)


def _remember(hot: dict, key: tuple, call) -> None:
    """Keep a validated key's bound call (HOT_CACHE_MAX at most: then start over)."""
    if len(hot) >= HOT_CACHE_MAX:
        hot.clear()
    hot[key] = call


class Communicator(FusedJoins):
    """Tensor-parallel collectives for one process group.

    Creating a Communicator is a **collective** and **host-blocking**: every rank of ``group``
    must call it, in the same order relative to other collectives, and it exchanges memory
    handles and synchronises. Create it once at start-up and keep it; never inside a CUDA graph
    capture.

    Args:
        group: the process group (default: the world). One process per GPU.
        max_bytes: the largest input of any op, in bytes. The peer backend allocates about
            ``2 * (world_size + 1) * max_bytes`` of symmetric memory once for the flag kernels
            plus ``2 * world_size * L`` for the Lamport ones, L = min(max_bytes, 16 MiB) at
            world size 2 and min(max_bytes, 1 MiB) elsewhere (``LLCOMM_LAMPORT_BYTES`` sets
            L; ``lamport_bytes`` reports it): 160 MiB at 2 ranks and the default 16 MiB.
            Larger inputs are refused with ValueError. The reference backend enforces the
            same bound.
        backend: ``"auto"``, ``"peer"`` or ``"reference"``.
        timeout_ms: bound of every device-side wait (default ``LLCOMM_TIMEOUT_MS`` or 10 000);
            on the reference backend over gloo, of every host-side wait (default
            ``LLCOMM_TIMEOUT_MS`` or 30000). docs/failures.md has what happens when it runs out.
        deterministic: make all_reduce's bits independent of the algorithm ``"auto"`` picks
            (and so of the tuned table). Only float32 Lamport differs at all (see all_reduce),
            so this keeps float32 off Lamport and costs bf16 / fp16 nothing.
        check_calls: reference backend: before each call's collective, the ranks exchange a
            64-byte header (op, dtype, sizes, broadcast's ``src``) and raise
            ``CommMismatchError`` on every rank where they differ, before any data moves.
            ``None`` (default): on over gloo, where a mismatched collective would abort the
            process (cost per call: docs/failures.md); off over NCCL, where it costs a host
            round trip per call and rules out CUDA graph capture, so a mismatch there is
            undefined unless you pass ``True``. The same value on every rank. The peer backend
            always checks in its kernels, whatever this says.

    ``all_reduce(algo="auto")`` looks its algorithm up in a table chosen here, once (see
    ``llcomm/tp/algo_table.py``): the user's ``llcomm tune`` table for this GPU and world size,
    else a table shipped in the package, else the rule ``AUTO_TABLE``. Every rank uses rank 0's
    choice. ``algo_source`` says which.

    Every op runs on the caller's current CUDA stream, allocates nothing but its output (pass
    ``out=`` to avoid even that), does not synchronise the host, and can be captured in a CUDA
    graph. All ranks must issue the same ops, in the same order, with the same shapes and dtypes,
    on one stream at a time. Dtypes: the reductions (all_reduce, reduce_scatter,
    all_reduce_residual_rmsnorm) sum bfloat16, float16 or float32; the movement ops (broadcast,
    all_gather, all_gather_2d) take any dtype (ints, bool, float8, float64, ...: ``MOVE_DTYPES``
    in ``llcomm/runtime/validate.py``) and are byte-exact. A call whose ranks pass different
    dtypes is a mismatch even where the bytes would move alike (int32 and float32).

    Errors: a peer that never arrives, or that called a different op or size in the same round,
    is written by the kernel to a host-visible word; the next call (or ``check()``) raises
    ``CommTimeoutError`` / ``CommMismatchError`` and the communicator is broken from then on.
    On the reference backend the call itself raises them (``check_calls`` for mismatches).

    Under ``torch.compile(fullgraph=True)`` call the ops through ``llcomm.ops`` (e.g.
    ``llcomm.ops.all_reduce(comm, x)``): they are ``torch.library`` custom ops that find this
    object by ``op_handle``, an int given at construction (docs/compile.md).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 backend: str = "auto", timeout_ms: int | None = None,
                 deterministic: bool = False, check_calls: bool | None = None):
        pr = V.Problems("Communicator")
        if backend not in BACKENDS:
            pr.add(f"backend={backend!r}; expected one of {', '.join(BACKENDS)}")
        V.check_optional_bool(pr, "check_calls", check_calls)
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            pr.add(f"max_bytes={max_bytes!r}; expected a positive int")
        pr.raise_if_any()
        if not dist.is_initialized():
            raise RuntimeError("llcomm.Communicator: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        #: the LLCOMM_* environment, parsed once (llcomm/runtime/settings.py)
        self.settings = S.TPSettings.read(self.world_size)
        self.timeout_ms = P.resolve_timeout_ms(timeout_ms, self.settings.timeout_ms)
        self.max_bytes = max_bytes
        # the reference backend's call check, resolved here so that the one exchange below
        # compares it too: a rank that sends headers would meet another's payload
        checked = default_check_calls(self.group) if check_calls is None else check_calls
        # a collective: also checks that the ranks agree on the settings they must share
        agreed = self.settings.agreed() + (("check_calls", checked),)
        backend, self.backend_reason = choose_backend(self.group, backend, "Communicator", agreed)
        if backend == "peer":
            from .peer import PeerBackend
            self._impl = PeerBackend(self.group, max_bytes, self.timeout_ms, self.settings)
            self.device = self._impl.device
            self.check_calls = True     # the kernels compare op, size and dtype in every call
        else:
            self.timeout_ms = P.resolve_timeout_ms(timeout_ms, self.settings.timeout_ms,
                                                   P.REFERENCE_DEFAULT_TIMEOUT_MS)
            self.device = reference_device(self.group)
            self.check_calls = checked
            self._impl = ReferenceBackend(self.group, self.timeout_ms, device=self.device,
                                          check_calls=self.check_calls)
        self.backend = backend
        self.deterministic = bool(deterministic)
        self._closed = False
        # Hot paths (all_reduce, the fused joins): validated keys -> bound calls
        self._hot_ar: dict = {}
        self._hot_fused: dict = {}
        self._auto = self._auto_selection()
        self.algo_source = self._auto.source
        register(self)          # self.op_handle: names this object to torch.ops.llcomm.*

    def _auto_selection(self) -> algo_table.Selection:
        """Resolve all_reduce's "auto" table (a collective on the peer backend)."""
        W = self.world_size
        rule = [(limit, algo) for ws, limit, algo in AUTO_TABLE if ws in (None, W)]
        if self.backend != "peer":  # the reference backend runs its own algorithm anyway
            return algo_table.compile_rows(rule, "two_shot", "rule llcomm.tp.api.AUTO_TABLE")
        cap = self._impl.lamport_bytes
        sel, err = None, None
        try:
            table = algo_table.find_table(torch.cuda.get_device_name(self.device), W,
                                          self.settings.tune_table)
            sel = (algo_table.table_selection(table, cap) if table is not None else
                   algo_table.compile_rows(rule, "two_shot", "rule llcomm.tp.api.AUTO_TABLE",
                                           cap))
        except algo_table.AlgoTableError as e:
            err = str(e)
        # Different algorithms never meet (one waits on flags, Lamport on data), so every
        # rank must pick the same one for the same size: take rank 0's choice.
        everyone = [None] * W
        dist.all_gather_object(everyone, (sel, err), group=self.group)
        bad = [(r, e) for r, (_, e) in enumerate(everyone) if e]
        if bad:
            self._impl.close()
            raise algo_table.AlgoTableError(
                f"llcomm.Communicator (rank {bad[0][0]}): {bad[0][1]}")
        if any(s != everyone[0][0] for s, _ in everyone):
            log.warning("llcomm: ranks resolved different all_reduce tables; all use rank 0's "
                        "(%s)", everyone[0][0].source)
        sel = everyone[0][0]
        log.info("llcomm: all_reduce(algo='auto') follows %s", sel.source)
        return sel

    # -- ops ------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor | None = None,
                   algo: str = "auto") -> torch.Tensor:
        """Sum of ``x`` over all ranks.

        Args:
            x: any shape, contiguous, bf16 / fp16 / fp32, on this communicator's device,
                at most ``max_bytes``. Not modified (unless ``out is x``).
            out: optional result tensor, same shape and dtype as x (may be x itself).
            algo: ``"one_shot"`` (push + one barrier), ``"lamport"`` (one-shot, barrier-free,
                inputs up to ``lamport_bytes``), ``"two_shot"`` (reduce-scatter + all-gather)
                or ``"auto"``.
        Returns:
            ``out`` (a new tensor if not given). The peer backend accumulates in fp32 in global
            rank order and rounds once, so every rank gets the same bits, and bf16 / fp16 give
            the same bits whichever algorithm ran. One exception in float32: Lamport marks
            unwritten words with the bit pattern 0x80008000 (the subnormal -2**-134) and sends
            an input element with exactly that pattern as +0.0, so such an element can change
            the result by 2**-134 against one_shot / two_shot. ``deterministic=True`` rules it
            out. (The reference backend is NCCL's or gloo's own order.)
        """
        # Hot path: a (shape, dtype, algo) that passed the checks below before needs only the
        # checks that depend on the tensors themselves; the backend bound the rest (its launch
        # plan) when it was first seen. An eager decode step calls this about 160 times a token.
        if type(algo) is str and self._ready(x):
            call = self._hot_ar.get((x.shape, x.dtype, algo))
            if call is not None and self._fits(out, x):
                return call(x, torch.empty_like(x) if out is None else out)
        self._check_open("all_reduce")
        pr = V.Problems("all_reduce")
        if V.check_tensor(pr, "x", x, self.device, max_bytes=self.max_bytes, why=V.REDUCE_ONLY):
            V.check_out(pr, out, x, tuple(x.shape), self.device)
        if algo not in ALGOS:
            pr.add(f"algo={algo!r}; expected one of {', '.join(ALGOS)}")
        elif algo == "lamport" and isinstance(x, torch.Tensor) and self.backend == "peer" \
                and x.numel() * x.element_size() > self._impl.lamport_bytes:
            pr.add(f"algo='lamport' takes at most {self._impl.lamport_bytes} bytes; x has "
                   f"{x.numel() * x.element_size()}")
        elif algo == "lamport" and self.deterministic and isinstance(x, torch.Tensor) \
                and x.dtype == torch.float32:
            pr.add("algo='lamport' with float32 is not bit-identical to the other algorithms "
                   "(see all_reduce) and this communicator was created with deterministic=True")
        pr.raise_if_any()
        if out is None:
            out = torch.empty_like(x)
        run = algo
        if algo == "auto":
            run = self.choose_algo(x.numel() * x.element_size())
            if run == "lamport" and self.deterministic and x.dtype == torch.float32:
                run = "one_shot"
        call = self._impl.all_reduce_call(run, x.numel(), x.dtype)
        if type(x) is torch.Tensor and type(algo) is str:
            _remember(self._hot_ar, (x.shape, x.dtype, algo), call)
        return call(x, out)

    @property
    def lamport_bytes(self) -> int:
        """The largest input of ``all_reduce(algo="lamport")`` in bytes: the peer backend's
        Lamport slot (16 MiB at world size 2, else 1 MiB, or ``LLCOMM_LAMPORT_BYTES``; at most
        ``max_bytes``). reduce_scatter runs its Lamport kernel for outputs up to this size.
        0 on the reference backend, which runs its own algorithm whatever ``algo`` says."""
        return self._impl.lamport_bytes if self.backend == "peer" else 0

    def choose_algo(self, nbytes: int) -> str:
        """The algorithm ``all_reduce(algo="auto")`` runs for ``nbytes`` (from the table
        resolved at construction, ``algo_source``; float32 with ``deterministic=True`` runs
        one_shot where this says lamport)."""
        return self._auto.choose(nbytes)

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Copy ``x`` of rank ``src`` (a rank of this group) into ``x`` on every rank, in place.

        x: contiguous, **any dtype** (int64 token ids, bool masks, float8, ...), the same shape
        and dtype on every rank, at most ``max_bytes``. Returns x. Byte-exact: the bytes that
        arrive are the bytes that were sent (NaN payloads, -0.0 and subnormals included).
        """
        self._check_open("broadcast")
        pr = V.Problems("broadcast")
        V.check_tensor(pr, "x", x, self.device, dtypes=V.MOVE_DTYPES, max_bytes=self.max_bytes,
                       why=V.MOVE_ONLY)
        if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < self.world_size:
            pr.add(f"src={src!r}; expected a rank in [0, {self.world_size})")
        pr.raise_if_any()
        return self._impl.broadcast(x, src)

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0 in rank order.

        x: ``[d0, ...]``, **any dtype**; out: ``[world_size * d0, ...]`` of x's dtype (allocated
        if not given). Byte-exact, as ``broadcast``.
        """
        self._check_open("all_gather")
        pr = V.Problems("all_gather")
        if V.check_tensor(pr, "x", x, self.device, dtypes=V.MOVE_DTYPES,
                          max_bytes=self.max_bytes, why=V.MOVE_ONLY):
            shape = (self.world_size * (x.shape[0] if x.dim() else 1), *x.shape[1:])
            V.check_out(pr, out, x, shape, self.device)
        pr.raise_if_any()
        if out is None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        return self._impl.all_gather(x, out)

    def all_gather_2d(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Token-major gather: x ``[tokens, part]`` -> out ``[tokens, world_size * part]``.

        Rank r's part of token t lands at ``out[t, r * part:(r + 1) * part]`` (flat offset
        ``t * full + r * part``), the layout a column-parallel projection's output needs.
        x: **any dtype**; out: of x's dtype (allocated if not given). Byte-exact, as
        ``broadcast``.
        """
        self._check_open("all_gather_2d")
        pr = V.Problems("all_gather_2d")
        if V.check_tensor(pr, "x", x, self.device, dtypes=V.MOVE_DTYPES,
                          max_bytes=self.max_bytes, why=V.MOVE_ONLY):
            if x.dim() != 2:
                pr.add(f"x has shape {tuple(x.shape)}; expected 2-D [tokens, part]")
            else:
                shape = (x.shape[0], self.world_size * x.shape[1])
                V.check_out(pr, out, x, shape, self.device)
        pr.raise_if_any()
        if out is None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        return self._impl.all_gather_2d(x, out)

    def reduce_scatter(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over ranks, then rank r keeps the r-th of ``world_size`` equal parts along dim 0.

        x: ``[world_size * d0, ...]``; out: ``[d0, ...]``. Accumulation as in all_reduce.
        """
        self._check_open("reduce_scatter")
        pr = V.Problems("reduce_scatter")
        if V.check_tensor(pr, "x", x, self.device, max_bytes=self.max_bytes, why=V.REDUCE_ONLY):
            if x.dim() == 0 or x.shape[0] % self.world_size:
                pr.add(f"x has shape {tuple(x.shape)}; dim 0 must be a multiple of world_size="
                       f"{self.world_size}")
            else:
                shape = (x.shape[0] // self.world_size, *x.shape[1:])
                V.check_out(pr, out, x, shape, self.device)
        pr.raise_if_any()
        if out is None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        return self._impl.reduce_scatter(x, out)

    # -- hot-path checks ----------------------------------------------------------------------
    _remember = staticmethod(_remember)

    def _ready(self, t) -> bool:
        """``t`` is a plain tensor, on this communicator's device, contiguous."""
        return type(t) is torch.Tensor and t.device == self.device and t.is_contiguous()

    def _fits(self, out, x: torch.Tensor) -> bool:
        """``out`` is None or ready and shaped and typed like ``x``."""
        return out is None or (self._ready(out) and out.shape == x.shape
                               and out.dtype == x.dtype)

    # -- lifetime -------------------------------------------------------------------------------
    def _check_open(self, fn: str) -> None:
        V.check_open(self._closed, fn, "Communicator")

    def check(self) -> None:
        """Wait for this rank's queued ops and raise any error the device reported. Call it after
        replaying a CUDA graph (replays cannot raise) or whenever you want failures surfaced."""
        self._impl.check()

    def close(self) -> None:
        """Release the workspace. A collective: every rank drains its work first. Every op
        called afterwards raises CommClosedError. Closing twice is a no-op."""
        self._closed = True
        self._hot_ar.clear()
        self._hot_fused.clear()
        self._impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
