"""NVFP4: the quantiser and DeepEP's layouts of ``low_latency_dispatch(..., use_nvfp4=True)``.

NVFP4 stores each element as a 4-bit e2m1 code (sign, 2 exponent bits, 1 mantissa bit:
magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``) and one float8_e4m3fn scale per 16 consecutive
elements of a row, under one float32 **global scale** ``gs`` for the whole tensor: the value of
a code is ``E2M1[code] * scale / gs``. The engines' convention is ``gs = 448 * 6 / amax`` of a
calibration (``1 / input_scale`` of a ModelOpt checkpoint), so that the e4m3 scales use their
range. Per block of 16 elements, in float32 (``quantize``):

1. ``amax`` = the largest ``|x|`` of the block (exact: a maximum of the inputs).
2. block scale ``sf = gs * (amax * (1/6))``, ``1/6`` rounded to float32; cast to e4m3 with
   round-to-nearest-even, saturated at 448 (``sf`` is never negative). That byte is the scale.
3. ``out_scale = 1 / (sf_e4m3 * (1 / gs))`` (0 where the e4m3 scale is 0), each operation an
   IEEE float32 one; then ``v = x * out_scale``.
4. ``v`` to e2m1: round to nearest on the grid above, ties to the even code (0.25 -> 0,
   0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), ``|v| > 6`` saturates to 6.
   The sign bit (bit 3) is set where ``v < 0``; a value that rounds to zero keeps it (``-0``,
   code 8), a zero input does not. Non-finite inputs give unspecified codes.
5. Packing: element ``2 j`` is the low nibble (bits 0..3) and element ``2 j + 1`` the high
   nibble (bits 4..7) of byte ``j`` of the row.

This is the recipe of DeepEP's NVFP4 dispatch kernel (``cvt_warp_fp16_to_fp4`` in
``csrc/kernels/internode_ll.cu`` of its ``hybrid-ep`` branch, NVFP4 since its PR 341), where
``cvt.rn.satfinite.e2m1x2.f32`` rounds and packs; that kernel takes the two reciprocals with
``rcp.approx.ftz``, so in rare cases at a rounding boundary it can pick the neighbouring
code; here every step is exact IEEE float32, so the result is a function of the row alone.

**Error bound.** For a block whose scale is a normal e4m3 number (``gs * amax / 6`` in
``[2^-6, 448]``) every element dequantises within ``(17/16) * amax / 6`` of its input: half the
widest e2m1 gap (4 to 6) times a scale that e4m3's rounding leaves within 1/16 of
``amax / 6`` (``DEQUANT_BOUND``); a block of zeros is exact. Smaller block scales lose
precision with e4m3's subnormals (and a block whose ``gs * amax / 6`` is below 2^-10 gets
scale 0: all zeros); larger ones saturate at 448.

**Layouts** (DeepEP's, as its ``deep_ep.cpp`` allocates them; ``L`` local experts,
``R = num_ranks * T`` rows per expert, ``H`` hidden):

- values: uint8 ``[R, H / 2, L]``, a ``permute(1, 2, 0)`` view of a contiguous ``[L, R, H / 2]``
  (row ``r`` of expert ``e`` at ``values[r, :, e]``).
- scales: float8_e4m3fn ``[32, 4, ceil(R / 128), 4, ceil(H / 64), L]``, a
  ``permute(3, 4, 1, 5, 2, 0)`` view of a contiguous ``[L, ceil(R / 128), ceil(H / 64), 32, 4,
  4]``: the scale of block ``j`` of row ``r`` of expert ``e`` is at storage index
  ``[e, r // 128, j // 4, r % 32, (r % 128) // 32, j % 4]``, the 128 x 4 tile layout that
  CUTLASS's block-scaled GEMMs read (FlashInfer's ``grouped_gemm_nt_masked``, which SGLang's
  ``flashinfer_cutedsl_moe_masked`` calls with these two tensors as they come). Padding entries
  (rows past ``R``, blocks past ``H / 16``) are 0 here, unspecified in DeepEP.
"""
from __future__ import annotations

import torch

#: Elements per block scale.
BLOCK = 16
#: The e2m1 magnitudes, by code (bit 3, the sign, excluded).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: ``|x|`` thresholds of codes 1..7 and whether a tie goes up (to an even code).
_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
          (3.5, True), (5.0, False))
