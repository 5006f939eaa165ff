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

from ..runtime import protocol as P
from .hosts_layout import HostsLayout, hosts_layout
from .layout import DEFAULT_NUM_BLOCKS, MAX_TOPK

#: 16-byte vectors each thread keeps of a row (as the single-host kernels: peer.py).
VECTORS_PER_THREAD = 4
MAX_WARPS = 16


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def hosts_consts(lay: HostsLayout, num_experts: int, topk: int, fp8: int):
    """(dispatch constexprs, combine constexprs, num_warps) of the two-level kernels for a
    layout, the experts, a call's top-k and FP8 mode (0, 1, 2); STAGES and SHMEM are the
    caller's."""
    from . import peer
    from .kernels.hosts_combine import HostCombineRegions
    from .kernels.hosts_dispatch import HostDispatchRegions, HostSizes
    N, R, T, H, NB = (lay.num_hosts, lay.ranks_per_host, lay.max_tokens, lay.hidden,
                      lay.num_blocks)
    W = N * R
    hp = _pow2(H)
    scales = H // 128 if fp8 else 0
    sizes = peer._bundle(
        HostSizes, N=N, R=R, W=W, T=T, H=H, HP=hp, K=topk, KP=_pow2(topk), E=num_experts,
        L=num_experts // W, NB=NB, ROW_BYTES=lay.row_bytes,
        RX_WORDS=(H if fp8 else H * lay.itemsize) // 4, SCALES=scales,
        SCALES_P2=max(1, hp // 128), RAIL_FLAGS_P2=_pow2(NB * N), HOST_FLAGS_P2=_pow2(NB * R))
    o = lay.offsets
    d_regions = peer._bundle(
        HostDispatchRegions, SET_BYTES=lay.set_bytes, IDS_BYTES=lay.ids_block_bytes(),
        RAIL_SIG=o["d_rail_sig"], HOST_SIG=o["d_host_sig"], STAGE_IDS=o["d_stage_ids"],
        STAGE=o["d_stage"], RAIL_IDS=o["d_rail_ids"], RAIL_ROWS=o["d_rail_rows"],
        HOST_NTOK=o["d_host_ntok"], HOST_IDS=o["d_host_ids"], HOST_ROWS=o["d_host_rows"])
    c_regions = peer._bundle(
        HostCombineRegions, SET_BYTES=lay.set_bytes, RAIL_SIG=o["c_rail_sig"],
        HOST_SIG=o["c_host_sig"], PART_SIG=o["c_part_sig"], BACK_SIG=o["c_back_sig"],
        STAGE_W=o["c_stage_w"], RAIL_W=o["c_rail_w"], HOST_W=o["c_host_w"], PART=o["c_part"],
        STAGE_BACK=o["c_stage_back"], BACK=o["c_back"])
    num_warps = max(1, min(MAX_WARPS, hp // (32 * (16 // lay.itemsize) * VECTORS_PER_THREAD)))
    return (dict(SIZES=sizes, REGIONS=d_regions, FP8=fp8),
            dict(SIZES=sizes, REGIONS=c_regions, enable_fp_fusion=False), num_warps)


def make_layout(max_tokens: int, hidden: int, num_hosts: int, ranks_per_host: int,
                itemsize: int, fp8: bool, num_blocks: int = DEFAULT_NUM_BLOCKS) -> HostsLayout:
    """The region of a buffer: id slots sized for MAX_TOPK, as ``size_hint`` takes no top-k."""
    return hosts_layout(max_tokens, hidden, num_hosts, ranks_per_host, MAX_TOPK, itemsize,
                        num_blocks, fp8)


def size_tag(op: int, hidden: int, topk: int, fp8: int, dtype: torch.dtype) -> int:
    """The flags' tag of a call: ranks that disagree about the shape or FP8 mode mismatch."""
    return P.size_tag(op, (hidden * 4 + fp8) * 64 + topk, str(dtype).removeprefix("torch."))
