"""The two-level EP kernels' host side: constexprs, the symmetric heap on SHMEM, launches.

``hosts_consts`` builds the kernels' constexpr bundles from a ``HostsLayout`` (shared with the
interpreter tests and the compile check). ``HostsPeerEP`` runs them across hosts: one heap
allocated through PyTorch's symmetric memory with its NVSHMEM backend (rocSHMEM on ROCm builds
of torch 2.13), whose own base address names every symmetric object for the rail puts and whose
peer addresses (same-host PEs) serve the stores inside a host. docs/multihost.md says what runs
where.
"""
from __future__ import annotations

import torch

from ...runtime import protocol as P
from .layout import ERR_WORDS, HostsLayout, fp8_sum_bytes, hosts_layout, row_bytes
from ..layout import DEFAULT_NUM_BLOCKS, ERR_MASK, FP8_BLOCK, MAX_TOPK
from ..masks import update_mask_word
from ..peer import MAX_WARPS, VECTORS_PER_THREAD, PeerEP, _bundle, _pow2

#: Bytes of a flag word a message carries with it.
FLAG_BYTES = 8


def hosts_consts(lay: HostsLayout, num_experts: int, topk: int, fp8: int):
    """(dispatch constexprs, combine constexprs, num_warps) of the two-level kernels for a
    layout, the experts, a call's top-k and FP8 mode (0, 1, 2); STAGES and SHMEM are the
    caller's."""
    from .kernels.combine import HostCombineRegions
    from .kernels.dispatch import HostDispatchRegions, HostSizes
    N, R, T, H, NB = (lay.num_hosts, lay.ranks_per_host, lay.max_tokens, lay.hidden,
                      lay.num_blocks)
    W = N * R
    hp = _pow2(H)
    scales = H // 128 if fp8 else 0
    put = row_bytes(H, lay.itemsize, bool(fp8))
    sizes = _bundle(
        HostSizes, N=N, R=R, W=W, T=T, H=H, HP=hp, K=topk, KP=_pow2(topk), E=num_experts,
        L=num_experts // W, NB=NB, ROW_BYTES=lay.row_bytes,
        PUT_BYTES=put, PUT_WP=_pow2(put // 4),
        RX_WORDS=(H if fp8 else H * lay.itemsize) // 4, SCALES=scales,
        SCALES_P2=max(1, hp // 128), RAIL_FLAGS_P2=_pow2(N), HOST_FLAGS_P2=_pow2(NB * R),
        TOK_P2=_pow2(-(-T // NB)), WP=_pow2(W), LP=_pow2(num_experts // W),
        EHP=_pow2(R * (num_experts // W)),
        SUM_FP8_BYTES=fp8_sum_bytes(H) if H % FP8_BLOCK == 0 else 0)
    o = lay.offsets
    d_regions = _bundle(
        HostDispatchRegions, SET_BYTES=lay.set_bytes, IDS_BYTES=lay.ids_block_bytes(),
        RAIL_SIG=o["d_rail_sig"], ROW_SIG=o["d_row_sig"], HOST_SIG=o["d_host_sig"],
        HOST_ENTRY=o["d_host_entry"], STAGE_IDS=o["d_stage_ids"],
        STAGE=o["d_stage"], RAIL_IDS=o["d_rail_ids"], RAIL_ROWS=o["d_rail_rows"],
        HOST_NTOK=o["d_host_ntok"], HOST_CNT=o["d_host_cnt"], HOST_IDS=o["d_host_ids"],
        HOST_W=o["d_host_w"], HOST_ROWS=o["d_host_rows"])
    c_regions = _bundle(
        HostCombineRegions, SET_BYTES=lay.set_bytes, RAIL_SIG=o["c_rail_sig"],
        HOST_SIG=o["c_host_sig"], HOST_ENTRY=o["c_host_entry"], PART_SIG=o["c_part_sig"],
        BACK_SIG=o["c_back_sig"],
        STAGE_W=o["c_stage_w"], RAIL_W=o["c_rail_w"], HOST_W=o["c_host_w"], PART=o["c_part"],
        STAGE_BACK=o["c_stage_back"], BACK=o["c_back"])
    num_warps = max(1, min(MAX_WARPS, hp // (32 * (16 // lay.itemsize) * VECTORS_PER_THREAD)))
    return (dict(SIZES=sizes, REGIONS=d_regions, FP8=fp8),
            dict(SIZES=sizes, REGIONS=c_regions, enable_fp_fusion=False), num_warps)


def ledger_by_rank(ledger: torch.Tensor, rank: int, ranks_per_host: int) -> dict:
    """A kernel's wire ledger ``[NB, N, 3]`` as ``{destination rank: (messages, flags,
    bytes)}``: host g's row goes to this rank's rail rank there."""
    per_host = ledger.sum(0).tolist()
    host, local = divmod(rank, ranks_per_host)
    return {g * ranks_per_host + local: tuple(int(v) for v in row)
            for g, row in enumerate(per_host) if g != host}


def ledger_bytes(ledger: torch.Tensor) -> int:
    """The bytes a wire ledger ``[NB, N, 3]`` puts across hosts: data and 8 per flag."""
    tot = ledger.sum((0, 1))
    return int(tot[2] + FLAG_BYTES * tot[1])


def make_layout(max_tokens: int, hidden: int, num_hosts: int, ranks_per_host: int,
                itemsize: int, fp8: bool, num_experts: int,
                num_blocks: int = DEFAULT_NUM_BLOCKS) -> HostsLayout:
    """The region of a buffer: id slots sized for MAX_TOPK, as ``size_hint`` takes no top-k."""
    return hosts_layout(max_tokens, hidden, num_hosts, ranks_per_host, MAX_TOPK, itemsize,
                        num_blocks, fp8, num_experts)


def default_num_blocks(num_hosts: int, ranks_per_host: int, sms: int | None = None) -> int:
    """Blocks of the two-level kernels: DEFAULT_NUM_BLOCKS, fewer when a wait would poll more
    than MAX_WAIT_FLAGS flags or the GPU has fewer SMs (``sms``)."""
    from ..layout import MAX_WAIT_FLAGS
    nb = min(DEFAULT_NUM_BLOCKS, MAX_WAIT_FLAGS // max(num_hosts, ranks_per_host))
    return nb if sms is None else min(nb, sms)


def hosts_region_bytes(max_tokens: int, hidden: int, num_ranks: int, ranks_per_host: int,
                       itemsize: int, fp8: bool, num_experts: int) -> int:
    """Bytes of the two-level region per rank (``EPBuffer.size_hint(num_ranks_per_host=...)``),
    at ``default_num_blocks`` without an SM bound."""
    N = num_ranks // ranks_per_host
    return make_layout(max_tokens, hidden, N, ranks_per_host, itemsize, fp8, num_experts,
                       default_num_blocks(N, ranks_per_host)).total_bytes


def size_tag(op: int, hidden: int, topk: int, fp8: int, dtype: torch.dtype) -> int:
    """The flags' tag of a call: ranks that disagree about the shape or FP8 mode mismatch."""
    return P.size_tag(op, (hidden * 4 + fp8) * 64 + topk, str(dtype).removeprefix("torch."))


def _shmem_heap(nbytes: int, device: torch.device, group):
    """``nbytes`` of symmetric memory on SHMEM (torch's NVSHMEM backend; rocSHMEM on ROCm
    builds), zeroed on every rank before any rank's first kernel can write into it; returns
    the tensor and torch's rendezvous handle."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from ...errors import UnsupportedConfigError
    try:
        symm_mem.set_backend("NVSHMEM")
    except RuntimeError as e:       # torch: the backend is fixed by a process's first tensor
        raise UnsupportedConfigError(
            "llcomm.EPBuffer: the two-level kernels need torch's symmetric memory on NVSHMEM, "
            "and this process already allocated symmetric memory on another backend (a "
            "Communicator or a single-host EPBuffer made first?): create the EPBuffer across "
            f"hosts first, or use backend='reference' ({e})") from e
    heap = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    heap.zero_()
    torch.cuda.synchronize(device)
    hdl = symm_mem.rendezvous(heap, group.group_name)
    dist.barrier(group=group)
    return heap, hdl


class HostsPeerEP:
    """The two-level kernels across hosts on a SHMEM heap: launches, handle slots, counters.
    ``buf`` is the ``EPBuffer`` (its group, sizes, dtype, FP8, timeout and ``hosts``)."""

    def __init__(self, buf, num_blocks: int | None = None):
        import torch.distributed as dist

        from ...errors import UnsupportedConfigError
        from ...runtime.shmem import (ShmemLauncher, device_functions_available, layer_name,
                                      this_build_shmem)
        from .kernels import combine as HC
        from .kernels import dispatch as HD
        from ..layout import HANDLE_SLOTS

        self.HD, self.HC = HD, HC
        self.rank, self.W = buf.rank, buf.num_ranks
        hosts = buf.hosts
        self.N, self.R = hosts.num_hosts, hosts.ranks_per_host
        if dist.get_rank() != self.rank:
            raise UnsupportedConfigError(
                "llcomm.EPBuffer: the two-level SHMEM kernels name a rank by its SHMEM PE, the "
                f"rank in the default group; this group's rank {self.rank} is global rank "
                f"{dist.get_rank()}. Create the buffer on the default group")
        if not device_functions_available():
            raise UnsupportedConfigError(
                f"llcomm.EPBuffer: this torch's SHMEM Triton layer ({layer_name()}) has no "
                "device functions here (docs/multihost.md, 'Which torch')")
        self.device = torch.device("cuda", torch.cuda.current_device())
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        nb = num_blocks or default_num_blocks(self.N, self.R, sms)
        self.nb = nb
        self.buf = buf
        self.layout = lay = make_layout(buf.max_tokens, buf.hidden, self.N, self.R,
                                        buf.dtype.itemsize, buf.fp8, buf.num_experts, nb)
        self.heap, hdl = _shmem_heap(lay.total_bytes, self.device, buf.group)
        # the region table: own base for the rail puts (a symmetric address), the peer
        # addresses of this host's ranks for the stores inside the host
        table = [0] * self.W
        host = self.rank // self.R
        for q in range(host * self.R, (host + 1) * self.R):
            table[q] = self.heap.data_ptr() if q == self.rank else int(hdl.buffer_ptrs[q])
        missing = [q for q in range(host * self.R, (host + 1) * self.R) if not table[q]]
        if missing:
            raise UnsupportedConfigError(
                f"llcomm.EPBuffer: SHMEM gives no peer address of ranks {missing} of this "
                "host; the two-level kernels store into them directly (peer memory)")
        self.tab = torch.tensor(table, dtype=torch.int64, device=self.device)
        self.timeout_us = buf.timeout_ms * P.US_PER_MS
        self.ctrl = torch.zeros((2, nb), dtype=torch.int64, device=self.device)
        #: the wire ledger of the latest dispatch [0] and combine [1]: per block and other host,
        #: the messages, flags and bytes sent (the kernels count them)
        self.ledger = torch.zeros((2, nb, self.N, 3), dtype=torch.int64, device=self.device)
        self.shmem = this_build_shmem()
        self._host = torch.zeros(2, dtype=torch.int64, device="cpu", pin_memory=True)
        self._host_np = self._host.numpy()
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int64, device=self.device)
        self.masks = int(buf.enable_masks)
        self.err[1:3] = torch.tensor([self._host.data_ptr(), self._host.data_ptr() + 8],
                                    dtype=torch.int64, device="cpu")
        self._failure = P.FailureLatch(self.rank, "EPBuffer")
        T, L, W, N = buf.max_tokens, buf.num_local_experts, self.W, self.N
        dev = self.device
        self.slots = [dict(row_of=torch.zeros(W * T * MAX_TOPK, dtype=torch.int32, device=dev),
                           src_info=torch.zeros((L, W * T), dtype=torch.int32, device=dev),
                           recv_count=torch.zeros(L, dtype=torch.int32, device=dev),
                           ntok=torch.zeros(W, dtype=torch.int32, device=dev),
                           fwd_ids=torch.zeros(N * T * MAX_TOPK, dtype=torch.int32, device=dev),
                           fwd_ntok=torch.zeros(N, dtype=torch.int32, device=dev),
                           w_of=torch.zeros(W * T * MAX_TOPK, dtype=torch.float32, device=dev))
                      for _ in range(HANDLE_SLOTS)]
        self._dispatch = ShmemLauncher(HD.hosts_dispatch_kernel)
        self._combine = ShmemLauncher(HC.hosts_combine_kernel)
        self._consts: dict = {}
        self._last = 0          # the latest op: 0 dispatch, 1 combine

    def _call_consts(self, topk: int, fp8: int):
        hit = self._consts.get((topk, fp8))
        if hit is None:
            hit = self._consts[(topk, fp8)] = hosts_consts(self.layout, self.buf.num_experts,
                                                           topk, fp8)
        return hit

    def _launch(self, launcher, args, consts, stages, num_warps, extra=None):
        stats = int(args[-1] is not None)       # wait statistics: the last argument
        launcher((self.nb,), args, dict(consts, STAGES=stages, SHMEM=self.shmem,
                                        MASKS=self.masks, STATS=stats, num_warps=num_warps,
                                        **(extra or {})))

    def dispatch(self, x, topk_idx, recv_x, slot: int, fp8: int = 0, recv_scales=None,
                 split: bool = False, wait_stats=None, topk_weights=None):
        """Launch the dispatch into handle slot ``slot`` (``split``: its send half, and return
        the launch of its receive half as the fourth value; ``wait_stats``: a ``[W]`` int64
        tensor the waits add to; ``topk_weights``: carried with the ids, so the combine sends
        none across hosts). Returns (recv_count, src_info, state, receive half or None)."""
        HD = self.HD
        self._last = 0
        n, K = topk_idx.shape
        s = self.slots[slot]
        T, W, N = self.buf.max_tokens, self.W, self.N
        row_of = s["row_of"][:W * T * K].view(W, T, K)
        fwd_ids = s["fwd_ids"][:N * T * K].view(N, T, K)
        w_of = s["w_of"][:W * T * K].view(W, T, K)
        if fp8:
            recv_x = recv_x.view(torch.uint8)
        if x.data_ptr() % 16:
            x = x.clone()           # rows are staged as aligned int32 words
        dc, _, warps = self._call_consts(K, fp8)
        tag = size_tag(P.OP_DISPATCH, self.buf.hidden, K, fp8, self.buf.dtype)
        args = (x, topk_idx, n, recv_x, recv_scales if fp8 else recv_x, row_of, s["src_info"],
                s["recv_count"], s["ntok"], fwd_ids, s["fwd_ntok"], self.tab, self.ctrl[0],
                self.err, self.rank, tag, self.timeout_us, self.ledger[0], wait_stats)
        carry = int(topk_weights is not None)
        extra = dict(wts=topk_weights, w_of=w_of if carry else None, CARRY=carry)
        state = (row_of, s["ntok"], fwd_ids, s["fwd_ntok"], w_of if carry else None)
        if not split:
            self._launch(self._dispatch, args, dc, HD.HOSTS_DISPATCH_ALL, warps, extra)
            return s["recv_count"], s["src_info"], state, None
        self._launch(self._dispatch, args, dc, HD.HOSTS_DISPATCH_SEND_HALF, warps, extra)
        return s["recv_count"], s["src_info"], state, lambda: self._launch(
            self._dispatch, args, dc, HD.HOSTS_DISPATCH_RECV_HALF, warps, extra)

    def _combine_args(self, expert_out, topk_idx, topk_weights, state, out, wait_stats,
                      rail_fp8: bool):
        """The combine's arguments, constexprs, warps, and its keywords: the handle's weights
        (``w_of``) when the dispatch carried them (``topk_weights`` then only fills the
        argument the kernel does not read), and ``RAIL_FP8``, which enters the flags' tag."""
        row_of, ntok, fwd_ids, fwd_ntok, w_of = state
        K = topk_idx.shape[1]
        _, cc, warps = self._call_consts(K, 0)
        extra = dict(w_of=w_of, CARRIED=int(w_of is not None), RAIL_FP8=int(rail_fp8))
        if topk_weights is None:
            topk_weights = w_of
        tag = size_tag(P.OP_COMBINE, self.buf.hidden, K, int(rail_fp8), self.buf.dtype)
        args = (expert_out, topk_idx, topk_weights, topk_idx.shape[0], out, row_of, ntok,
                fwd_ids, fwd_ntok, self.tab, self.ctrl[1], self.err, self.rank, tag,
                self.timeout_us, self.ledger[1], wait_stats)
        return args, cc, warps, extra

    def combine(self, expert_out, topk_idx, topk_weights, state, out, carried: bool = False,
                wait_stats=None, rail_fp8: bool = False):
        """``carried``: the dispatch carried the weights (they are in the handle's state);
        ``topk_weights`` is then not read. ``rail_fp8``: the host sums cross hosts in FP8."""
        self._last = 1
        args, cc, warps, extra = self._combine_args(expert_out, topk_idx, topk_weights, state,
                                                    out, wait_stats, rail_fp8)
        self._launch(self._combine, args, cc, self.HC.HOSTS_COMBINE_ALL, warps, extra)
        return out

    def combine_send(self, expert_out, topk_idx, topk_weights, state, out,
                     carried: bool = False, wait_stats=None, rail_fp8: bool = False):
        """Launch the combine's send half; return the launch of its receive half."""
        self._last = 1
        args, cc, warps, extra = self._combine_args(expert_out, topk_idx, topk_weights, state,
                                                    out, wait_stats, rail_fp8)
        self._launch(self._combine, args, cc, self.HC.HOSTS_COMBINE_SEND_HALF, warps, extra)
        return lambda: self._launch(self._combine, args, cc, self.HC.HOSTS_COMBINE_RECV_HALF,
                                    warps, extra)

    def wire_ledger(self, op: int) -> dict:
        """What this rank sent across hosts in the latest dispatch (op 0) or combine (op 1), as
        the kernels counted it: ``{rank: (messages, flags, bytes)}`` per destination (its rail
        rank on each other host; synchronises with the device)."""
        return ledger_by_rank(self.ledger[op], self.rank, self.R)

    def rail_bytes(self, op: int) -> int:
        """Bytes this rank put on the rail in the latest dispatch (op 0) or combine (op 1):
        the messages' bytes and 8 per flag (synchronises with the device)."""
        return ledger_bytes(self.ledger[op])

    @property
    def inter_host_bytes(self) -> int:
        """``rail_bytes`` of the latest op (EPBuffer.last_inter_host_bytes)."""
        return self.rail_bytes(self._last)

    # rank masks (EPBuffer(enable_masks=True)): err[ERR_MASK], as on one host
    def query_mask(self) -> torch.Tensor:
        ranks = torch.arange(self.W, dtype=torch.int64, device=self.device)
        return ((self.err[ERR_MASK] >> ranks) & 1).to(torch.int32)

    def clean_mask(self) -> None:
        self.err[ERR_MASK].zero_()

    def set_mask(self, rank: int, masked: bool) -> None:
        update_mask_word(self.err, rank, masked)

    def source_rank(self, phase: int, i: int) -> int:
        """The rank a wait's source index i names in an error word: host waits ("data poll")
        number this host's ranks, rail waits (entry and exit barriers) the hosts."""
        host, local = divmod(self.rank, self.R)
        return host * self.R + i if phase == P.PHASE_DATA else i * self.R + local

    def precheck(self) -> None:
        self._failure.check(self._host_np[0], self.source_rank)

    # the error words are laid out as the single-host peer backend's, and read the same way
    take_bad_count = PeerEP.take_bad_count

    def close(self) -> None:
        self.heap = None