#: The scale tile: 128 rows (4 x 32) by 4 blocks.
TILE_ROWS, TILE_BLOCKS = 128, 4
#: ``|dequantised - x| <= DEQUANT_BOUND * amax_of_block`` where the block's scale is normal.
DEQUANT_BOUND = 17 / 16 / E2M1_MAX


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` -> uint8 e2m1 codes (0..15), round to nearest even, saturating."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for bound, tie_up in _STEPS:
        code += (a >= bound if tie_up else a > bound).to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 3)


def quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of ``x [..., H]`` (any float dtype, ``H`` a multiple of 16) under the float32
    one-element ``global_scale`` (module doc): packed codes uint8 ``[..., H / 2]`` and block
    scales float8_e4m3fn ``[..., H / 16]``, both contiguous. Torch ops on x's device, no host
    synchronisation."""
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    gs = global_scale.reshape(()).to(torch.float32)
    rcp6 = torch.full((), 1.0 / E2M1_MAX, dtype=torch.float32, device=x.device)
    amax = xf.abs().amax(dim=-1)
    sf = (gs * (amax * rcp6)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf32 = sf.float()
    out_scale = torch.where(sf32 != 0, torch.reciprocal(sf32 * torch.reciprocal(gs)),
                            torch.zeros((), dtype=torch.float32, device=x.device))
    code = e2m1_codes(xf * out_scale.unsqueeze(-1)).reshape(*shape[:-1], shape[-1] // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed, sf


def dequantize(packed: torch.Tensor, scales: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    """float32 values of ``quantize``'s outputs (contiguous row layout): ``E2M1[code] * scale /
    global_scale``."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    mag = table[(codes & 7).long()]
    val = torch.where((codes & 8) != 0, -mag, mag)
    s = scales.float() / global_scale.reshape(()).float()
    return (val.reshape(*s.shape, BLOCK) * s.unsqueeze(-1)).reshape(val.shape)


# -- DeepEP's layouts ---------------------------------------------------------------------------
def scales_tiles(rows: int, hidden: int) -> tuple[int, int]:
    """``(ceil(R / 128), ceil(H / 64))``: the scale tiles of one expert."""
    return -(-rows // TILE_ROWS), -(-(hidden // BLOCK) // TILE_BLOCKS)


def outputs(num_local_experts: int, rows: int, hidden: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """New DeepEP-layout NVFP4 tensors (module doc, "Layouts"), contents unspecified: values
    uint8 ``[R, H / 2, L]`` and scales float8_e4m3fn ``[32, 4, rm, 4, rk, L]``, each a permuted
    view of a new contiguous storage."""
    rm, rk = scales_tiles(rows, hidden)
    values = torch.empty((num_local_experts, rows, hidden // 2), dtype=torch.uint8,
                         device=device)
    tiles = torch.empty((num_local_experts, rm, rk, 32, 4, TILE_BLOCKS),
                        dtype=torch.float8_e4m3fn, device=device)
    return values.permute(1, 2, 0), tiles.permute(3, 4, 1, 5, 2, 0)


def swizzle_scales(scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row-layout scales ``[L, R, H / 16]`` (e4m3) -> DeepEP's ``[32, 4, ceil(R / 128), 4,
    ceil(H / 64), L]`` (module doc), written into ``out`` (from ``outputs``) or a new one;
    padding 0."""
    L, R, G = scales.shape
    rm, rk = -(-R // TILE_ROWS), -(-G // TILE_BLOCKS)
    padded = torch.zeros((L, rm * TILE_ROWS, rk * TILE_BLOCKS), dtype=torch.uint8,
                         device=scales.device)
    padded[:, :R, :G] = scales.view(torch.uint8)
    # row r = 128 i + 32 b + a, block j = 4 k + c  ->  [e, i, k, a, b, c]
    tiles = padded.view(L, rm, 4, 32, rk, TILE_BLOCKS).permute(0, 1, 4, 3, 2, 5)
    if out is None:
        return tiles.contiguous().view(torch.float8_e4m3fn).permute(3, 4, 1, 5, 2, 0)
    out.permute(5, 2, 4, 0, 1, 3).view(torch.uint8).copy_(tiles)
    return out


def unswizzle_scales(deep: torch.Tensor, rows: int, hidden: int) -> torch.Tensor:
    """DeepEP's scales tensor -> row layout ``[L, R, H / 16]`` (the inverse of
    ``swizzle_scales``; for tests and for engines that want rows)."""
    tiles = deep.permute(5, 2, 4, 0, 1, 3)              # [L, rm, rk, 32, 4, 4] (a view)
    L, rm, rk = tiles.shape[:3]
    rowsf = tiles.permute(0, 1, 4, 3, 2, 5).reshape(L, rm * TILE_ROWS, rk * TILE_BLOCKS)
    return rowsf[:, :rows, :hidden // BLOCK]


def fill_outputs(recv_x: torch.Tensor, global_scale: torch.Tensor, values: torch.Tensor,
                 scales: torch.Tensor) -> None:
    """Quantise the received rows ``[L, R, H]`` into DeepEP's NVFP4 pair (from ``outputs``).
    Every row is quantised; rows past ``recv_count`` hold unspecified values, as DeepEP's."""
    packed, sf = quantize(recv_x, global_scale)
    values.permute(2, 0, 1).copy_(packed)
    swizzle_scales(sf, scales)
