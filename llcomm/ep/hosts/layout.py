"""Byte layout of the two-level EP region (ranks on several hosts), and its size.

Pure arithmetic, like ``layout.py`` for the single-host region. ``N`` hosts of ``R`` ranks
(``W = N * R``), ``T`` max tokens per rank, top-k ``K``, a row of ``row_bytes`` (buffer-dtype
rows, or e4m3 bytes then fp32 scales; padded to 16 bytes). The kernels are in
``kernels/dispatch.py`` and ``kernels/combine.py``; docs/multihost.md has the
protocol. *Rail* regions are written across hosts (SHMEM puts), *host* regions over peer
memory inside a host, *stage* regions only by their own rank (the source of a put must be in
the symmetric heap).

One buffer set (two of them, used alternately by consecutive dispatches and, separately, by
consecutive combines)::

    dispatch
      d_rail_sig   int64 [N]            the id block of each source host has arrived
      d_row_sig    int64 [N, T]         the row of each source host's token t has arrived
      d_host_sig   int64 [NB, R]        from each forwarder of this host, per block
      d_host_entry int64 [R]            each rank of this host has begun the call (masks)
      d_stage_ids  int32 [HEADER + 2 T K]  own token count, own top-k ids, then (weights
                                        carried) own top-k weights (fp32)   (put source)
      d_stage      [T, row]             own rows, quantised for FP8          (put source)
      d_rail_ids   int32 [N, HEADER + T K]  each source host's d_stage_ids
      d_rail_rows  [N, T, row]          rows from each source host (only tokens routed here)
      d_host_ntok  int32 [W]            tokens of each source rank
      d_host_cnt   int32 [W, L]         tokens of each source rank routed to each local expert
      d_host_ids   int32 [W, T K]       top-k ids of every token of each source rank
      d_host_w     fp32  [W, T K]       their top-k weights (weights carried by the dispatch)
      d_host_rows  [W, T, row]          rows of each source rank routed to this rank
    combine
      c_rail_sig   int64 [N]            weights (or, carried by the dispatch, only the call's
                                        entry) from each source host (one block sends)
      c_host_sig   int64 [NB, R]        weights forwarded inside the host
      c_host_entry int64 [R]            each rank of this host has begun the call (masks)
      c_part_sig   int64 [N, NB, R]     partials of the rail source on host g, per block and
                                        rank here
      c_back_sig   int64 [N, T]         the host sum of own token t from each host has arrived
      c_stage_w    fp32  [T K]          own top-k weights                    (put source)
      c_rail_w     fp32  [N, T K]       weights from each source host (16-byte strides)
      c_host_w     fp32  [W, T K]       weights of each source rank
      c_part       dtype [R, N, T, H]   partials from each rank of this host, per rail source
      c_stage_back dtype [N, T, H]      host sums for each other host        (put source)
      c_back       dtype [N, T, H]      host sums of own tokens, from each host
"""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import ALIGN, FP8_BLOCK, MAX_WAIT_FLAGS, NUM_SETS

#: int32 words before the top-k ids of a staged id block: the token count, then padding that
#: keeps the ids 16-byte aligned.
ID_HEADER_WORDS = 4
#: Row slots are padded to this many bytes (16-byte vector access).
ROW_ALIGN = 16
#: Words of the two-level kernels' private ``err`` tensor: 0-2 as on one host (device error
#: word, host error and input-error addresses), ``layout.ERR_MASK`` (3) the rank mask, then one
#: word for each of the dispatch's three mask agreements (``kernels/masks.py``).
ERR_INPUT_ADDR = 2
ERR_RAIL_VERDICT = 4
ERR_ENTRY_VERDICT = 5
ERR_HOST_VERDICT = 6
ERR_WORDS = 7

DISPATCH_REGIONS = ("d_rail_sig", "d_row_sig", "d_host_sig", "d_host_entry", "d_stage_ids",
                    "d_stage",
                    "d_rail_ids", "d_rail_rows", "d_host_ntok", "d_host_cnt", "d_host_ids",
                    "d_host_w", "d_host_rows")
COMBINE_REGIONS = ("c_rail_sig", "c_host_sig", "c_host_entry", "c_part_sig", "c_back_sig",
                   "c_stage_w", "c_rail_w", "c_host_w", "c_part", "c_stage_back", "c_back")


def pow2(n: int) -> int:
    """The least power of two >= n (>= 1)."""
    return 1 << max(0, n - 1).bit_length()


