"""``EPBuffer``: low-latency MoE dispatch and combine with DeepEP's low-latency shapes.

    buf = llcomm.EPBuffer(group, num_experts=256, hidden=7168,
                          num_max_dispatch_tokens_per_rank=128)       # once (a collective)
    recv_x, recv_count, handle = buf.dispatch(x, topk_idx)           # every MoE layer
    expert_out = experts(recv_x, recv_count)                         # [L, W * T, hidden]
    y = buf.combine(expert_out, topk_idx, topk_weights, handle)       # [num_tokens, hidden]

Backends: ``"peer"`` (Triton kernels over a symmetric NVLink region, one host), ``"shmem"``
(the two-level Triton kernels across hosts, on SHMEM: ``hosts/peer.py``), ``"reference"``
(torch.distributed all-to-all: NCCL, or gloo on CPU; across hosts its two-level exchange,
docs/multihost.md), ``"auto"`` (peer where every rank has its own GPU on one host and peer
access works, shmem across hosts where SHMEM runs, reference otherwise). All give the same
``recv_x`` bytes, the same ``recv_count`` and handle, and the same combine arithmetic
(docs/ep.md; across hosts the two-level order, docs/multihost.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UnsupportedConfigError
from ..runtime import protocol as P
from ..runtime import validate as V
from ..runtime.backend import choose_backend_hosts, reference_device
from ..runtime.bounded import default_check_calls
from ..runtime.registry import register
from ..runtime.settings import EPSettings
from ..runtime.fp8_format import FP8_BLOCK, FP8_DTYPE, SCALE_DTYPE
from .layout import check_shape_args
from .deep_layouts import DeepEPOutputs, check_deep_ep
from .checks import (check_fp8, check_handle, check_out, check_rail_fp8, check_topk,
                     check_wait_stats, check_weights)
from .handle import EPHandle
from .inflight import SendsInFlight, check_sends_in_flight
from .hosts import transport
from .hosts.peer import HostsPeerEP
from .masks import MASK_BACKENDS, MAX_MASK_RANKS, RankMasks
from .peer import PeerEP
from .reference import ReferenceEP
from .hosts.reference import TwoLevelReferenceEP
from .sizes import EP_DTYPES, dtype_name, size_hint

BACKENDS = ("auto", "peer", "reference")


class EPBuffer(RankMasks):
    """Buffers and kernels for MoE dispatch / combine over one process group.

    Creating an EPBuffer is a **collective** and **host-blocking**: every rank of ``group`` calls
    it with the same arguments; it allocates ``size_hint(...)`` bytes of symmetric memory once
    (peer backend), exchanges handles and synchronises. Create it at start-up, never inside a
    CUDA graph capture.

    Args:
        group: the process group (default: the world), one process per GPU. Experts are split
            evenly: rank r holds global experts ``[r * L, (r + 1) * L)``, ``L = num_experts //
            num_ranks``.
        num_experts: global number of experts, a multiple of the number of ranks.
        hidden: token width; ``hidden * itemsize`` must be a multiple of 16 bytes.
        num_max_dispatch_tokens_per_rank: the most tokens any rank dispatches in one call (the
            worst-case decode micro-batch), at most 65536.
        dtype: token dtype, bfloat16 (default), float16 or float32.
        backend: ``"auto"``, ``"peer"`` or ``"reference"``. Ranks that span several hosts
            (``self.hosts``: detected from the host names, or declared by
            ``LLCOMM_EP_RANKS_PER_HOST``) run a two-level exchange: the two-level kernels on
            SHMEM (``self.backend == "shmem"``) where every rank has a GPU, torch's NVSHMEM
            backend and its SHMEM Triton layer, and the group is the default one; else the
            reference backend's. ``"auto"`` picks one, ``"peer"`` the kernels or
            UnsupportedConfigError (docs/multihost.md).
        timeout_ms: bound of every device-side wait (default ``LLCOMM_TIMEOUT_MS`` or 10 000);
            on the reference backend over gloo, of every host-side wait (default
            ``LLCOMM_TIMEOUT_MS`` or 30000; docs/failures.md).
        fp8: size the dispatch receive region for FP8 dispatches only (``dispatch(...,
            use_fp8=True)``; ``hidden`` a multiple of 128); a bf16 dispatch is then refused.
            The default (False) sizes it for the buffer dtype, which also holds FP8 rows and
            scales, so both kinds of dispatch work. ``size_hint(..., fp8=True)`` says how much
            this saves (about a quarter in bf16; docs/ep.md).
        enable_masks: rank masks for fault tolerance, on the peer backend and across hosts on
            the two-level kernels (``"shmem"``); at most 32 ranks. A rank that misses a bounded
            wait is *masked* instead of failing the call: this rank goes on without it
            (dispatch: its rows are not received and ``recv_count`` excludes them; combine: its
            partials count as zero, a token routed only to masked ranks gets zeros) and later
            calls do not wait for it, so a dead peer costs one timeout. ``query_mask()`` says
            who is masked, ``clean_mask()`` forgets it, ``set_mask(rank, masked)`` masks or
            unmasks one rank by hand (llcomm/ep/masks.py). Across hosts a masked rank also
            stops relaying for its rail (docs/multihost.md, "Rank masks"). Mismatches still
            raise. Where the buffer would run on the reference backend (requested, or chosen by
            ``"auto"``) the constructor raises ``UnsupportedConfigError``: a collective cannot
            leave a member out. docs/ep.md has the exact semantics and limits.
        check_calls: reference backend: before each dispatch and combine, the ranks exchange a
            64-byte header (op, dtype, hidden, ``topk``, FP8 mode, carried weights, the
            buffer's shapes) and raise ``CommMismatchError`` on every rank where they differ,
            before any data moves. ``None`` (default): on over gloo, where a mismatched
            exchange would abort the process (cost: docs/failures.md); off over NCCL, where it
            costs a host round trip per call and rules out CUDA graph capture. The same value
            on every rank. The peer backend always checks in its kernels, whatever this says.
        sends_in_flight: 1 (default) or 2: how many send halves (``return_recv_hook=True``) of
            one op may be issued before their receive hooks run, as two-batch overlap does
            (hooks in the order of their sends). 2 doubles the buffer sets (``size_hint(...,
            sends_in_flight=2)``) and the handle slots: a handle lives for ``handle_slots``
            dispatches (4). One host only (UnsupportedConfigError across hosts); docs/ep.md.

    Calls run on the current CUDA stream, allocate nothing but the outputs that are not passed
    in, never synchronise the host, and can be captured in a CUDA graph (peer backend). Every
    rank must make the same sequence of calls with the same ``topk``; ``num_tokens`` may differ.

    Under ``torch.compile(fullgraph=True)`` use ``llcomm.ops.ep_dispatch`` / ``ep_combine``:
    custom ops that return a ticket tensor in place of the handle (docs/compile.md).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, num_experts: int, hidden: int,
                 num_max_dispatch_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16,
                 backend: str = "auto", timeout_ms: int | None = None, fp8: bool = False,
                 enable_masks: bool = False, check_calls: bool | None = None,
                 sends_in_flight: int = 1):
        pr = V.Problems("EPBuffer")
        V.check_optional_bool(pr, "check_calls", check_calls)
        sends_in_flight = check_sends_in_flight(pr, sends_in_flight)
        if not isinstance(enable_masks, bool):
            pr.add(f"enable_masks={enable_masks!r}; expected True or False", type_error=True)
            enable_masks = False
        if not isinstance(fp8, bool):
            pr.add(f"fp8={fp8!r}; expected True or False", type_error=True)
            fp8 = False
        if backend not in BACKENDS:
            pr.add(f"backend={backend!r}; expected one of {', '.join(BACKENDS)}")
        if dtype not in EP_DTYPES:
            pr.add(f"dtype={dtype}; expected one of {', '.join(map(dtype_name, EP_DTYPES))}",
                   type_error=True)
        if not dist.is_initialized():
            raise RuntimeError("llcomm.EPBuffer: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.num_ranks = W = dist.get_world_size(self.group)
        itemsize = dtype.itemsize if dtype in EP_DTYPES else 2
        for msg in check_shape_args(num_max_dispatch_tokens_per_rank, hidden, W, num_experts,
                                    itemsize, fp8):
            pr.add(msg)
        if enable_masks and W > MAX_MASK_RANKS:
            pr.add(f"enable_masks=True with {W} ranks; rank masks support at most "
                   f"{MAX_MASK_RANKS} ranks")
        pr.raise_if_any()
        #: the LLCOMM_* environment, parsed once (llcomm/runtime/settings.py)
        self.settings = EPSettings.read()
        self.timeout_ms = P.resolve_timeout_ms(timeout_ms, self.settings.timeout_ms)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // W
        self.hidden = hidden
        self.max_tokens = num_max_dispatch_tokens_per_rank
        self.dtype = dtype
        self.fp8 = fp8              # dispatch region sized for FP8 dispatches only
        self.enable_masks = enable_masks
        self._dispatches = 0        # host count of dispatch calls (handle indices)
        #: send halves that may be in flight per op; handles live for ``handle_slots`` dispatches
        self.sends_in_flight = sends_in_flight
        # return_recv_hook=True: the op's calls whose receive hooks have not run yet
        self._inflight = SendsInFlight(sends_in_flight)
        self.handle_slots = self._inflight.slots
        self._combines = 0
        self._closed = False
        self._combine_inputs: list[torch.Tensor | None] = [None] * self.handle_slots
        # the reference backend's call check, resolved here so that the one exchange below
        # compares it too: a rank that sends headers would meet another's payload
        checked = default_check_calls(self.group) if check_calls is None else check_calls
        # a collective: also checks that the ranks agree on the settings they must share
        agreed = self.settings.agreed() + (("check_calls", checked),)
        backend, self.backend_reason, hosts = choose_backend_hosts(
            self.group, backend, "EPBuffer", agreed, self.settings.ranks_per_host)
        self.backend = backend
        #: the group's hosts (``llcomm.runtime.hosts.Hosts``): detected, or declared by
        #: LLCOMM_EP_RANKS_PER_HOST; several hosts run the two-level exchange
        self.hosts = hosts
        if enable_masks and backend not in MASK_BACKENDS:
            raise UnsupportedConfigError(
                "llcomm.EPBuffer: enable_masks=True: rank masks need the peer backend (one "
                "host) or the two-level kernels on SHMEM (across hosts), and this buffer would "
                f"run on the {backend} backend ({self.backend_reason}). Create it without "
                "enable_masks (a missing peer then raises CommTimeoutError), or on a group "
                "where one of those runs.")
        if sends_in_flight > 1 and hosts.spans_hosts:
            raise UnsupportedConfigError(
                f"llcomm.EPBuffer: sends_in_flight={sends_in_flight}: the two-level exchange "
                "across hosts keeps one send half in flight; create it with sends_in_flight=1 "
                "(docs/ep.md, \"Two sends in flight\")")
        if backend == "shmem":
            self.backend_reason += "; " + transport.describe()    # which path across hosts
            self._impl = HostsPeerEP(self)
            self.device = self._impl.device
            self.check_calls = True     # the kernels compare op, sizes and modes in every call
        elif backend == "peer":
            self._impl = PeerEP(self)
            self.device = self._impl.device
            self.check_calls = True     # the kernels compare op, sizes and modes in every call
        else:
            self.timeout_ms = P.resolve_timeout_ms(timeout_ms, self.settings.timeout_ms,
                                                   P.REFERENCE_DEFAULT_TIMEOUT_MS)
            self.device = reference_device(self.group)
            self.check_calls = checked
            kw = dict(num_experts=num_experts, hidden=hidden, max_tokens=self.max_tokens,
                      dtype=dtype, device=self.device, timeout_ms=self.timeout_ms,
                      check_calls=self.check_calls)
            self._impl = (TwoLevelReferenceEP(self.group, hosts=hosts, **kw)
                          if hosts.spans_hosts else ReferenceEP(self.group, **kw))
        register(self)          # self.op_handle: names this object to torch.ops.llcomm.*

    size_hint = staticmethod(size_hint)

    @property
    def last_inter_host_bytes(self) -> int:
        """Bytes this rank put across hosts in its latest dispatch or combine (the receive
        hook's part once it has run; docs/multihost.md, "Bytes"), 0 on one host. The shmem
        backend counts them on the device: reading it synchronises."""
        return self._impl.inter_host_bytes if self.hosts.spans_hosts else 0

    @property
    def last_wire_ledger(self) -> dict | None:
        """``{destination rank: (messages, flags, bytes)}`` of the latest call across hosts, as
        the two-level kernels count it (docs/multihost.md); None on other backends. Syncs."""
        led = getattr(self._impl, "wire_ledger", None)
        return None if led is None else led(self._impl._last)

    @property
    def _kernels(self) -> bool:     # device kernels run it: device-side checks and counters
        return self.backend in ("peer", "shmem")

    # -- validation -----------------------------------------------------------------------------
    def _recv_shape(self) -> tuple[int, int, int]:
        return (self.num_local_experts, self.num_ranks * self.max_tokens, self.hidden)

    # -- ops ------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *,
                 out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                 use_fp8: bool = False, round_scale: bool = False,
                 return_recv_hook: bool = False, topk_weights: torch.Tensor | None = None,
                 wait_stats: torch.Tensor | None = None, deep_ep: DeepEPOutputs | None = None):
        """Send every token to the experts ``topk_idx`` names; return ``(recv_x, recv_count,
        handle)``.

        Args:
            x: ``[num_tokens, hidden]``, the buffer's dtype, contiguous, on its device;
                ``num_tokens <= num_max_dispatch_tokens_per_rank`` (may differ per rank, may be
                0).
            topk_idx: ``[num_tokens, topk]`` int64 global expert ids; -1 means no expert.
                ``topk`` (1 to 32) is the same on every rank. An expert listed twice for one
                token gets one row (combine applies both weights). Values outside [-1,
                num_experts) raise ValueError here for CPU tensors; on the GPU they are treated
                as -1 and reported by the next call or ``check()``.
            out: optional ``recv_x`` to fill (shape below; with ``use_fp8`` the pair
                ``(recv_x_fp8, recv_scales)``); allocated when not given.
            use_fp8: quantise on the sender to float8_e4m3fn with one fp32 scale per 128
                channels (``hidden`` a multiple of 128): half the bytes of bf16 cross the
                links. The format is defined in ``llcomm/runtime/fp8_format.py`` (amax / 448
                per block, round to nearest even, saturating); both backends give the same
                bytes.
            round_scale: with ``use_fp8``, round each scale up to a power of two.
            return_recv_hook: issue only the send half (rows leave for their ranks; ``x`` may
                be reused as soon as the send half has run on the stream) and return a fourth
                value, ``hook``: calling it (no arguments, on the same stream) issues the
                receive half that fills ``recv_x``, ``recv_count`` and the handle. Until then
                they are unspecified, and this buffer refuses a combine of this handle and,
                past ``sends_in_flight`` pending send halves, the next dispatch; hooks run in
                the order of their sends. Overlap work between the two (docs/ep.md).
            topk_weights: optional ``[num_tokens, topk]`` float32, the weights the combine of
                this handle will apply. They travel with the dispatch (a few bytes per token),
                so that combine skips its own weights exchange and the wait for it; pass
                ``topk_weights=None`` to that combine. The values at the time of the dispatch
                are used (on the stream, as for ``x``). The same choice on every rank.
            wait_stats: optional ``[num_ranks]`` int64 tensor on the device, on the kernel
                backends (peer; across hosts the two-level kernels: they wait directly only for
                their rail ranks and the ranks of their host, docs/multihost.md;
                NotImplementedError on the reference one): the kernel adds to entry r the
                nanoseconds its blocks spent waiting for rank r's data (summed over the blocks;
                docs/ep.md, "Wait statistics"). Per rank: others may pass None, but
                start on every rank at the same call (the first one compiles a variant).
            deep_ep: optional ``DeepEPOutputs`` (``llcomm.ep.deep_layouts``), **peer backend
                only** (NotImplementedError on the reference one): the receive stage also writes
                DeepEP's ``src_info``, ``layout_range``, scales (in place of the contiguous ones)
                and statistics there, in the same kernel (``llcomm.deep_ep`` uses it).
        Returns:
            recv_x: ``[num_local_experts, num_ranks * max_tokens, hidden]``. For local expert
                e, rows ``0 .. recv_count[e] - 1`` hold its tokens ordered by source rank,
                then by source token index; the remaining rows are unspecified (not zeroed).
                With ``use_fp8``: the pair ``(recv_x_fp8, recv_scales)``, float8_e4m3fn of that
                shape and float32 ``[num_local_experts, num_ranks * max_tokens, hidden // 128]``
                (``llcomm.runtime.fp8_format.dequantize(recv_x_fp8, recv_scales)`` gives bf16 back).
            recv_count: ``[num_local_experts]`` int32 (lives in the handle's slot: see EPHandle).
            handle: an ``EPHandle`` for ``combine``; valid for ``handle_slots`` dispatches.
            hook: only with ``return_recv_hook=True`` (see there).
        """
        V.check_open(self._closed, "EPBuffer.dispatch", "EPBuffer")
        pr = V.Problems("EPBuffer.dispatch")
        self._inflight.check(pr, "dispatch", return_recv_hook, self._dispatches)
        if V.check_tensor(pr, "x", x, self.device, dtypes=(self.dtype,)):
            if x.dim() != 2 or x.shape[1] != self.hidden:
                pr.add(f"x has shape {tuple(x.shape)}; expected [num_tokens, {self.hidden}]")
            elif x.shape[0] > self.max_tokens:
                pr.add(f"x has {x.shape[0]} tokens; at most num_max_dispatch_tokens_per_rank="
                       f"{self.max_tokens} (create the EPBuffer with a larger maximum)")
            else:
                check_topk(self, pr, topk_idx, x.shape[0])
        else:
            check_topk(self, pr, topk_idx, None)
        fp8 = check_fp8(self, pr, use_fp8, round_scale, out)
        if topk_weights is not None:
            check_weights(self, pr, topk_weights, topk_idx)
        check_wait_stats(self, "dispatch", pr, wait_stats)
        check_deep_ep(self, pr, deep_ep, fp8, round_scale, out)
        pr.raise_if_any()
        self._precheck("dispatch")
        scales = None
        if fp8 and deep_ep is not None:         # the scales in DeepEP's storage only
            recv_x = torch.empty(self._recv_shape(), dtype=FP8_DTYPE, device=self.device)
            scales = deep_ep.scales
        elif fp8:
            recv_x, scales = out if out is not None else (
                torch.empty(self._recv_shape(), dtype=FP8_DTYPE, device=self.device),
                torch.empty(self._scales_shape(), dtype=SCALE_DTYPE, device=self.device))
        else:
            recv_x = out if out is not None else torch.empty(self._recv_shape(), dtype=self.dtype,
                                                             device=self.device)
        index = self._dispatches
        mode = (2 if round_scale else 1) if fp8 else 0
        recv = None
        # the reference combine applies a copy made now; the kernels' dispatch carries them now
        carried = topk_weights.clone() if topk_weights is not None and self.backend not in (
            "peer", "shmem") else None
        if self.backend == "peer":
            recv_count, src_info, state, recv = self._impl.dispatch(
                x, topk_idx, recv_x, index % self.handle_slots, mode, scales,
                return_recv_hook, topk_weights, wait_stats, deep_ep)
        elif self.backend == "shmem":
            recv_count, src_info, state, recv = self._impl.dispatch(
                x, topk_idx, recv_x, index % self.handle_slots, mode, scales,
                return_recv_hook, wait_stats, topk_weights)
        elif not return_recv_hook:
            recv_count, src_info, state = self._impl.dispatch(x, topk_idx, recv_x, mode, scales,
                                                              topk_weights is not None)
        else:
            finish = self._impl.dispatch_send(x, topk_idx, recv_x, mode, scales,
                                              topk_weights is not None)
            recv_count = torch.empty(self.num_local_experts, dtype=torch.int32,
                                     device=self.device)
            src_info = torch.empty(self._recv_shape()[:2], dtype=torch.int32, device=self.device)
            state = None

            def recv():
                c, s, handle._state = finish()
                recv_count.copy_(c)
                src_info.copy_(s)
        self._dispatches += 1
        handle = EPHandle(self, index, x.shape[0], topk_idx.shape[1], recv_count, src_info, state,
                          carried, topk_weights is not None)
        result = ((recv_x, scales) if fp8 else recv_x, recv_count, handle)
        if not return_recv_hook:
            return result
        return (*result, self._inflight.hook("dispatch", index, recv, lambda: self._closed))

    def _scales_shape(self) -> tuple[int, int, int]:
        return (self.num_local_experts, self.num_ranks * self.max_tokens,
                self.hidden // FP8_BLOCK)

    def combine(self, expert_out: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor | None, handle: EPHandle, *,
                out: torch.Tensor | None = None, return_recv_hook: bool = False,
                wait_stats: torch.Tensor | None = None, rail_fp8: bool = False):
        """Weighted sum of the experts' outputs back at each token's rank.

        Args:
            expert_out: ``[num_local_experts, num_ranks * max_tokens, hidden]``, the buffer's
                dtype: row j of expert e is the output for row j of ``recv_x`` (rows past
                ``recv_count[e]`` are never read). Read in place, never copied: any such
                tensor, ``recv_x`` itself, or ``get_combine_input(handle)``.
            topk_idx: the same ``[num_tokens, topk]`` int64 tensor given to the dispatch.
            topk_weights: ``[num_tokens, topk]`` float32; None when the dispatch carried them
                (``dispatch(topk_weights=...)``, ``handle.carries_weights``).
            handle: from one of this buffer's ``handle_slots`` latest dispatches.
            out: optional ``[num_tokens, hidden]`` result, the buffer's dtype.
            return_recv_hook: issue only the send half (weights exchange, this rank's partials
                pushed to the tokens' ranks) and return ``(out, hook)``; calling ``hook()`` on
                the same stream waits for the other ranks' partials and writes ``out``, which
                is unspecified until then. ``topk_idx`` must stay unchanged until the hook has
                run (the receive half reads it); ``expert_out`` and ``topk_weights`` may be
                reused after the send half.
            wait_stats: as in ``dispatch``: both of combine's waits (weights, partials).
            rail_fp8: across hosts, each host sum crosses as e4m3 with one fp32 scale per 128
                channels, about half the bytes, within the bound of docs/multihost.md ("FP8
                rail hop"); no effect within a host.
        Returns:
            ``out[t] = sum_k topk_weights[t, k] * expert_out[expert k of t, its row]`` over the
            entries that are not -1 (zeros for a token with none), accumulated in fp32 in one
            fixed order: on each expert rank, that rank's entries in k order (the partial,
            rounded once to the buffer dtype); then at the source, the partials in rank order,
            rounded once. Bitwise reproducible, identical on both backends up to the
            multiply-add contraction noted in docs/ep.md.
        """
        V.check_open(self._closed, "EPBuffer.combine", "EPBuffer")
        pr = V.Problems("EPBuffer.combine")
        self._inflight.check(pr, "combine", return_recv_hook)
        n = None
        if not check_handle(self, pr, handle):
            pass
        elif self._inflight.dispatch_pending(handle.index):
            pr.add(f"handle is from dispatch #{handle.index}, whose receive hook has not been "
                   "called: call it before combining")
        else:
            n = handle.num_tokens
        check_out(self, pr, "expert_out", expert_out, self._recv_shape(), written=False)
        if check_topk(self, pr, topk_idx, n) and n is not None \
                and topk_idx.shape[1] != handle.topk:
            pr.add(f"topk_idx has topk={topk_idx.shape[1]}; the dispatch had {handle.topk}")
        carried = isinstance(handle, EPHandle) and handle.carries_weights
        if carried and topk_weights is not None:
            pr.add("topk_weights must be None: the dispatch of this handle carried the weights "
                   "(dispatch(topk_weights=...)); it applies those")
        elif not carried:
            check_weights(self, pr, topk_weights, topk_idx)
        if n is not None:
            check_out(self, pr, "out", out, (n, self.hidden))
        check_wait_stats(self, "combine", pr, wait_stats)
        kw = {"rail_fp8": True} if check_rail_fp8(self, pr, rail_fp8) else {}
        pr.raise_if_any()
        self._precheck("combine")
        if out is None:
            out = torch.empty((n, self.hidden), dtype=self.dtype, device=self.device)
        if carried:         # peer, shmem: the kernels read the handle's; reference: the copy
            topk_weights = handle._weights
        # peer: the wait statistics; reference: carried, for its call check; shmem: both
        more = {"peer": (wait_stats,), "shmem": (carried, wait_stats)}.get(self.backend,
                                                                          (carried,))
        if not return_recv_hook:
            return self._impl.combine(expert_out, topk_idx, topk_weights, handle._state, out,
                                      *more, **kw)
        index = self._combines
        self._combines += 1
        recv = self._impl.combine_send(expert_out, topk_idx, topk_weights, handle._state, out,
                                       *more, **kw)
        return out, self._inflight.hook("combine", index, recv, lambda: self._closed,
                                        handle.index)

    def get_combine_input(self, handle: EPHandle) -> torch.Tensor:
        """A ``[num_local_experts, num_ranks * max_tokens, hidden]`` tensor (buffer dtype) owned
        by this buffer, for the experts to write their outputs into and pass to ``combine``.

        Zero copy by construction, here as everywhere: ``combine`` reads ``expert_out`` in place
        (the weighted partial of each (token, rank) is formed on the expert's rank and only it
        crosses NVLink), so no combine copies its input, whichever tensor it is. This buffer
        exists for engines written against DeepEP's ``get_next_low_latency_combine_buffer``;
        it saves the allocation, not a copy. Writing the outputs into ``recv_x`` itself (bf16
        dispatch) is equally copy-free and costs no memory.

        Lifetime: one tensor per handle slot, allocated on first use (``num_experts *
        max_tokens * hidden * itemsize`` bytes each, plain device memory, not symmetric):
        handles ``k`` and ``k + handle_slots`` (2, or 4 with two sends in flight) get the same
        tensor, so fill it after the latter's dispatch only for it. Not a collective.
        """
        pr = V.Problems("EPBuffer.get_combine_input")
        check_handle(self, pr, handle)
        pr.raise_if_any()
        slot = handle.index % self.handle_slots
        if self._combine_inputs[slot] is None:
            self._combine_inputs[slot] = torch.empty(self._recv_shape(), dtype=self.dtype,
                                                     device=self.device)
        return self._combine_inputs[slot]

    # -- errors and lifetime --------------------------------------------------------------------
    def _precheck(self, fn: str) -> None:
        bad = self._impl.take_bad_count() if self._kernels else 0
        if bad:
            raise ValueError(f"llcomm.EPBuffer.{fn}: an earlier dispatch got {bad} topk_idx "
                             f"entries outside [-1, {self.num_experts}); they were treated as -1 "
                             "(no expert). Fix the router output.")
        self._impl.precheck()

    def check(self) -> None:
        """Wait for this rank's queued work, then raise what the device reported: a timeout or
        mismatch (``CommTimeoutError`` / ``CommMismatchError``; the buffer is broken after it)
        or out-of-range ``topk_idx`` entries (ValueError). Call it after graph replays."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        bad = self._impl.take_bad_count() \
            if self._kernels or self.device.type == "cuda" else 0
        if bad:
            raise ValueError(f"llcomm.EPBuffer.check: {bad} topk_idx entries outside [-1, "
                             f"{self.num_experts}) were treated as -1 (no expert)")
        self._impl.precheck()

    def close(self) -> None:
        """Release the symmetric region. A collective: every rank drains its work first.
        dispatch, combine and receive hooks called afterwards raise CommClosedError."""
        self._closed = True
        if self._kernels:
            self._impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
