"""Command-line values of the benchmarks: sizes, integer lists, dtypes, and the options every
benchmark shares (``add_run_arguments``)."""
from __future__ import annotations

import re

import torch

from .timing import GRAPH_OPS

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
          "fp32": torch.float32, "float": torch.float32}
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'8' -> 8, '64K' -> 65536, '16M' -> 16777216 (binary suffixes K, M, G; optional 'B')."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", text.upper())
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"size {text!r}: expected a positive number of bytes with an optional "
                         "K/M/G suffix, e.g. 8, 64K, 16M")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def parse_sizes(text: str | None, lo: int = 8, hi: int = 16 << 20) -> list[int]:
    """A comma list of sizes, or every power of two from ``lo`` to ``hi`` when ``text`` is None."""
    if text is None:
        return [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]
    return [parse_size(t) for t in text.split(",") if t.strip()]


def parse_ints(text: str, what: str) -> list[int]:
    """'1,32,128' -> [1, 32, 128]; every entry a positive integer (``what`` names the option)."""
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{what} {text!r}: expected a comma list of positive integers")
    return vals


def parse_dtype(text: str) -> torch.dtype:
    if text.lower() not in DTYPES:
        raise ValueError(f"dtype {text!r}: expected one of bfloat16, float16, float32")
    return DTYPES[text.lower()]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def add_graph_ops_argument(p) -> None:
    p.add_argument("--graph-ops", type=int, default=GRAPH_OPS,
                   help=f"ops per CUDA graph / per eager iteration on GPU (default {GRAPH_OPS})")


def add_no_multicast_argument(p) -> None:
    """``--no-multicast``: switch NVLink multicast off in the processes the command starts."""
    p.add_argument("--no-multicast", action="store_true",
                   help="switch NVLink multicast off in the processes this command starts "
                        "(NCCL NVLS, torch symmetric memory, NVSHMEM), for hosts whose operators "
                        "keep multicast off; by default the environment is left as you set it")


def add_run_arguments(p, *, iters: int, warmup: int) -> None:
    """The options every benchmark has: iterations, seed, output files, CPU, progress bar,
    multicast."""
    p.add_argument("--iters", type=int, default=iters,
                   help=f"timed iterations per case (default {iters})")
    p.add_argument("--warmup", type=int, default=warmup,
                   help=f"untimed iterations first (default {warmup})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", metavar="PATH",
                   help="write the run as a result file (bench/README.md)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the results")
    p.add_argument("--cpu", action="store_true",
                   help="run on CPU (2 gloo processes) even where GPUs are present")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_no_multicast_argument(p)


def check_run_arguments(a, problems: list[str]) -> None:
    """Append a message to ``problems`` for each bad option of ``add_run_arguments``."""
    if a.iters < 1:
        problems.append("--iters must be at least 1")
    if a.warmup < 0:
        problems.append("--warmup must not be negative")
