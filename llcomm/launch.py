"""A lean launch path for Triton kernels.

``kernel[grid](...)`` binds and specialises every argument in Python on each call (15-25 us per
launch measured on H200, GPU-NOTES.md), which dominates an eager decode-step join. Here the
compiled kernel is cached per specialisation key (what Triton specialises on: dtypes, 16-byte
alignment of pointers, ints equal to 1 / divisible by 16 / their width, and the constexprs) and
its C launcher is called directly. The first call of each key goes through Triton's normal path;
if the direct call ever fails (another Triton version), the normal path is used from then on.

The first launch of a key compiles, which takes seconds, while the peers' kernels may already
be spinning in a bounded wait. Keys are made equal on every rank (kernels do not specialise on
arguments that differ between ranks, such as ``rank`` and EP's token count), so every rank
compiles at the same call; that one launch runs with its ``timeout_us`` raised to
``FIRST_LAUNCH_TIMEOUT_US`` (60 s) so a peer's compile is not mistaken for a missing peer:
a peer missing at a kernel's very first call is reported after 60 s, not ``timeout_ms``. Inside a
CUDA graph capture the timeout is left alone (the graph would keep the long one).

Programmatic dependent launch (PDL, sm90+, ``LLCOMM_PDL``): kernels with a ``PDL`` constexpr
are compiled with it set and launched with the PDL attribute, so their blocks become resident
while the kernel before them still runs and start the moment it ends
(``kernels/_sync.after_previous_kernel``); in a CUDA graph the capture keeps that edge.
"""
from __future__ import annotations

import logging

import torch

from ._env import env_bit

log = logging.getLogger("llcomm")

_I32 = 1 << 31
#: Bound, in microseconds, of the device waits of a key's first (compiling) launch: a peer's
#: compile takes seconds.
FIRST_LAUNCH_TIMEOUT_US = 60 * 10**6
#: Name of the kernels' wait-bound argument (the launcher raises it on a first launch).
TIMEOUT_ARG = "timeout_us"
#: 1: launch kernels that take a ``PDL`` constexpr with programmatic dependent launch.
PDL_ENV = "LLCOMM_PDL"
#: Name of that constexpr.
PDL_ARG = "PDL"
#: First compute capability with programmatic dependent launch (Hopper).
PDL_MIN_MAJOR = 9


def pdl_unavailable(device: torch.device) -> str | None:
    """Why this GPU or this Triton cannot launch with PDL (``LLCOMM_PDL`` aside), or None."""
    if device.type != "cuda":
        return "not a CUDA device"
    try:
        import triton.language.extra.cuda as tl_cuda
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return "this Triton has no NVIDIA backend"
    if not (hasattr(tl_cuda, "gdc_wait")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})):
        return "this Triton has no gdc_wait / launch_pdl"
    major, minor = torch.cuda.get_device_capability(device)
    if major < PDL_MIN_MAJOR:
        return f"sm_{major}{minor} is older than sm_{PDL_MIN_MAJOR}0"
    return None


