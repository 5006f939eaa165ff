"""A lean launch path for Triton kernels.

``kernel[grid](...)`` binds and specialises every argument in Python on each call (15-25 us per
launch measured on H200; docs/design.md#launch-path), which dominates an eager decode-step
join. Here the compiled kernel is cached per specialisation key (what Triton specialises on:
dtypes, 16-byte alignment of pointers, ints equal to 1 / divisible by 16 / their width, and the
constexprs) and its C launcher is called directly. The first call of each key goes through
Triton's normal path (``kernel[grid](...)``, public). The direct call uses two things Triton
does not promise: how a compiled kernel's launcher is called, and what it specialises on. So
it is used only on the Triton releases it was checked with (``DIRECT_TRITON``) and only where
the compiled kernel's launcher takes the parameters it is handed (``direct_unavailable``);
elsewhere, or if a direct call ever raises, every launch goes through the normal path from
then on, slower but the same.

The first launch of a key compiles, which takes seconds, while the peers' kernels may already
be spinning in a bounded wait. Keys are made equal on every rank (kernels do not specialise on
arguments that differ between ranks, such as ``rank`` and EP's token count), so every rank
compiles at the same call; that one launch runs with its ``timeout_us`` raised to
``FIRST_LAUNCH_TIMEOUT_US`` (60 s) so a peer's compile is not mistaken for a missing peer:
a peer missing at a kernel's very first call is reported after 60 s, not ``timeout_ms``.
Every kernel launched here waits for its peers (``tests/test_launch_plans.py`` checks it): a
kernel that waited for nobody would compile between two calls' waits, where a peer already
past its own compile waits with the short bound. Inside a CUDA graph capture the timeout is
left alone (the graph would keep the long one).

Programmatic dependent launch (PDL, sm90+, ``LLCOMM_PDL``): kernels with a ``PDL`` constexpr
are compiled with it set and launched with the PDL attribute, so their blocks become resident
while the kernel before them still runs and start the moment it ends
(``after_previous_kernel`` in ``runtime/kernels/sync.py``); in a CUDA graph the capture keeps
that edge.
"""
from __future__ import annotations

import functools
import inspect
import logging
import re

import torch

log = logging.getLogger("llcomm")

_I32 = 1 << 31
#: Bound, in microseconds, of the device waits of a key's first (compiling) launch: a peer's
#: compile takes seconds.
FIRST_LAUNCH_TIMEOUT_US = 60 * 10**6
#: Name of the kernels' wait-bound argument (the launcher raises it on a first launch).
TIMEOUT_ARG = "timeout_us"
#: Name of that constexpr.
PDL_ARG = "PDL"
#: First compute capability with programmatic dependent launch (Hopper).
PDL_MIN_MAJOR = 9
#: Triton releases (major, minor), first and last, whose compiled-kernel launcher and
#: specialisation the direct launch was checked against (docs/development.md, "Triton versions").
DIRECT_TRITON = ((3, 6), (3, 9))
#: The positional parameters of a compiled kernel's launcher (``CompiledKernel.run``) before
#: the kernel's own arguments, as Triton's ``JITFunction.run`` hands them. The launchers of
#: Triton 3.8 and 3.9 name them all; 3.6's names the first ``DIRECT_NAMED_MIN`` and takes the
#: rest in ``*args``.
DIRECT_PARAMS = ("gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
                 "launch_metadata", "launch_enter_hook", "launch_exit_hook")
#: How many of ``DIRECT_PARAMS`` a launcher must name, at least.
DIRECT_NAMED_MIN = 5


def pdl_unavailable(device: torch.device) -> str | None:
    """Why this GPU or this Triton cannot launch with PDL (``LLCOMM_PDL`` aside), or None."""
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.version.hip:       # ROCm's GPUs are "cuda" devices to torch
        return "an AMD GPU (ROCm): PDL is NVIDIA's"
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


def pdl_enabled(device: torch.device, wanted: bool) -> bool:
    """Whether kernels launched on ``device`` get PDL: ``wanted`` (the ``LLCOMM_PDL`` setting)
    and ``pdl_available``."""
    return bool(wanted) and pdl_available(device)


@functools.lru_cache(maxsize=None)
def triton_unchecked(version: str | None = None) -> str | None:
    """Why this Triton release (``triton.__version__`` by default) is outside ``DIRECT_TRITON``,
    or None."""
    if version is None:
        import triton
        version = triton.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return f"Triton {version!r}: not a version number"
    lo, hi = DIRECT_TRITON
    if not lo <= (int(m[1]), int(m[2])) <= hi:
        return (f"Triton {version} is outside {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}, the releases the "
                "direct launch was checked with")
    return None


