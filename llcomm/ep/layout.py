"""Byte layout of the EP (MoE dispatch / combine) symmetric region, and its size hint.

Pure arithmetic, no torch.distributed and no Triton: ``EPBuffer.size_hint`` and the ``EPBuffer``
constructor both call :func:`ep_layout`, so the bytes a caller reserves and the bytes the
buffer carves up cannot disagree.

Scheme (docs/ep.md): a token crosses NVLink once per destination *rank*, into the slot
``(source rank, source token)`` of that rank's receive region, with one metadata word per top-k
entry; the receiver expands it into the per-expert layout. Combine sends one partial per
``(token, expert rank)`` back into the slot ``(expert rank, token)`` of the source. So every
region is ``num_ranks * max_tokens`` rows, not ``num_experts * max_tokens`` as in a
one-message-per-expert design (DeepEP, the rocSHMEM LL_MoE seed).

One buffer set (two of them, used alternately by consecutive dispatches and, separately, by
consecutive combines; four in turn with two sends in flight, ``num_sets``)::

    signal          int64 [SIGNAL_PHASES, num_blocks, num_ranks]   flags, epoch | tag
    dispatch recv   dtype [num_ranks, max_tokens, hidden]          token rows, slot (src, t)
                    or, for an FP8 dispatch, in the same region:
                    fp8   [num_ranks, max_tokens, hidden]          quantised rows, slot (src, t)
                    fp32  [num_ranks, max_tokens, hidden // 128]   their scales (recv_scales)
    dispatch meta   int64 [num_ranks, max_tokens, MAX_TOPK]        (local expert << 16) | prefix
    dispatch count  int64 [num_ranks, num_local_experts]           tokens per local expert
    dispatch ntok   int64 [num_ranks]                              tokens each source sent
    combine recv    dtype [num_ranks, max_tokens, hidden]          partials, slot (expert rank, t)
    combine weights fp32  [num_ranks, max_tokens, MAX_TOPK]        top-k weights, slot (src, t)
    handle weights  fp32  [num_ranks, max_tokens, MAX_TOPK]        weights carried by dispatch k
    dispatch wts LL int64 [num_ranks, max_tokens, MAX_TOPK]        the same, in flight (LL dispatch)

The metadata, count and ntok words are 8 bytes: the LL dispatch (kernels/dispatch_ll.py) sends
each as ``(epoch << 32) | value``; the flag dispatch uses the low half of each region as int32.
The dispatch receive region is armed with 0xFF bytes when the buffer is made (the LL dispatch's
"not yet written" word; its receiver writes it back after reading a slot).

There is no send region: every push goes straight from the caller's tensor (``x`` in dispatch,
the reduced partial held in registers in combine) into the peer's receive region, so a send
staging area would only add a copy.

FP8 (``fp8=True``): the dispatch receive region is sized for FP8 rows and their scales only
(``hidden + hidden // 32`` bytes per slot instead of ``hidden * itemsize``), and such a buffer
refuses bf16 dispatches. With ``fp8=False`` the region holds the larger of the two, so one buffer
serves both kinds of dispatch (for bf16 and wider the buffer-dtype rows are always the larger).
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: Every sub-region starts on this boundary (16-byte vector access needs 16; 256 matches the
#: workspace's region alignment so offsets stay aligned whatever the base).
ALIGN = 256
#: Largest top-k a buffer accepts. Metadata and weight slots are sized for it, since
#: ``size_hint`` (DeepEP's signature) does not take top-k. 32 covers every released MoE model.
MAX_TOPK = 32
#: Blocks (CTAs) every EP kernel launches; the flag region has one flag per (block, rank).
#: Must not exceed the number of SMs (every block of a dispatch waits for every other block):
#: EPBuffer launches min(DEFAULT_NUM_BLOCKS, SMs). 128 measured faster than 64 on 2xH200 (132
#: SMs) at 128 tokens: dispatch 21.9 vs 25.5 us, combine 21.2 vs 27.5 us, 1 token the same.
DEFAULT_NUM_BLOCKS = 128
#: Most flags one EP wait polls (blocks x ranks): a block polls them across its lanes
#: (kernels/common.py BLOCK_WIDE).
MAX_WAIT_FLAGS = 1024
#: Flag phases per set: dispatch arrival, combine weights arrival, combine partials arrival.
SIGNAL_PHASES = 3
PHASE_DISPATCH, PHASE_COMBINE_WEIGHTS, PHASE_COMBINE_PARTIALS = 0, 1, 2
#: Buffer sets used in turn by a buffer with one send half in flight (double buffering;
#: kernels/__init__.py says why two are enough). With ``sends_in_flight`` D, 2 D sets
#: (``num_sets``): call k uses set k % (2 D).
NUM_SETS = 2
#: Dispatches a handle outlives with one send in flight: handle k uses slot k % 2, which
#: dispatch k + 2 overwrites; set k holds handle slot k's carried weights, so there are as many
#: slots as sets (``num_sets(D)`` with D sends in flight).
HANDLE_SLOTS = NUM_SETS
#: Most send halves of one op (dispatch, combine) a buffer lets be in flight before their
#: receive hooks (``EPBuffer(sends_in_flight=...)``).
MAX_SENDS_IN_FLIGHT = 2


def num_sets(sends_in_flight: int = 1) -> int:
    """Buffer sets (and handle slots) of a buffer with ``sends_in_flight`` send halves in
    flight: twice as many (kernels/__init__.py, "Buffer sets")."""
    return NUM_SETS * sends_in_flight
#: Metadata word: local expert index in the high half, within-source prefix in the low half.
META_SHIFT = 16
MAX_TOKENS_LIMIT = 1 << META_SHIFT          # prefix must fit in the low 16 bits
MAX_LOCAL_EXPERTS_LIMIT = 1 << 15           # local expert index must keep the word positive
#: Rank masks (kernels/common.py ERR_MASK, llcomm/ep/masks.py): the word of the buffer's private
#: ``err`` tensor that holds the mask, bit s for rank s.
ERR_MASK = 3
#: Profiling stamps (kernels/common.py, PROFILE): words of the buffer's private ``err`` tensor from
#: ERR_PROF on, PROF_WORDS per block (six SM-cycle stamps, then global-timer start and end), the
#: dispatch's blocks first, then the combine's.
ERR_PROF = 8
PROF_WORDS = 8
#: FP8 dispatch: channels per fp32 scale (llcomm/runtime/fp8_format.py defines the format).
FP8_BLOCK = 128
#: Bytes of a metadata, count or ntok word: room for an LL word (epoch in the high half).
LL_WORD = 8
#: Byte the dispatch receive region holds while idle: the LL dispatch's "not yet written" int32
#: word is 0xFFFFFFFF (kernels/common.py ROW_SENTINEL).
ARM_BYTE = 0xFF


def default_num_blocks(setting: int | None, sms: int | None = None) -> int:
    """The ``LLCOMM_EP_NUM_BLOCKS`` setting when set (EPSettings.num_blocks; ``size_hint``
    and the constructor both take it, so they agree), else DEFAULT_NUM_BLOCKS (at most ``sms``,
    the GPU's SM count, when given)."""
    if setting is not None:
        return setting
    return DEFAULT_NUM_BLOCKS if sms is None else min(DEFAULT_NUM_BLOCKS, sms)


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class EPSetLayout:
    """Byte offsets of one buffer set's regions, relative to the EP region's base."""

    base: int
    signal: int
    recv_x: int
    recv_scales: int                # FP8 dispatch: scales, inside the recv_x region
    recv_meta: int
    recv_count: int
    recv_ntok: int
    combine_x: int
    combine_weights: int
    dispatch_weights: int           # handle slot k's weights when the dispatch carries them
    recv_weights: int               # LL dispatch: carried weights as LL words, before the copy
    end: int


@dataclass(frozen=True)
class EPLayout:
    """The whole EP region: ``sets[0]``, ``sets[1]`` (and with two sends in flight ``sets[2]``,
    ``sets[3]``), each ``set_bytes`` long."""

    num_ranks: int
    num_experts: int
    hidden: int
    max_tokens: int
    itemsize: int
    num_blocks: int
    max_topk: int
    fp8: bool
    set_bytes: int
    total_bytes: int
    sets: tuple[EPSetLayout, ...] = field(repr=False)

    @property
    def num_sets(self) -> int:
        return len(self.sets)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    def offsets(self) -> dict[str, int]:
        """Offsets of set 0's regions (set ``k`` is these plus ``k * set_bytes``)."""
        s = self.sets[0]
        return {"signal": s.signal, "recv_x": s.recv_x, "recv_scales": s.recv_scales,
                "recv_meta": s.recv_meta,
                "recv_count": s.recv_count, "recv_ntok": s.recv_ntok,
                "combine_x": s.combine_x, "combine_weights": s.combine_weights,
                "dispatch_weights": s.dispatch_weights, "recv_weights": s.recv_weights}

    def armed_ranges(self) -> list[tuple[int, int]]:
        """Byte ranges ``[start, end)`` that hold ARM_BYTE while idle: each set's dispatch
        receive region (rows and FP8 scales)."""
        return [(s.recv_x, s.recv_meta) for s in self.sets]


def check_shape_args(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts,
                     itemsize, fp8: bool = False) -> list[str]:
    """Problems with the sizing arguments (an empty list when they are fine)."""
    bad = []

    def pos_int(name, v):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            bad.append(f"{name}={v!r}; expected a positive int")
            return False
        return True

    ok = all([pos_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
              pos_int("hidden", hidden), pos_int("num_ranks", num_ranks),
              pos_int("num_experts", num_experts)])
    if not ok:
        return bad
    if num_max_dispatch_tokens_per_rank > MAX_TOKENS_LIMIT:
        bad.append(f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}; at most "
                   f"{MAX_TOKENS_LIMIT} (the per-source prefix travels in 16 bits)")
    if num_experts % num_ranks:
        bad.append(f"num_experts={num_experts} is not a multiple of the number of ranks "
                   f"{num_ranks}: every rank must hold the same number of experts")
    elif num_experts // num_ranks >= MAX_LOCAL_EXPERTS_LIMIT:
        bad.append(f"num_experts // num_ranks = {num_experts // num_ranks}; at most "
                   f"{MAX_LOCAL_EXPERTS_LIMIT - 1} local experts per rank")
    if (hidden * itemsize) % 16:
        bad.append(f"hidden={hidden}: a token row of hidden * {itemsize} bytes must be a multiple "
                   "of 16 bytes (the kernels move 16-byte vectors)")
    if fp8 and hidden % FP8_BLOCK:
        bad.append(f"hidden={hidden} with fp8=True: FP8 dispatch needs hidden to be a multiple of "
                   f"{FP8_BLOCK} (one scale per {FP8_BLOCK} channels)")
    return bad