def pdl_available(device: torch.device) -> bool:
    """Whether this GPU and this Triton can launch with PDL (``LLCOMM_PDL`` aside)."""
    return pdl_unavailable(device) is None


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` get PDL: ``LLCOMM_PDL`` (default 1) and
    ``pdl_available``. A value of LLCOMM_PDL other than 0 or 1 raises ValueError."""
    return bool(env_bit(PDL_ENV, 1)) and pdl_available(device)


def _spec(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -_I32 <= a < _I32)
    return a


#: Leading arguments of a planned launch that may change from call to call (the operand and the
#: output); the rest are the plan's own and are in its ``static_key``.
PLANNED_DYNAMIC = 2
#: Pointer alignment Triton specialises on (bytes).
ALIGN = 16


def static_key(fn, num_warps: int, tail: tuple, consts: dict) -> tuple:
    """The part of a launch's cache key fixed by a plan: kernel, warps, constexprs and the
    arguments after the first PLANNED_DYNAMIC (``tail``)."""
    return (fn, num_warps, tuple(consts.items()), tuple(map(_spec, tail)))


def _raw(a):
    """What the compiled kernel's C launcher is handed for argument ``a``: a tensor's address
    as an int. Triton's launcher takes an int pointer as it is, where a tensor costs a
    ``data_ptr`` call and a ``cuPointerGetAttribute`` driver call per pointer per launch.
    Callers have already checked that every tensor is on this communicator's GPU."""
    return a.data_ptr() if isinstance(a, torch.Tensor) else a


class Plan:
    """A launch fixed but for its PLANNED_DYNAMIC leading tensors (``PeerBackend._plan``).

    ``tail``: the other arguments (tensors among them are the communicator's own, allocated
    once, so their addresses are taken here once); ``view``: the dtype the kernel reads the two
    tensors as, or None. ``kernels`` keeps the compiled kernel per alignment of the two
    tensors, so a call costs two ``data_ptr`` calls and one dict lookup before the launch."""

    __slots__ = ("fn", "grid", "tail", "num_warps", "consts", "view", "key", "raw_tail",
                 "kernels")

    def __init__(self, fn, grid: int, tail: tuple, num_warps: int, consts: dict, view=None):
        self.fn, self.grid, self.tail, self.num_warps = fn, grid, tail, num_warps
        self.consts, self.view = consts, view
        self.key = static_key(fn, num_warps, tail, consts)
        self.raw_tail = tuple(map(_raw, tail))
        self.kernels: dict = {}


class Launcher:
    """Per-communicator cache of compiled kernels, launched on the current stream."""

    def __init__(self, device: torch.device):
        self.device_index = device.index
        self._cache: dict = {}
        self.direct = True
        self.pdl = pdl_enabled(device)

    def __call__(self, fn, grid: int, args: tuple, num_warps: int, **consts):
        """Launch ``fn`` on ``grid`` blocks of ``num_warps`` warps."""
        self._go((fn, num_warps, tuple(consts.items()), tuple(map(_spec, args))), fn, grid, args,
                 num_warps, consts)

    def run(self, plan: Plan, x: torch.Tensor, out: torch.Tensor) -> None:
        """Launch ``plan`` on ``x`` and ``out``."""
        px, po = x.data_ptr(), out.data_ptr()
        align = (px % ALIGN == 0, po % ALIGN == 0)
        hit = plan.kernels.get(align) if self.direct else None
        if hit is not None:
            kernel, consts = hit
            stream = torch._C._cuda_getCurrentRawStream(self.device_index)
            try:
                kernel.run(plan.grid, 1, 1, stream, kernel.function, kernel.packed_metadata,
                           None, None, None, px, po, *plan.raw_tail, *consts)
                return
            except Exception as e:  # noqa: BLE001  (fall back for good, and say why once)
                self._fall_back(e)
        if plan.view is not None:
            x, out = x.view(plan.view), out.view(plan.view)
        key = (plan.key, _spec(x), _spec(out))
        self._go(key, plan.fn, plan.grid, (x, out, *plan.tail), plan.num_warps, plan.consts)
        if self.direct and key in self._cache:
            plan.kernels[align] = self._cache[key]

    def _fall_back(self, e: Exception) -> None:
        log.warning("llcomm: direct kernel launch failed (%s); using Triton's launcher", e)
        self.direct = False

    def _go(self, key, fn, grid: int, args: tuple, num_warps: int, consts: dict):
        hit = self._cache.get(key) if self.direct else None
        if hit is not None:
            kernel, tail = hit
            stream = torch._C._cuda_getCurrentRawStream(self.device_index)
            try:
                kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None,
                           None, None, *args, *tail)
                return
            except Exception as e:  # noqa: BLE001
                self._fall_back(e)
        if TIMEOUT_ARG in fn.arg_names and not torch.cuda.is_current_stream_capturing():
            i = fn.arg_names.index(TIMEOUT_ARG)
            if i < len(args):
                args = (*args[:i], max(args[i], FIRST_LAUNCH_TIMEOUT_US), *args[i + 1:])
        if PDL_ARG in fn.arg_names:
            consts = {**consts, PDL_ARG: int(self.pdl)}
            if self.pdl:    # Triton's option: passed only where pdl_available found it
                consts["launch_pdl"] = True
        kernel = fn[(grid,)](*args, num_warps=num_warps, **consts)
        if self.direct:
            names = fn.arg_names[len(args):]
            self._cache[key] = (kernel, tuple(consts[n] for n in names))
