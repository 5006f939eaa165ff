"""``Buffer``: DeepEP's low-latency ``Buffer`` API on ``llcomm.EPBuffer`` (docs/deep_ep.md)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..ep import MASK_BACKENDS, DeepEPOutputs, EPBuffer
from ..errors import UnsupportedConfigError
from ..runtime import validate as V
from ..runtime.backend import choose_backend_hosts
from ..runtime.settings import EPSettings
from . import convert
from .config import Config  # noqa: F401  (deep_ep.Config: ``from llcomm.deep_ep import Config``)
from .checks import (PREFIX, check_bools, check_cost_stats, check_handle, check_int,
                     check_stats, check_topk_dtype, refuse, refuse_cost_stats, topk_int64)
from .event import after, on_call_stream
from .handle import LowLatencyHandle
from .local import LocalBuffer
from .masks import ShrinkMasks
from .mpi import group_of_comm
from .nvfp4_dispatch import dispatch as nvfp4_dispatch
from .overlap import wait_before_send
from .normal import NormalMode
from .surface import DeepEPSurface

#: Low-latency send halves in flight per op (``EPBuffer(sends_in_flight=...)``): two, as DeepEP's
#: double buffering allows (two-batch overlap); one across hosts.
SENDS_IN_FLIGHT = 2

#: DeepEP's top-k index dtype (int64 in its default build). The calls also take int32, as
#: DeepEP builds with 32-bit top-k indices do, and convert it.
topk_idx_t = torch.int64


class Buffer(NormalMode, ShrinkMasks, LocalBuffer, DeepEPSurface):
    """DeepEP's ``Buffer``: the low-latency mode on an ``llcomm.EPBuffer``, the normal mode on
    ``all_to_all_single`` over ``group`` (``normal.py``).

    ``import llcomm.deep_ep as deep_ep`` in place of ``import deep_ep``: the calls take
    DeepEP's arguments and return DeepEP's tuples and layouts. What differs and what
    raises NotImplementedError: docs/deep_ep.md.

    **When the EPBuffer is created.** DeepEP's constructor takes a byte budget, not the shapes;
    llcomm's buffer is laid out for ``(num_max_dispatch_tokens_per_rank, hidden, num_experts,
    dtype)``, which arrive with the first ``low_latency_dispatch`` (``hidden`` and the dtype
    from ``x``) or with ``clean_low_latency_buffer`` (bfloat16). That first call creates the
    ``EPBuffer``: a **collective** (every rank makes it, with the same shapes, as every rank
    makes the same dispatch calls) that blocks the host, so make it before any CUDA graph
    capture (engines warm up eagerly first, or call ``clean_low_latency_buffer`` at start-up).
    Later calls must use the same shapes (ValueError naming the one that differs). The
    constructor itself is local: it checks its arguments and allocates nothing. The arguments
    after ``num_qps_per_rank`` are keyword-only: their order differs between DeepEP versions.

    Args:
        group: the process group (default: the world), one process per GPU.
        num_nvl_bytes: DeepEP's NVLink budget for its high-throughput mode: accepted, unused.
        num_rdma_bytes: the budget of the low-latency buffer, usually
            ``get_low_latency_rdma_size_hint(...)``. When it is not 0, the hint of the first
            call's shapes (in bf16, as DeepEP's) must fit in it, else ValueError: a budget
            computed for other shapes is caught before anything is allocated. llcomm allocates
            ``EPBuffer.size_hint`` of the shapes and dtype (twice the hint for float32 tokens).
        low_latency_mode: kept as ``buffer.low_latency_mode``; either value serves both
            modes: the low-latency calls (on the EPBuffer) and the normal-mode calls
            (``get_dispatch_layout``, ``dispatch``, ``combine``: torch.distributed's
            ``all_to_all_single`` over ``group``; ``normal.py``) share one Buffer, as DeepEP's do.
        num_qps_per_rank: RDMA queue pairs: accepted, unused (across hosts NVSHMEM's own
            settings govern its transport; docs/multihost.md).
        allow_nvlink_for_low_latency_mode: must be True (llcomm's peer backend is NVLink).
        allow_mnnvl: accepted, no effect: the peer backend serves the GPUs of one host;
            across hosts the two-level kernels on SHMEM run, or the two-level reference
            exchange on torch.distributed (docs/multihost.md).
        use_fabric: must be False.
        explicitly_destroy: accepted; ``destroy()`` works either way.
        enable_shrink: rank masks (``EPBuffer(enable_masks=True)``; peer backend, or the
            two-level kernels across hosts): a rank that misses a bounded wait is masked,
            ``low_latency_query_mask_buffer`` reports it, ``low_latency_update_mask_buffer``
            masks or unmasks one rank by hand, ``low_latency_clean_mask_buffer`` unmasks every
            rank. Where the buffer would run on the reference backend (``backend="reference"``,
            or ``"auto"`` where the peer backend cannot run, on any group: a gloo group of GPU
            ranks with peer access runs the peer backend) the constructor raises
            UnsupportedConfigError.
        comm: an ``mpi4py`` communicator, used where ``group`` is None (DeepEP's rule): it
            must span torch.distributed's initialised world with the same rank numbers, and
            the buffer then runs on the world group (a collective check); otherwise an error
            naming ``comm`` says to pass ``group`` (llcomm never communicates through MPI).
        backend: llcomm's backend of the EPBuffer (``"auto"``, ``"peer"`` or ``"reference"``).
        timeout_ms: bound of every device-side wait of the EPBuffer (its default otherwise).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, *, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: object | None = None,
                 backend: str = "auto", timeout_ms: int | None = None) -> None:
        refuse("__init__", {k: why for k, bad, why in (
            ("allow_nvlink_for_low_latency_mode=False", allow_nvlink_for_low_latency_mode is False,
             "llcomm's peer backend moves data over NVLink only (there is no RDMA path); "
             "backend='reference' runs on torch.distributed"),
            ("use_fabric=True", use_fabric is True, "llcomm allocates no fabric memory"),
        ) if bad})
        pr = V.Problems("deep_ep.Buffer")
        check_bools(pr, low_latency_mode=low_latency_mode,
                    allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode,
                    allow_mnnvl=allow_mnnvl, use_fabric=use_fabric,
                    explicitly_destroy=explicitly_destroy, enable_shrink=enable_shrink)
        check_int(pr, "num_nvl_bytes", num_nvl_bytes)
        check_int(pr, "num_rdma_bytes", num_rdma_bytes)
        check_int(pr, "num_qps_per_rank", num_qps_per_rank, 1)
        pr.raise_if_any()
        if group is None and comm is not None:
            group = group_of_comm(comm)
        if not dist.is_initialized():
            raise RuntimeError(f"{PREFIX}: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._backend = backend
        self._timeout_ms = timeout_ms
        self._ep: EPBuffer | None = None
        self._aux = None            # convert.layout_aux of the EPBuffer's shapes
        self._early_mask = 0        # ranks masked by hand before the EPBuffer exists (bits)
        self._dispatches = 0        # low_latency_dispatch calls (slot: this % handle_slots)
        self._handle_outputs: dict = {}     # handle slot -> (src_info, layout_range)
        self._scales: dict = {}             # (handle slot, UE8M0) -> (storage, view)
        self._local: torch.Tensor | None = None     # LocalBuffer's region, made on demand
        self._destroyed = False
        if enable_shrink:
            # Decided as EPBuffer will decide it (a collective, as DeepEP's constructor is), so
            # that a buffer which would run on the reference backend is refused here, not at
            # its first call.
            resolved, why = ((backend, "requested") if backend == "reference" else
                             choose_backend_hosts(self.group, backend, "deep_ep.Buffer", (),
                                                  EPSettings.read().ranks_per_host)[:2])
            if resolved not in MASK_BACKENDS:
                raise UnsupportedConfigError(
                    f"{PREFIX}: enable_shrink=True needs rank masks, which the peer backend and "
                    "the two-level kernels on SHMEM have, and this buffer would run on the "
                    f"{resolved} backend ({why}; backend={backend!r}): a torch.distributed "
                    "collective cannot leave a member out. Create it without enable_shrink.")

    # -- sizes and the EPBuffer -----------------------------------------------------------------
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of symmetric memory llcomm's EPBuffer takes per rank for these shapes, in
        bfloat16, with two sends in flight: ``EPBuffer.size_hint(..., sends_in_flight=2)``
        (about ``8 * num_ranks * T * hidden * 2`` plus small metadata). **llcomm's own figure,
        much smaller than DeepEP's** (which holds one message per (expert, token)): 28.8 MiB
        against DeepEP's 1,820 MiB for DeepSeek-V3 on 2 ranks at 128 tokens (docs/ep.md has a
        table of one send in flight). Pass it as ``num_rdma_bytes``."""
        return EPBuffer.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                  num_experts, torch.bfloat16, sends_in_flight=SENDS_IN_FLIGHT)

    @property
    def ep_buffer(self) -> EPBuffer | None:
        """The ``llcomm.EPBuffer`` underneath, once the first call has created it (else None)."""
        return self._ep

    def _check_open(self, fn: str) -> None:
        V.check_open(self._destroyed, f"deep_ep.Buffer.{fn}", "deep_ep.Buffer")

    def _ensure(self, fn: str, max_tokens: int, hidden: int, num_experts: int,
                dtype: torch.dtype | None) -> EPBuffer:
        """The EPBuffer for these shapes: created by the first call (a collective), the same
        shapes required afterwards. ``dtype`` None: whatever it has (bfloat16 when new)."""
        ep = self._ep
        if ep is not None:
            pr = V.Problems(f"deep_ep.Buffer.{fn}")
            for name, got, have in (
                    ("num_max_dispatch_tokens_per_rank", max_tokens, ep.max_tokens),
                    ("hidden", hidden, ep.hidden), ("num_experts", num_experts, ep.num_experts)):
                if got != have:
                    pr.add(f"{name}={got}, but this Buffer's EPBuffer was created for {have} by "
                           "its first call; one Buffer serves one set of shapes")
            pr.raise_if_any()
            return ep
        dtype = torch.bfloat16 if dtype is None else dtype
        if self.num_rdma_bytes:
            # the hint of these shapes, in bf16 as DeepEP computes it: a budget from the hint of
            # other (smaller) shapes is a configuration error DeepEP would meet too
            try:
                need = self.get_low_latency_rdma_size_hint(max_tokens, hidden, self.group_size,
                                                           num_experts)
            except (TypeError, ValueError):
                need = 0                # bad shapes: EPBuffer's own checks below name them
            if need > self.num_rdma_bytes:
                raise ValueError(
                    f"{PREFIX}.{fn}: num_rdma_bytes={self.num_rdma_bytes} is less than "
                    f"get_low_latency_rdma_size_hint({max_tokens}, {hidden}, {self.group_size}, "
                    f"{num_experts}) = {need} bytes, llcomm's need for these shapes "
                    "(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts); pass "
                    "the hint of the shapes the calls use (or 0: no budget)")
        kw = dict(num_experts=num_experts, hidden=hidden, dtype=dtype,
                  num_max_dispatch_tokens_per_rank=max_tokens, backend=self._backend,
                  timeout_ms=self._timeout_ms, enable_masks=self.enable_shrink)
        try:        # two send halves in flight, as DeepEP's double buffering allows
            ep = EPBuffer(self.group, sends_in_flight=SENDS_IN_FLIGHT, **kw)
        except UnsupportedConfigError as e:     # across hosts: one (every rank gets here)
            if "sends_in_flight" not in str(e):
                raise
            ep = EPBuffer(self.group, **kw)
        self._aux = convert.layout_aux(ep.num_local_experts, ep.num_ranks * max_tokens,
                                       max_tokens, ep.num_ranks, ep.device)
        for r in range(self.group_size):        # masked by hand before it existed
            if (self._early_mask >> r) & 1:
                ep.set_mask(r, True)
        self._ep = ep
        return ep

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: llcomm's flags carry a call count, never reset. Creates the
        EPBuffer (bfloat16) if no call has yet, a collective, so that start-up code can make it
        before CUDA graph capture; afterwards checks that the shapes are the buffer's."""
        self._check_open("clean_low_latency_buffer")
        pr = V.Problems("deep_ep.Buffer.clean_low_latency_buffer")
        ok = all([check_int(pr, "num_max_dispatch_tokens_per_rank",
                            num_max_dispatch_tokens_per_rank, 1),
                  check_int(pr, "hidden", hidden, 1),
                  check_int(pr, "num_experts", num_experts, 1)])
        pr.raise_if_any()
        if ok:
            self._ensure("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden,
                         num_experts, None)

    # -- dispatch -------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, *,
                             x_global_scale: torch.Tensor | None = None, use_nvfp4: bool = False,
                             use_ue8m0_for_sf: bool = False) -> tuple:
        """Send each token to the experts ``topk_idx`` names (``EPBuffer.dispatch``).

        Args:
            x: ``[num_tokens, hidden]`` bfloat16 (float16 / float32 also work; the first call
                fixes the dtype), ``num_tokens <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[num_tokens, topk]`` int64 (``topk_idx_t``) or int32 (converted once),
                -1 for no expert.
            num_max_dispatch_tokens_per_rank: ``T``, as DeepEP's; the same in every call.
            num_experts: as DeepEP's; the same in every call.
            cumulative_local_expert_recv_stats: optional int32 ``[num_local_experts]``; the
                rows each local expert received are added to it on the device, when the
                receive completes (after ``hook()`` with ``return_recv_hook``).
            dispatch_wait_recv_cost_stats: optional int64 ``[num_ranks]`` on the device,
                on the kernel backends (NotImplementedError on the reference one): entry r grows
                by the nanoseconds the dispatch kernel's blocks waited for rank r's data
                (``EPBuffer.dispatch(wait_stats=...)``; DeepEP counts SM clock cycles:
                docs/deep_ep.md).
            use_fp8: quantise on the sender (DeepEP's default); ``hidden`` a multiple of 128.
            round_scale: power-of-two scales.
            use_ue8m0: scales as UE8M0 exponent bytes packed four to an int32 (needs
                ``round_scale``; ``hidden`` a multiple of 512).
            async_finish: the returned event is recorded after the call (a CUDA event);
                without it the event is empty. The call runs on the current stream either way.
            return_recv_hook: issue the send half only; ``hook()`` (on the same stream) issues
                the receive half, which writes DeepEP's layouts too. Outputs are unspecified
                until then. Without it the hook is None (as DeepEP's).
            x_global_scale: NVFP4's float32 global scale, its first element (keyword only).
            use_nvfp4: with ``use_fp8=False``, ``recv_x`` is DeepEP's NVFP4 pair (uint8
                ``[W * T, hidden / 2, L]``, float8_e4m3fn scales ``[32, 4, ceil(W * T / 128), 4,
                ceil(hidden / 64), L]``; ``nvfp4.py``; the wire carries x's dtype).
            use_ue8m0_for_sf: not supported (NotImplementedError).

        Returns:
            recv_x: ``[L, W * T, hidden]`` in x's dtype; rows ``0 .. recv_count[e] - 1`` of
                expert e filled, by source rank, then source token. With ``use_fp8`` the pair
                of float8_e4m3fn ``[L, W * T, hidden]`` and scales ``[L, W * T, hidden / 128]``
                float32 (``hidden / 512`` int32 with UE8M0) whose last two dimensions are
                column-major, as DeepEP's; the scales live in the handle's slot.
            recv_count: ``[L]`` int32.
            handle: DeepEP's tuple ``(src_info, layout_range, T, hidden, num_experts)``:
                ``src_info`` ``[L, W * T]`` int32, the source token of each row;
                ``layout_range`` ``[L, W]`` int64, ``(begin << 32) | count`` of the rows from
                each source rank. A ``LowLatencyHandle``, valid for two dispatches.
            event: an ``EventOverlap`` (empty without ``async_finish``).
            hook: the receive half with ``return_recv_hook``, else None.
        """
        fn = "low_latency_dispatch"
        self._check_open(fn)
        if use_nvfp4 is not False or use_ue8m0_for_sf is not False:
            return nvfp4_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                  num_experts, cumulative_local_expert_recv_stats,
                                  dispatch_wait_recv_cost_stats, x_global_scale, use_fp8,
                                  round_scale, use_ue8m0, use_nvfp4, use_ue8m0_for_sf,
                                  async_finish, return_recv_hook)
        pr = V.Problems(f"deep_ep.Buffer.{fn}")
        check_bools(pr, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                    async_finish=async_finish, return_recv_hook=return_recv_hook)
        shapes_ok = check_int(pr, "num_max_dispatch_tokens_per_rank",
                              num_max_dispatch_tokens_per_rank, 1) \
            & check_int(pr, "num_experts", num_experts, 1)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            pr.add(f"x must be a 2-D torch.Tensor [num_tokens, hidden], got "
                   f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}",
                   type_error=not isinstance(x, torch.Tensor))
            shapes_ok = False
        if use_ue8m0 is True:
            if round_scale is not True or use_fp8 is not True:
                pr.add("use_ue8m0=True needs use_fp8=True and round_scale=True (UE8M0 keeps "
                       "only a scale's exponent, so the scales must be powers of two)")
            if shapes_ok and x.shape[1] % convert.UE8M0_CHANNELS:
                pr.add(f"use_ue8m0=True needs hidden to be a multiple of "
                       f"{convert.UE8M0_CHANNELS} (four scales per int32); x has hidden="
                       f"{x.shape[1]}")
        check_topk_dtype(pr, topk_idx)
        cost = dispatch_wait_recv_cost_stats
        check_cost_stats(pr, "dispatch_wait_recv_cost_stats", cost, self.group_size)
        pr.raise_if_any()
        refuse_cost_stats(self, fn, "dispatch_wait_recv_cost_stats", cost)
        ep = self._ensure(fn, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts, x.dtype)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            check_stats(pr, stats, ep)
        check_cost_stats(pr, "dispatch_wait_recv_cost_stats", cost, ep.num_ranks, ep.device)
        pr.raise_if_any()
        refuse_cost_stats(self, fn, "dispatch_wait_recv_cost_stats", cost)

        idx = topk_int64(topk_idx)
        src_info, layout, scales = self._outputs(ep, use_ue8m0 if use_fp8 else None)
        T, H = ep.max_tokens, ep.hidden
        if ep.backend == "peer":    # the dispatch's receive stage writes DeepEP's layouts
            r = ep.dispatch(x, idx, use_fp8=use_fp8, round_scale=round_scale,
                            return_recv_hook=return_recv_hook, wait_stats=cost,
                            deep_ep=DeepEPOutputs(src_info, layout,
                                                  scales[0] if use_fp8 else None, stats))
            recv_x, recv_count, h = r[:3]
            finish = None
        else:                       # the reference backend: convert.py's torch ops after it
            r = ep.dispatch(x, idx, use_fp8=use_fp8, round_scale=round_scale,
                            return_recv_hook=return_recv_hook, wait_stats=cost)
            recv_x, recv_count, h = r[:3]
            ep_scales = recv_x[1] if use_fp8 else None      # EPBuffer's, contiguous

            def finish():
                convert.source_token(h.src_info, T, src_info)
                convert.layout_range(h.src_info, recv_count, self._aux, layout)
                if scales is not None:
                    convert.fill_scales(scales[1], ep_scales, use_ue8m0)
                if stats is not None:
                    stats.add_(recv_count)
        if use_fp8:
            recv_x = (recv_x[0], scales[1])
        self._dispatches += 1
        hook = None
        if return_recv_hook:
            receive = r[3]
            if finish is None:
                hook = receive
            else:
                def hook():
                    receive()
                    finish()
            hook.__doc__ = f"Receive half of {fn} #{h.index} (llcomm.deep_ep)."
            hook = on_call_stream(ep.device, hook)
        elif finish is not None:
            finish()
        handle = LowLatencyHandle(src_info, layout, T, H, num_experts, h, self)
        event = after(ep.device, async_finish, (x, topk_idx, idx,
                                                *(recv_x if use_fp8 else (recv_x,)),
                                                recv_count, src_info, layout, stats, cost))
        return recv_x, recv_count, handle, event, hook

    def _outputs(self, ep: EPBuffer, ue8m0: bool | None):
        """This dispatch's DeepEP tensors: ``src_info``, ``layout_range`` and, for FP8
        (``ue8m0`` not None), the scales as (contiguous storage, DeepEP's transposed view of
        it); made once per handle slot (and kind of scales), as a handle, like DeepEP's results,
        lives for ``ep.handle_slots`` dispatches."""
        slot = self._dispatches % ep.handle_slots
        L, R = ep.num_local_experts, ep.num_ranks * ep.max_tokens
        if slot not in self._handle_outputs:
            self._handle_outputs[slot] = (
                torch.empty((L, R), dtype=torch.int32, device=ep.device),
                torch.empty((L, ep.num_ranks), dtype=torch.int64, device=ep.device))
        scales = None
        if ue8m0 is not None:
            scales = self._scales.get((slot, ue8m0))
            if scales is None:
                view = convert.scales_storage(L, R, ep.hidden, ue8m0, ep.device)
                scales = self._scales[(slot, ue8m0)] = (view.transpose(1, 2), view)
        return (*self._handle_outputs[slot], scales)

    # -- combine --------------------------------------------------------------------------------
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None, *,
                            overlap: bool = False, packed_recv_count: torch.Tensor | None = None,
                            comp_signal: torch.Tensor | None = None, block_m: int = 64,
                            threshold: int = 0, num_sms: int = 3,
                            src_signals: torch.Tensor | None = None,
                            src_signal_expect_value: int = 0) -> tuple:
        """Weighted sum of the experts' outputs back at each token's rank
        (``EPBuffer.combine``; its order and roundings, docs/ep.md).

        Args:
            x: ``[L, W * T, hidden]`` expert outputs, x's dtype of the dispatch; row j of
                expert e is the output for row j of ``recv_x``.
            topk_idx: the dispatch's ``[num_tokens, topk]``, int64 or int32 (converted once).
            topk_weights: ``[num_tokens, topk]`` float32.
            handle: the dispatch's handle (one of this buffer's two latest dispatches).
            use_logfmt: not supported (NotImplementedError).
            zero_copy: read the outputs from ``get_next_low_latency_combine_buffer(handle)``
                (which must have been called for this handle; a view of the local buffer)
                instead of ``x``, as DeepEP does.
            async_finish: as in ``low_latency_dispatch``.
            return_recv_hook: as in ``low_latency_dispatch``; ``topk_idx`` must stay unchanged
                until the hook has run.
            out: optional ``[num_tokens, hidden]`` result.
            combine_wait_recv_cost_stats: as ``dispatch_wait_recv_cost_stats``, for the
                combine's waits (``EPBuffer.combine(wait_stats=...)``).
            overlap: single-batch overlap (keyword only, with the arguments below;
                ``overlap.py``): the send waits until every compute signal it reads has reached
                its threshold, bounded by ``timeout_ms``.
            packed_recv_count: the dispatch's ``recv_count`` (with ``comp_signal``).
            comp_signal: int32 signal per (local expert, block of ``block_m`` rows).
            block_m: rows per ``comp_signal`` word.
            threshold: the value of a ``comp_signal`` word whose rows are done.
            num_sms: checked, unused.
            src_signals: uint32 signal per local expert (the Blackwell form).
            src_signal_expect_value: the value of a ``src_signals`` word whose rows are done.

        Returns:
            combined_x: ``[num_tokens, hidden]`` in the dispatch's dtype (``out`` if given).
            event: an ``EventOverlap`` (empty without ``async_finish``).
            hook: the receive half with ``return_recv_hook``, else None.
        """
        fn = "low_latency_combine"
        self._check_open(fn)
        refuse(fn, {"use_logfmt=True": "there is no LogFMT combine; the partials travel in the "
                    "buffer dtype (across hosts, llcomm.EPBuffer.combine(rail_fp8=True) sends "
                    "the host sums in FP8)"} if use_logfmt is True else {})
        cost = combine_wait_recv_cost_stats
        pr = V.Problems(f"deep_ep.Buffer.{fn}")
        check_bools(pr, use_logfmt=use_logfmt, zero_copy=zero_copy, async_finish=async_finish,
                    return_recv_hook=return_recv_hook)
        h = check_handle(self, pr, handle)
        check_cost_stats(pr, "combine_wait_recv_cost_stats", cost, self.group_size,
                         self._ep.device if self._ep is not None else None)
        if h is not None and zero_copy is True and not h.combine_buffer_taken:
            pr.add("zero_copy=True reads the tensor get_next_low_latency_combine_buffer(handle) "
                   "returns, and it was not called for this handle: call it and write the "
                   "expert outputs into it, or pass zero_copy=False")
        check_topk_dtype(pr, topk_idx)
        pr.raise_if_any()
        refuse_cost_stats(self, fn, "combine_wait_recv_cost_stats", cost)
        ep = self._ep
        wait_before_send(self, fn, ep, overlap=overlap, packed_recv_count=packed_recv_count,
                         comp_signal=comp_signal, block_m=block_m, threshold=threshold,
                         num_sms=num_sms, src_signals=src_signals,
                         src_signal_expect_value=src_signal_expect_value)
        expert_out = self._combine_buffer(h) if zero_copy else x
        idx = topk_int64(topk_idx)
        r = ep.combine(expert_out, idx, topk_weights, h.ep_handle, out=out,
                       return_recv_hook=return_recv_hook, wait_stats=cost)
        combined, hook = r if return_recv_hook else (r, None)
        if hook is not None:
            hook = on_call_stream(ep.device, hook)
        event = after(ep.device, async_finish, (expert_out, topk_idx, idx, topk_weights,
                                                combined, cost))
        return combined, event, hook

    # -- lifetime -------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the EPBuffer (``EPBuffer.close()``, a collective when one was created);
        later calls raise CommClosedError. Allowed whatever ``explicitly_destroy`` says."""
        if not self._destroyed and self._ep is not None:
            self._ep.close()
        self._destroyed = True
        self._local = None