def direct_unavailable(kernel) -> str | None:
    """Why ``kernel`` (what ``fn[grid](...)`` returned) cannot be launched directly, or None:
    it lacks a launcher, its handle or its packed metadata, or its launcher does not take
    ``DIRECT_PARAMS`` (the first ``DIRECT_NAMED_MIN`` or more by name, the rest in ``*args``)
    and then the kernel's arguments."""
    try:
        run, _, _ = kernel.run, kernel.function, kernel.packed_metadata
        params = list(inspect.signature(run).parameters.values())
    except (AttributeError, TypeError, ValueError) as e:   # absent, or not inspectable
        return f"no compiled-kernel launcher to call ({type(e).__name__}: {e})"
    names = tuple(p.name for p in params[:-1])
    if (not params or params[-1].kind is not inspect.Parameter.VAR_POSITIONAL
            or len(names) < DIRECT_NAMED_MIN or names != DIRECT_PARAMS[:len(names)]):
        return f"the compiled kernel's launcher takes ({', '.join(p.name for p in params)})"
    return None


def _long_bound(seq: tuple, i: int) -> tuple:
    """``seq`` with the wait bound at index ``i`` raised to ``FIRST_LAUNCH_TIMEOUT_US`` (as it
    is inside a graph capture)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return seq
    return (*seq[:i], max(seq[i], FIRST_LAUNCH_TIMEOUT_US), *seq[i + 1:])


def _timeout_index(fn) -> int | None:
    """Where ``fn`` takes its wait bound among its arguments, or None (it waits for nobody)."""
    names = getattr(fn, "arg_names", ())
    return names.index(TIMEOUT_ARG) if TIMEOUT_ARG in names else None


def _defaults(fn) -> dict:
    """The default values of ``fn``'s parameters (a constexpr a launch may leave out)."""
    py = getattr(fn, "fn", None)
    if py is None:
        return {}
    return {n: p.default for n, p in inspect.signature(py).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _spec(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -_I32 <= a < _I32)
    return a


#: Pointer alignment Triton specialises on (bytes).
ALIGN = 16


#: Triton's floating-point contraction (mul + add -> fma), stated at every launch rather than left
#: to Triton's default, which Triton has announced it will change (and warns about while it is
#: unset). A kernel whose arithmetic must not contract passes ``enable_fp_fusion=False`` itself
#: (the EP combine).
FP_FUSION = True


def static_key(fn, num_warps: int, tail: tuple, consts: dict) -> tuple:
    """The part of a launch's cache key fixed by a plan: kernel, warps, constexprs and the
    arguments after the plan's leading tensors (``tail``)."""
    return (fn, num_warps, tuple(consts.items()), tuple(map(_spec, tail)))


def _raw(a):
    """What the compiled kernel's C launcher is handed for argument ``a``: a tensor's address
    as an int. Triton's launcher takes an int pointer as it is, where a tensor costs a
    ``data_ptr`` call and a ``cuPointerGetAttribute`` driver call per pointer per launch.
    Callers have already checked that every tensor is on this communicator's GPU."""
    return a.data_ptr() if isinstance(a, torch.Tensor) else a


class Plan:
    """A launch fixed but for its leading tensors (the operand, the output; ``PeerBackend``
    keeps one per op, size and dtype).

    ``views``: one entry per leading tensor, the dtype the kernel reads it as (None: its own).
    ``tail``: the other arguments (tensors among them are the communicator's own, allocated
    once, so their addresses are taken here once). ``kernels`` keeps, per alignment of the
    leading tensors, the compiled kernel and what follows them in its launch (the tail as ints,
    then the constexprs), so a call costs a ``data_ptr`` per leading tensor and one dict
    lookup before the launch."""

    __slots__ = ("fn", "grid", "tail", "num_warps", "consts", "views", "key", "raw_tail",
                 "kernels")

    def __init__(self, fn, grid: int, tail: tuple, num_warps: int, consts: dict, views: tuple):
        self.fn, self.grid, self.tail, self.num_warps = fn, grid, tail, num_warps
        self.consts, self.views = consts, views
        self.key = static_key(fn, num_warps, tail, consts)
        self.raw_tail = tuple(map(_raw, tail))
        self.kernels: dict = {}


class Launcher:
    """Per-communicator cache of compiled kernels, launched on the current stream."""

    def __init__(self, device: torch.device, pdl: bool = True):
        """``pdl``: the ``LLCOMM_PDL`` setting (PDL where ``pdl_available`` too)."""
        self.device_index = device.index
        self._cache: dict = {}
        self._seen: set = set()         # every key compiled (or loaded) so far
        #: Whether compiled kernels are launched directly; False for good once a reason not to
        #: is found (module doc).
        self.direct = True
        why = triton_unchecked()
        if why is not None:
            self._fall_back(why)
        self.pdl = pdl_enabled(device, pdl)

    def _elsewhere(self) -> bool:
        """The caller's current CUDA device is not this launcher's. The compiled kernels belong
        to this device's context, and Triton's compile path targets the current device, so a
        launch then runs under ``torch.cuda.device`` of this one (as torch's own ops do)."""
        return self.device_index is not None and torch._C._cuda_getDevice() != self.device_index

    def __call__(self, fn, grid: int, args: tuple, num_warps: int, **consts):
        """Launch ``fn`` on ``grid`` blocks of ``num_warps`` warps."""
        if self._elsewhere():
            with torch.cuda.device(self.device_index):
                return self(fn, grid, args, num_warps, **consts)
        self._go((fn, num_warps, tuple(consts.items()), tuple(map(_spec, args))), fn, grid, args,
                 num_warps, consts)

    def run(self, plan: Plan, *ts: torch.Tensor) -> None:
        """Launch ``plan`` on its leading tensors ``ts``."""
        if self._elsewhere():
            with torch.cuda.device(self.device_index):
                return self.run(plan, *ts)
        if len(ts) == 2:    # all_reduce's x and out spelled out: 0.7 us less a call (CPU host)
            p0, p1 = ptrs = (ts[0].data_ptr(), ts[1].data_ptr())
            align = (p0 % ALIGN == 0, p1 % ALIGN == 0)
        else:
            ptrs = [t.data_ptr() for t in ts]
            align = tuple([p % ALIGN == 0 for p in ptrs])
        hit = plan.kernels.get(align) if self.direct else None
        if hit is not None:
            kernel, rest = hit
            stream = torch._C._cuda_getCurrentRawStream(self.device_index)
            try:
                kernel.run(plan.grid, 1, 1, stream, kernel.function, kernel.packed_metadata,
                           None, None, None, *ptrs, *rest)
                return
            except Exception as e:  # noqa: BLE001  (fall back for good, and say why once)
                self._fall_back(f"a direct launch raised {type(e).__name__}: {e}")
        ts = tuple(t if v is None else t.view(v) for t, v in zip(ts, plan.views))
        key = (plan.key, *map(_spec, ts))
        self._go(key, plan.fn, plan.grid, (*ts, *plan.tail), plan.num_warps, plan.consts)
        if self.direct and key in self._cache:
            kernel, consts = self._cache[key]
            plan.kernels[align] = (kernel, (*plan.raw_tail, *consts))

    def _fall_back(self, why: str) -> None:
        log.warning("llcomm: launching kernels through Triton's kernel[grid](...), a slower "
                    "path, from now on: %s", why)
        self.direct = False

    def _compile(self, key, fn, grid: int, args: tuple, num_warps: int, consts: dict):
        """Triton's own path: compile ``fn`` for these arguments (a cache hit after the first
        time) and launch it; keep the compiled kernel for direct launches."""
        if PDL_ARG in fn.arg_names:
            consts = {**consts, PDL_ARG: int(self.pdl)}
            if self.pdl:    # Triton's option: passed only where pdl_available found it
                consts["launch_pdl"] = True
        kernel = fn[(grid,)](*args, num_warps=num_warps,
                             **{"enable_fp_fusion": FP_FUSION, **consts})
        self._seen.add(key)
        why = direct_unavailable(kernel) if self.direct else None
        if why is not None:
            self._fall_back(why)
        if self.direct:     # the C launcher takes every parameter: defaults for those not given
            names = fn.arg_names[len(args):]
            defaults = _defaults(fn)
            self._cache[key] = (kernel, tuple(consts[n] if n in consts else defaults[n]
                                              for n in names))

    def _go(self, key, fn, grid: int, args: tuple, num_warps: int, consts: dict):
        hit = self._cache.get(key) if self.direct else None
        if hit is not None:
            kernel, tail = hit
            stream = torch._C._cuda_getCurrentRawStream(self.device_index)
            try:
                kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None,
                           None, None, *args, *tail)
                return
            except Exception as e:  # noqa: BLE001  (as in run)
                self._fall_back(f"a direct launch raised {type(e).__name__}: {e}")
        i = _timeout_index(fn)
        if key not in self._seen and i is not None and i < len(args):   # a first launch
            args = _long_bound(args, i)
        self._compile(key, fn, grid, args, num_warps, consts)
