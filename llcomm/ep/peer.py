"""The peer backend of ``EPBuffer``: the symmetric region, handle slots, the kernels'
constexprs and their launches (kernels in ``llcomm/ep/kernels``)."""
from __future__ import annotations


import torch

from ..errors import UnsupportedConfigError
from ..runtime import protocol as P
from ..runtime.settings import EPSettings
from ..runtime.fp8_format import FP8_BLOCK
from .masks import update_mask_word
from .layout import (ARM_BYTE, ERR_PROF, MAX_TOPK, NUM_SETS, PROF_WORDS, default_num_blocks,
                     ep_layout, num_sets)

#: Tokens per top-k tile in the dispatch kernel's count and prefix scan, at most; fewer when a
#: block owns many experts, so the scan's compare tile (tokens x top-k x the block's experts)
#: stays within SCAN_TILE_ELEMS. Each tile is a dependent global load plus block-wide sums.
#: 128 beat 32 at 128 tokens by 2.1 us (bench/results/ab/2026-11-30-ep-block-shape/).
TOPK_TILE_TOKENS = 128
SCAN_TILE_ELEMS = 8192
#: The scan's tile when one tile of this many tokens covers them all: faster at 1 token, slower
#: as the only tile size at 128, so it only ever runs once
#: (bench/results/ab/2026-11-30-ep-block-shape/).
SMALL_SCAN_TILE = 16
# The EP settings (EPSettings, llcomm/runtime/settings.py, read once by EPBuffer): blocks,
# the LL or the flag dispatch, profiling; only LLCOMM_EP_LL and LLCOMM_EP_NUM_BLOCKS change
# what crosses between ranks.
#: Largest buffer (max tokens per rank) that runs the LL dispatch unless LLCOMM_EP_LL says
#: otherwise: faster than the flag dispatch up to it, slower with the buffer for 512 tokens,
#: whose receive slots it arms again after every read (bench/results/ab/2026-11-30-ep-ll-dispatch/).
LL_MAX_TOKENS = 256
#: Local experts summed per step when the dispatch kernel writes recv_count.
COUNT_CHUNK = 1024
#: 16-byte vectors each thread keeps of a token row (sets num_warps from hidden: 8 warps at
#: hidden 7168 bf16 beat 16 in both dispatches: bench/results/ab/2026-11-30-ep-block-shape/).
VECTORS_PER_THREAD = 4
MAX_WARPS = 16


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ll_dispatch(settings: EPSettings, max_tokens: int) -> int:
    """Whether the LL dispatch runs: ``LLCOMM_EP_LL`` when set, else 1 (the LL dispatch) for
    buffers of at most LL_MAX_TOKENS tokens per rank. The rule follows the buffer, which every
    rank shares, never a call's token count, which ranks do not."""
    return int(max_tokens <= LL_MAX_TOKENS) if settings.ll is None else settings.ll


