"""PyTorch's SHMEM layers, as the two-level EP kernels use them: the device functions, and the
launcher that links SHMEM's device library into a kernel.

torch 2.13 has a backend-neutral module, ``torch.distributed._symmetric_memory._shmem_triton``,
that routes to ``_nvshmem_triton`` on CUDA builds and to ``_rocshmem_triton`` on ROCm builds;
torch 2.11 and 2.12 have ``_nvshmem_triton`` only. Each layer defines its Triton device
functions only where torch finds Triton and a GPU (``torch.utils._triton.has_triton``). The
kernels (``llcomm/ep/hosts/kernels/rail.py``) take both layers' functions, whichever build this
is, and pick one by a constexpr, so one source compiles for NVIDIA and for AMD; a layer that is
missing here is a stand-in whose functions refuse to compile, which a kernel compiled for the
other backend, or with plain stores, never reaches. Of each layer they use only the functions
both define: ``DEVICE_FUNCTIONS``.
"""
from __future__ import annotations

import importlib
import types

#: The device functions of torch's layers that the kernels call (both layers define them).
DEVICE_FUNCTIONS = ("putmem_signal_block", "signal_wait_until")
#: The layers, by the name in their module (``_<name>_triton``).
LAYERS = ("nvshmem", "rocshmem")


def _layer_module(name: str):
    """torch's ``_<name>_triton`` module with the device functions defined, or None."""
    try:
        mod = importlib.import_module(f"torch.distributed._symmetric_memory._{name}_triton")
    except ImportError:
        return None
    return mod if all(hasattr(mod, n) for n in DEVICE_FUNCTIONS) else None


def _backend_module():
    """torch's SHMEM Triton module for this build, or None."""
    try:
        from torch.distributed._symmetric_memory import _shmem_triton
        return _shmem_triton.get_shmem_backend_module()
    except ImportError:
        pass
    try:
        from torch.distributed._symmetric_memory import _nvshmem_triton
        return _nvshmem_triton
    except ImportError:
        return None


def layer_name() -> str:
    """Which SHMEM Triton layer this torch has, for messages and docs."""
    try:
        from torch.distributed._symmetric_memory import _shmem_triton  # noqa: F401  (probe)
        return "torch.distributed._symmetric_memory._shmem_triton"
    except ImportError:
        pass
    try:
        from torch.distributed._symmetric_memory import _nvshmem_triton  # noqa: F401  (probe)
        return "torch.distributed._symmetric_memory._nvshmem_triton"
    except ImportError:
        return "none"


def _unavailable_functions(name: str):
    import triton
    import triton.language as tl

    @triton.jit
    def unavailable(*args):
        tl.static_assert(False, "this torch defines no device functions of this SHMEM layer "
                                "here (llcomm/runtime/shmem.py)")

    # a module, as torch's layers are: Triton's dependency scan skips modules, where it would
    # deep-copy any other global object a kernel names
    mod = types.ModuleType(f"llcomm_without_{name}_layer")
    for n in DEVICE_FUNCTIONS:
        setattr(mod, n, unavailable)
    return mod


def layer_devices(name: str):
    """The device functions of torch's ``name`` layer (``LAYERS``), or a stand-in that fails
    to compile (module doc)."""
    if name not in LAYERS:
        raise ValueError(f"layer_devices: name must be one of {LAYERS}, got {name!r}")
    return _layer_module(name) or _unavailable_functions(name)


def device_functions_available() -> bool:
    """Whether torch defined this build's SHMEM Triton device functions in this process."""
    mod = _backend_module()
    return mod is not None and all(hasattr(mod, n) for n in DEVICE_FUNCTIONS)


def this_build_shmem() -> int:
    """The kernels' ``SHMEM`` value for this torch build: 2 (rocSHMEM) on ROCm, else 1
    (NVSHMEM); ``llcomm/ep/hosts/kernels/rail.py`` names them."""
    import torch
    return 2 if torch.version.hip is not None else 1


class ShmemLauncher:
    """Launches a kernel that calls SHMEM device functions: compiled with NVSHMEM's device
    library linked (``extern_libs``), and SHMEM initialised in each module the kernel loads
    before that module's first launch. torch's decorator (``requires_nvshmem``) does the same
    from Triton's post-compile hook, which under Triton 3.6 serialises the constexprs to JSON
    and fails on llcomm's constexpr bundles; so each launch first asks Triton for the compiled
    kernel (``warmup``: a cache lookup, or the compile), initialises a module it has not seen,
    then launches. A compiled kernel's first launch runs with its ``timeout_us`` raised as
    ``runtime/launch.py`` raises it (a peer may still be compiling). NVIDIA only: torch's
    rocSHMEM layer initialises modules its own way, and no ROCm machine has run this."""

    def __init__(self, kernel, module_init=None, libs=None):
        self.kernel = kernel
        if module_init is None:
            from torch._C._distributed_c10d import _nvshmemx_cumodule_init as module_init
        if libs is None:
            from torch.distributed._symmetric_memory._nvshmem_triton import NvshmemLibFinder
            libs = {"libnvshmem_device": NvshmemLibFinder.find_device_library()}
        self.libs = libs
        self._module_init = module_init
        self._timeout_index = kernel.arg_names.index("timeout_us")
        self._seen: set[int] = set()

    def __call__(self, grid, args, consts: dict) -> None:
        from .launch import _long_bound
        compiled = self.kernel.warmup(*args, grid=grid, extern_libs=self.libs, **consts)
        if id(compiled) not in self._seen:
            # a variant whose stages make no SHMEM call (a receive half) links none of
            # NVSHMEM's device state, and NVSHMEM refuses to initialise such a module
            if "nvshmemi_device_state" in compiled.asm.get("ptx", ""):
                compiled._init_handles()        # load the module
                self._module_init(compiled.module)
            self._seen.add(id(compiled))
            args = _long_bound(tuple(args), self._timeout_index)
        self.kernel[grid](*args, extern_libs=self.libs, **consts)


def shmem_problem() -> str | None:
    """Why this process cannot run the two-level EP kernels on SHMEM, or None: it needs a CUDA
    device, torch's symmetric memory with its NVSHMEM backend, and torch's SHMEM Triton device
    functions (``DEVICE_FUNCTIONS``)."""
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch has no symmetric memory ({e})"
    available = getattr(symm_mem, "is_nvshmem_available", None)
    if available is None or not available():
        return "this torch build has no NVSHMEM backend for symmetric memory"
    if not device_functions_available():
        return f"this torch's SHMEM Triton layer ({layer_name()}) defines no device functions"
    return None
