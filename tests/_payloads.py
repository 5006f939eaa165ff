"""Payloads of the movement ops for every dtype they take: fresh random bytes with the bit
patterns that a copy through a float type could change planted among them.

    from _payloads import MOVE_DTYPES, payload, poisoned, same_bytes

    x = payload(torch.int64, (5,), seed=("case", rank))

- floats (bfloat16, float16, float32, float64): NaNs with payloads (quiet and signalling, both
  signs), -0.0, the smallest and the largest subnormal, -inf, then random bytes (any pattern);
- 1-byte floats (float8 forms, float4_e2m1fn_x2): all 256 bit patterns in a random order, then
  random bytes;
- bool: random 0 / 1; every other dtype: random bytes.

The specials come first, so a small tensor holds as many as fit. Everything is compared as bytes
(``same_bytes``): NaN != NaN and -0.0 == 0.0 would hide exactly what these are for.
"""
from __future__ import annotations

import zlib

import torch

from llcomm.runtime.validate import MOVE_DTYPES  # noqa: F401  (every dtype the ops take)

#: Poison byte of outputs before a call (0xA5: a NaN in no float layout here, so the byte
#: comparison, not a NaN test, finds what was never written).
POISON_BYTE = 0xA5
#: (exponent bits, mantissa bits) of the multi-byte float layouts.
_FLOAT_BITS = {torch.float16: (5, 10), torch.bfloat16: (8, 7), torch.float32: (8, 23),
               torch.float64: (11, 52)}
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def generator(seed) -> torch.Generator:
    """A generator private to ``seed`` (any repr-able value: a case name and a rank)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))


def special_bits(dtype: torch.dtype) -> list[int]:
    """Unsigned bit patterns of ``dtype`` (a multi-byte float) that a float copy may change."""
    e, m = _FLOAT_BITS[dtype]
    sign, exp = 1 << (e + m), ((1 << e) - 1) << m
    quiet = 1 << (m - 1)
    return [exp | quiet | 0b101,                 # quiet NaN with a payload
            sign | exp | 0b11,                   # negative signalling NaN with a payload
            exp | 1,                             # signalling NaN, smallest payload
            sign,                                # -0.0
            1,                                   # smallest subnormal
            sign | ((1 << m) - 1),               # largest subnormal, negative
            sign | exp]                          # -inf


def _from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    size = dtype.itemsize
    top = 1 << (8 * size)
    signed = [b - top if b >= top >> 1 else b for b in bits]
    return torch.tensor(signed, dtype=_INT_VIEW[size]).view(dtype)


def payload(dtype: torch.dtype, shape, seed) -> torch.Tensor:
    """Fresh contiguous ``shape`` of ``dtype`` (module doc)."""
    g = generator(seed)
    n = torch.Size(shape).numel()
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).view(
            torch.bool).reshape(shape)
    flat = torch.randint(0, 256, (n * dtype.itemsize,), generator=g,
                         dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point and dtype.itemsize == 1:
        k = min(n, 256)
        flat.view(torch.uint8)[:k] = torch.randperm(256, generator=g)[:k].to(torch.uint8)
    elif dtype in _FLOAT_BITS:
        sp = _from_bits(special_bits(dtype), dtype).view(_INT_VIEW[dtype.itemsize])
        k = min(n, sp.numel())
        flat.view(_INT_VIEW[dtype.itemsize])[:k] = sp[:k]      # bits, not values
    return flat.reshape(shape)


def poisoned(shape, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.view(-1).view(torch.uint8).fill_(POISON_BYTE)
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