def _bundle(kind, **members):
    """A constexpr bundle whose members are ``tl.constexpr`` themselves, as a compiled kernel
    needs them for shapes and ``tl.static_range`` (Triton 3.6 takes no plain int there; 3.7 and
    later wrap one). Plain ints for kernels made for the interpreter, which runs Python and
    has no constexprs: there ``constexpr + tensor`` would wrap the tensor."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from . import kernels
    if isinstance(kernels.combine_kernel, InterpretedFunction):
        return kind(**members)
    return kind(**{k: tl.constexpr(v) for k, v in members.items()})


def ll_row_consts(lay, fp8: int) -> dict:
    """``ROW`` of the dispatch kernels for an FP8 mode: FP8 scales per row and their pow2, and
    the int32 words per row slot of the LL dispatch (FP8: e4m3 bytes, four to a word; else
    buffer-dtype rows) and the power of two above."""
    from .kernels import RowFormat
    ns = lay.hidden // FP8_BLOCK if lay.hidden % FP8_BLOCK == 0 else 1
    words = (lay.hidden if fp8 else lay.hidden * lay.itemsize) // 4
    return dict(ROW=_bundle(RowFormat, SCALES=ns, SCALES_P2=_pow2(ns), WORDS=words,
                            WORDS_P2=_pow2(words)))


def scan_tile(lay, topk: int) -> int:
    """Tokens per tile of the dispatch's top-k scan: TOPK_TILE_TOKENS, fewer (a power of two)
    when the compare tile of top-k x the block's experts would pass SCAN_TILE_ELEMS."""
    per_token = _pow2(topk) * _pow2(-(-lay.num_experts // lay.num_blocks))
    tile = max(1, min(TOPK_TILE_TOKENS, SCAN_TILE_ELEMS // per_token))
    return 1 << (tile.bit_length() - 1)


def kernel_consts(lay, topk: int, settings: EPSettings | None = None, *, ll: int | None = None,
                  tile_tokens: int | None = None, small_tile_tokens: int | None = None,
                  in_flight: int | None = None):
    """Constexprs of the dispatch kernel and of ``combine_kernel`` for a layout and a top-k (all
    but STAGES, and FP8 of the dispatch; MASKS and STATS are 0: set them to 1 for rank masks
    and wait statistics, whose kernels then take a ``stats`` pointer), and num_warps.
    ``settings``: the buffer's (None: read now). The dispatch is ``ll_dispatch_kernel`` when
    ``ll`` (by default ``ll_dispatch`` of the buffer's tokens), else ``flag_dispatch_kernel``;
    ``dispatch_kernel`` names it. Shared with tools/ptx_ep.py and the interpreter tests (which
    pick small tiles with ``tile_tokens`` / ``small_tile_tokens`` so a few tokens span
    several). ``in_flight``: the buffer's sends in flight (IN_FLIGHT; by default from the
    layout's sets)."""
    from .kernels import CombineRegions, DispatchRegions, Sizes, Tiling
    if settings is None:
        settings = EPSettings.read()
    W, T, H, E, nb = lay.num_ranks, lay.max_tokens, lay.hidden, lay.num_experts, lay.num_blocks
    L = E // W
    off = lay.offsets()
    hp = _pow2(H)
    num_warps = max(1, min(MAX_WARPS, hp // (32 * (16 // lay.itemsize) * VECTORS_PER_THREAD)))
    if ll is None:
        ll = ll_dispatch(settings, T)
    sizes = _bundle(Sizes, MAX_TOKENS=T, H=H, HP=hp, K=topk, KP=_pow2(topk), E=E, L=L, W=W,
                    WP=_pow2(W), NB=nb, MAX_TOPK=lay.max_topk)
    if tile_tokens is None:
        tile_tokens = scan_tile(lay, topk)
    small = min(tile_tokens, SMALL_SCAN_TILE if small_tile_tokens is None else small_tile_tokens)
    tiling = _bundle(Tiling, EXPERTS_PER_BLOCK=_pow2(-(-E // nb)), SCAN_TILE=tile_tokens,
                     SMALL_SCAN_TILE=small, TOKENS_PER_BLOCK=_pow2(-(-T // nb)),
                     COUNT_CHUNK=min(_pow2(L), COUNT_CHUNK), FLAGS_P2=_pow2(nb * W))
    regions = _bundle(DispatchRegions, SET_BYTES=lay.set_bytes, SIGNAL=off["signal"],
                      ROWS=off["recv_x"], META=off["recv_meta"], COUNTS=off["recv_count"],
                      NTOK=off["recv_ntok"], SCALES=off["recv_scales"],
                      WEIGHTS_LL=off["recv_weights"], SETS=lay.num_sets)
    # sends in flight (IN_FLIGHT: one counter, or a send and a receive counter)
    if in_flight is None:
        in_flight = max(1, lay.num_sets // NUM_SETS)
    d = dict(SIZES=sizes, REGIONS=regions, TILING=tiling, **ll_row_consts(lay, 0), PROFILE=0,
             STATS=0, CARRY=0, IN_FLIGHT=in_flight)
    if not ll:
        d.update(MASKS=0)
    c = dict(SIZES=sizes, REGIONS=_bundle(CombineRegions, SET_BYTES=lay.set_bytes,
                                          SIGNAL=off["signal"], PARTIALS=off["combine_x"],
                                          WEIGHTS=off["combine_weights"], SETS=lay.num_sets),
             MASKS=0, PROFILE=0, STATS=0, CARRIED=0, IN_FLIGHT=in_flight)
    return d, c, num_warps


def dispatch_kernel(ll: int):
    """The dispatch kernel ``kernel_consts(..., ll=ll)`` is for."""
    from . import kernels
    return kernels.ll_dispatch_kernel if ll else kernels.flag_dispatch_kernel


class PeerEP:
    """The peer backend of EPBuffer: symmetric region, counters, handle slots, launches."""

    def __init__(self, buf):
        from . import kernels
        from ..runtime.launch import Launcher
        from ..runtime.workspace import SymmetricWorkspace

        self.k = kernels
        self.rank, self.W = buf.rank, buf.num_ranks
        self.device = torch.device("cuda", torch.cuda.current_device())
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.settings = settings = buf.settings
        self.nb = nb = default_num_blocks(settings.num_blocks, sms)
        if nb > sms:
            raise UnsupportedConfigError(
                f"llcomm.EPBuffer: LLCOMM_EP_NUM_BLOCKS={nb} exceeds this GPU's {sms} SMs; every "
                "block of a dispatch waits for the others, so all must be resident")
        itemsize = buf.dtype.itemsize
        self.layout = lay = ep_layout(buf.max_tokens, buf.hidden, self.W, buf.num_experts,
                                      itemsize, num_blocks=nb, fp8=buf.fp8,
                                      sets=num_sets(buf.sends_in_flight))
        self.buf = buf
        self.timeout_us = buf.timeout_ms * P.US_PER_MS
        # the receive slots start in the LL dispatch's idle state (ep_layout.ARM_BYTE), set on
        # every rank before any rank's first dispatch can write there
        self.ws = SymmetricWorkspace(buf.group, {"ep": lay.total_bytes}, self.device,
                                     fill={"ep": [(a, b, ARM_BYTE) for a, b in
                                                  lay.armed_ranges()]})
        self.tab = self.ws.table("ep")
        self.ll = 0 if buf.enable_masks else ll_dispatch(settings, buf.max_tokens)
        self.dispatch_kernel = dispatch_kernel(self.ll)
        self.combine_kernel = kernels.combine_kernel
        self._rows = [ll_row_consts(lay, fp8) for fp8 in range(3)]     # ROW by FP8 mode
        # per op [NB]; two sends in flight: [2, NB], a send and a receive counter (_seq_at)
        shape = (2, nb) if buf.sends_in_flight == 1 else (2, 2, nb)
        self.ctrl = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self._ctrl = (self.ctrl[0], self.ctrl[1])   # dispatch's, combine's (made once: a view
        #                                             costs microseconds per eager call)
        # err[0]: device error word; err[1]: host address of the error word; err[2]: host
        # address of the out-of-range top-k count. Pinned host memory is mapped into the GPU's
        # address space, so kernels store to it and the host reads it without a sync.
        self._host = torch.zeros(2, dtype=torch.int64, device="cpu", pin_memory=True)
        self._host_np = self._host.numpy()
        # err[3]: rank mask (bit s: rank s masked); err[4]: the mask the blocks of the latest
        # dispatch agreed on, with its epoch (kernels/common.py: ERR_MASK, ERR_VERDICT).
        self.masks = int(buf.enable_masks)
        # err[ERR_PROF:]: stage stamps of each block when LLCOMM_EP_PROFILE=1 (tools/ep_timeline.py)
        self.profile = settings.profile
        self.err = torch.zeros(ERR_PROF + 2 * nb * PROF_WORDS, dtype=torch.int64,
                               device=self.device)
        self.err[1:3] = torch.tensor([self._host.data_ptr(), self._host.data_ptr() + 8],
                                    dtype=torch.int64, device="cpu")
        L, T = buf.num_local_experts, buf.max_tokens
        # handle slot (int32 words): row_of [W, T, K <= MAX_TOPK] | src_info [L, W T] |
        # recv_count [L] | ntok [W]
        self._slot_words = (self.W * T * MAX_TOPK, L * self.W * T, L, self.W)
        self.slots = [torch.zeros(sum(self._slot_words), dtype=torch.int32, device=self.device)
                      for _ in range(lay.num_sets)]
        self._failure = P.FailureLatch(self.rank, "EPBuffer")
        self._launch = Launcher(self.device, settings.pdl)
        self._call_consts: dict = {}        # (op, top-k, modes) -> one call's constexprs
        self._slot_views: dict = {}         # (slot, top-k) -> _views
        self.num_warps = kernel_consts(lay, 1, settings)[2]
        self._tags: dict = {}

    def _views(self, slot: int, topk: int):
        hit = self._slot_views.get((slot, topk))
        if hit is None:
            hit = self._slot_views[(slot, topk)] = self._make_views(slot, topk)
        return hit

    def _make_views(self, slot: int, topk: int):
        words = self.slots[slot]
        a, b, c, _ = self._slot_words
        W, T = self.W, self.buf.max_tokens
        row_of = words[:W * T * topk].view(W, T, topk)
        src_info = words[a:a + b].view(self.buf.num_local_experts, W * T)
        recv_count = words[a + b:a + b + c]
        ntok = words[a + b + c:]
        return row_of, src_info, recv_count, ntok

    def _consts(self, op: str, topk: int, fp8: int, carry: int) -> dict:
        """The constexprs of one ``op`` ("dispatch" or "combine") call, kept per top-k, FP8
        mode and carried weights (``carry``; the combine's CARRIED); callers copy to change."""
        key = (op, topk, fp8, carry)
        hit = self._call_consts.get(key)
        if hit is None:
            d, c, _ = kernel_consts(self.layout, topk, self.settings, ll=self.ll,
                                    in_flight=self.buf.sends_in_flight)
            if op == "dispatch":
                hit = dict(d, STAGES=self.k.DISPATCH_ALL, PROFILE=self.profile, FP8=fp8,
                           CARRY=carry)
                if self.ll:
                    hit.update(self._rows[fp8])
                else:
                    hit.update(MASKS=self.masks)
            else:
                hit = dict(c, STAGES=self.k.COMBINE_ALL, MASKS=self.masks, PROFILE=self.profile,
                           enable_fp_fusion=False, CARRIED=carry)
            self._call_consts[key] = hit
        return hit

    def _tag(self, op: int, topk: int, fp8: int = 0, carry: int = 0) -> int:
        key = (op, topk, fp8, carry)
        if key not in self._tags:
            # fp8 and carry in the tag: ranks that disagree about use_fp8 / round_scale, or
            # about whether the weights travel with the dispatch, are a mismatch
            self._tags[key] = P.size_tag(op, ((self.buf.hidden * 4 + fp8) * 2 + carry) * 64
                                         + topk, _name(self.buf.dtype))
        return self._tags[key]

    def dispatch(self, x, topk_idx, recv_x, slot: int, fp8: int = 0, recv_scales=None,
                 split: bool = False, weights=None, stats=None, deep=None):
        """Launch the dispatch (``split``: its send half only, and return the launch of its
        receive half as the fourth value; otherwise that is None). ``weights``: push them too,
        into handle slot ``slot``'s weights region (set ``slot``; kernels/__init__.py).
        ``stats``: a ``[W]`` int64 tensor the kernel adds its wait times to (STATS). ``deep``:
        a ``DeepEPOutputs`` the receive stage writes DeepEP's layouts into (DEEP_EP), its
        scales being ``recv_scales``."""
        K = topk_idx.shape[1]
        row_of, src_info, recv_count, ntok = self._views(slot, K)
        if fp8:
            recv_x = recv_x.view(torch.uint8)       # the kernel moves e4m3 as bytes
        carry = int(weights is not None)
        w_off = self.layout.sets[slot].dispatch_weights
        if self.ll and x.data_ptr() % 16:
            x = x.clone()           # the LL dispatch reads rows as aligned int32 words
        args = (x, topk_idx, x.shape[0], recv_x, recv_scales if fp8 else recv_x, row_of,
                src_info, recv_count, ntok, self.tab, self._ctrl[0], self.err, self.rank,
                self._tag(P.OP_DISPATCH, K, fp8, carry), self.timeout_us,
                weights if carry else topk_idx, w_off, stats)
        consts = self._consts("dispatch", K, fp8, carry)
        if stats is not None:       # the kernels' STATS variant (None: a constexpr, no code)
            consts = dict(consts, STATS=1)
        if deep is None:
            args += (None, None, None)
        else:
            args += (deep.src_info, deep.layout_range, deep.stats)
            consts = dict(consts, DEEP_EP=self.k.DEEP_EP_UE8M0 if deep.ue8m0 else
                          self.k.DEEP_EP_FP32)
        state = (row_of, ntok, w_off if carry else None)
        if not split:
            self._launch(self.dispatch_kernel, self.nb, args, self.num_warps, **consts)
            return recv_count, src_info, state, None
        consts = dict(consts, STAGES=self.k.DISPATCH_SEND_HALF)
        self._launch(self.dispatch_kernel, self.nb, args, self.num_warps, **consts)
        recv = dict(consts, STAGES=self.k.DISPATCH_RECV_HALF)
        return recv_count, src_info, state, lambda: self._launch(
            self.dispatch_kernel, self.nb, args, self.num_warps, **recv)

    def _combine_args(self, expert_out, topk_idx, topk_weights, state, out, stats=None):
        """Kernel arguments and constexprs; with weights carried by the dispatch (``state``'s
        weights offset set) ``topk_weights`` is None and the kernel reads the handle slot's.
        ``stats``: as in ``dispatch``."""
        row_of, ntok, w_off = state
        K = topk_idx.shape[1]
        carried = int(w_off is not None)
        args = (expert_out, topk_idx, topk_idx if carried else topk_weights, topk_idx.shape[0],
                out, row_of, ntok, self.tab, self._ctrl[1], self.err, self.rank,
                self._tag(P.OP_COMBINE, K, 0, carried), self.timeout_us,
                w_off if carried else 0, stats)
        consts = self._consts("combine", K, 0, carried)
        return args, (consts if stats is None else dict(consts, STATS=1))

    def combine(self, expert_out, topk_idx, topk_weights, state, out, stats=None):
        args, consts = self._combine_args(expert_out, topk_idx, topk_weights, state, out, stats)
        self._launch(self.combine_kernel, self.nb, args, self.num_warps, **consts)
        return out

    def combine_send(self, expert_out, topk_idx, topk_weights, state, out, stats=None):
        """Launch the combine's send half; return the launch of its receive half."""
        args, consts = self._combine_args(expert_out, topk_idx, topk_weights, state, out,
                                          stats)
        self._launch(self.combine_kernel, self.nb, args, self.num_warps,
                     **dict(consts, STAGES=self.k.COMBINE_SEND_HALF))
        recv = dict(consts, STAGES=self.k.COMBINE_RECV_HALF)
        return lambda: self._launch(self.combine_kernel, self.nb, args, self.num_warps, **recv)

    def query_mask(self) -> torch.Tensor:
        word = self.err[self.k.ERR_MASK.value]
        ranks = torch.arange(self.W, dtype=torch.int64, device=self.device)
        return ((word >> ranks) & 1).to(torch.int32)

    def clean_mask(self) -> None:
        self.err[self.k.ERR_MASK.value].zero_()

    def set_mask(self, rank: int, masked: bool) -> None:
        update_mask_word(self.err, rank, masked)

    def take_bad_count(self) -> int:
        """Out-of-range top-k entries seen since the last call: the kernels store the count
        into pinned host memory, so this needs no synchronisation (what has not landed yet
        is read at the next call)."""
        bad = int(self._host_np[1])
        if bad:
            self._host_np[1] = 0
        return bad

    def precheck(self) -> None:
        self._failure.check(self._host_np[0])

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