def fp8_dispatch_bytes(num_ranks: int, max_tokens: int, hidden: int) -> int:
    """Bytes of one set's dispatch receive region in FP8: rows, then scales (256-aligned)."""
    rows = num_ranks * max_tokens * hidden
    return _align(rows) + num_ranks * max_tokens * (hidden // FP8_BLOCK) * 4


def ep_layout(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
              num_experts: int, itemsize: int, *, num_blocks: int = DEFAULT_NUM_BLOCKS,
              max_topk: int = MAX_TOPK, fp8: bool = False, sets: int = NUM_SETS) -> EPLayout:
    """Compute the layout. Raises ValueError on arguments no layout can serve.

    ``fp8=True``: the dispatch receive region holds FP8 rows and scales only (FP8 dispatches
    only); ``False``: the larger of buffer-dtype rows and, when hidden is a multiple of 128, FP8
    rows and scales (both kinds of dispatch). ``sets``: buffer sets (``num_sets`` of the
    buffer's sends in flight)."""
    bad = check_shape_args(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts,
                           itemsize, fp8)
    if num_blocks * num_ranks > MAX_WAIT_FLAGS:
        bad.append(f"{num_blocks} blocks x {num_ranks} ranks is more than the {MAX_WAIT_FLAGS} "
                   "flags a wait polls (set LLCOMM_EP_NUM_BLOCKS lower)")
    if bad:
        raise ValueError("llcomm.EPBuffer.size_hint: " + "; ".join(bad))
    W, T, H = num_ranks, num_max_dispatch_tokens_per_rank, hidden
    L = num_experts // W
    fp8_bytes = fp8_dispatch_bytes(W, T, H) if H % FP8_BLOCK == 0 else 0
    recv_bytes = fp8_bytes if fp8 else max(W * T * H * itemsize, fp8_bytes)
    sizes = (
        # sized for DEFAULT_NUM_BLOCKS at least, so a GPU with fewer SMs (fewer blocks) needs
        # the same bytes as size_hint says
        ("signal", 8 * SIGNAL_PHASES * max(num_blocks, DEFAULT_NUM_BLOCKS) * W),
        ("recv_x", recv_bytes),
        ("recv_meta", LL_WORD * W * T * max_topk),
        ("recv_count", LL_WORD * W * L),
        ("recv_ntok", LL_WORD * W),
        ("combine_x", W * T * H * itemsize),
        ("combine_weights", 4 * W * T * max_topk),
        ("dispatch_weights", 4 * W * T * max_topk),
        ("recv_weights", LL_WORD * W * T * max_topk),
    )
    rel, off = {}, 0
    for name, n in sizes:
        rel[name] = off
        off += _align(n)
    set_bytes = off
    rel["recv_scales"] = rel["recv_x"] + _align(W * T * H)
    set_layouts = tuple(EPSetLayout(base=k * set_bytes, end=(k + 1) * set_bytes,
                                    **{name: k * set_bytes + o for name, o in rel.items()})
                        for k in range(sets))
    return EPLayout(num_ranks=W, num_experts=num_experts, hidden=H, max_tokens=T,
                    itemsize=itemsize, num_blocks=num_blocks, max_topk=max_topk, fp8=fp8,
                    set_bytes=set_bytes, total_bytes=sets * set_bytes, sets=set_layouts)


def deepep_low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_ranks: int, num_experts: int) -> int:
    """What DeepEP's low-latency size hint asks for, for comparison (docs/ep.md).

    DeepEP keeps one message per (expert, token) in each of two buffer sets: dispatch messages
    of 16 bytes of header plus ``hidden`` bf16 values, combine messages of ``hidden`` bf16 values
    plus one bf16 pair per 128 values, and send and receive areas sized for the larger of the
    two. ``num_ranks`` does not enter. Our own estimate of its arithmetic, not its code.
    """
    T, H, E = num_max_dispatch_tokens_per_rank, hidden, num_experts
    scales = H // 128
    dispatch_msg = 16 + max(H * 2, H + scales * 4)
    combine_msg = scales * 4 + H * 2
    send = max(T * dispatch_msg, E * T * combine_msg)
    recv = max(E * T * dispatch_msg, E * T * combine_msg)
    signal = _align(E * 4, 128)
    return 2 * (send + recv + signal)