def message_lanes(max_tokens: int, num_blocks: int, num_hosts: int) -> int:
    """Lanes of a block's wait for its messages (``kernels/rail.py``, ``rail_wait``): one per
    (own token of the block, host), as powers of two."""
    return pow2(-(-max_tokens // num_blocks)) * pow2(num_hosts)


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def row_bytes(hidden: int, itemsize: int, fp8: bool) -> int:
    """Bytes of one row slot: ``hidden * itemsize``, or for FP8 the e4m3 bytes and one fp32
    scale per FP8_BLOCK channels; padded to ROW_ALIGN."""
    raw = hidden + 4 * (hidden // FP8_BLOCK) if fp8 else hidden * itemsize
    return _align(raw, ROW_ALIGN)


@dataclass(frozen=True)
class HostsLayout:
    """Offsets (set 0; set k adds ``k * set_bytes``) of the two-level region's parts."""

    num_hosts: int
    ranks_per_host: int
    max_tokens: int
    hidden: int
    topk: int
    itemsize: int
    num_blocks: int
    fp8: bool
    row_bytes: int
    offsets: dict
    set_bytes: int
    total_bytes: int

    @property
    def world(self) -> int:
        return self.num_hosts * self.ranks_per_host

    def ids_block_bytes(self) -> int:
        """Bytes of one staged (or received) id block: header, ``T * K`` ids and room for as
        many weights."""
        return _align(4 * (ID_HEADER_WORDS + 2 * self.max_tokens * self.topk))


#: Bytes of the combine's entry message, sent instead of the weights when the dispatch carried
#: them (a put moves whole 16-byte units).
ENTRY_BYTES = 16


def fp8_sum_bytes(hidden: int) -> int:
    """Bytes of a host sum that crosses hosts in FP8 (``combine(rail_fp8=True)``): ``hidden``
    e4m3 bytes, then one fp32 scale per FP8_BLOCK channels, padded to ROW_ALIGN."""
    return _align(hidden + 4 * (hidden // FP8_BLOCK), ROW_ALIGN)


def hosts_layout(max_tokens: int, hidden: int, num_hosts: int, ranks_per_host: int, topk: int,
                 itemsize: int, num_blocks: int, fp8: bool, num_experts: int) -> HostsLayout:
    """The two-level region for these sizes. ``fp8``: rows sized for an FP8 dispatch, else for
    the buffer dtype (a buffer serves one kind; the host side checks calls against it).
    ``num_experts``: sizes the count of each (source, local expert)."""
    N, R, T, K, NB = num_hosts, ranks_per_host, max_tokens, topk, num_blocks
    W = N * R
    if NB * max(N, R) > MAX_WAIT_FLAGS:
        raise ValueError(f"num_blocks={NB} x {max(N, R)} sources exceeds the {MAX_WAIT_FLAGS} "
                         "flags one wait polls")
    if message_lanes(T, NB, N) > MAX_WAIT_FLAGS:
        raise ValueError(f"max_tokens={T} over num_blocks={NB} blocks and {N} hosts: a block "
                         f"would poll more than {MAX_WAIT_FLAGS} message flags at once")
    row = row_bytes(hidden, itemsize, fp8)
    ids = _align(4 * (ID_HEADER_WORDS + 2 * T * K))
    part = hidden * itemsize
    sizes = {
        "d_rail_sig": 8 * N, "d_row_sig": 8 * N * T, "d_host_sig": 8 * NB * R,
        "d_host_entry": 8 * R,
        "d_stage_ids": ids,
        "d_stage": T * row, "d_rail_ids": N * ids, "d_rail_rows": N * T * row,
        "d_host_ntok": 4 * W, "d_host_cnt": 4 * W * max(1, num_experts // W),
        "d_host_ids": W * 4 * T * K, "d_host_w": W * 4 * T * K, "d_host_rows": W * T * row,
        "c_rail_sig": 8 * N, "c_host_sig": 8 * NB * R, "c_host_entry": 8 * R,
        "c_part_sig": 8 * N * NB * R,
        "c_back_sig": 8 * N * T, "c_stage_w": 4 * T * K,
        "c_rail_w": N * _align(4 * T * K, ROW_ALIGN), "c_host_w": W * 4 * T * K,
        "c_part": R * N * T * part, "c_stage_back": N * T * part, "c_back": N * T * part,
    }
    offsets, at = {}, 0
    for name in DISPATCH_REGIONS + COMBINE_REGIONS:
        offsets[name] = at
        at = _align(at + sizes[name])
    return HostsLayout(N, R, T, hidden, K, itemsize, NB, fp8, row, offsets, at, NUM_SETS * at)
