"""The two-level EP kernels compile for sm_90 with their SHMEM puts and signals linked from
NVSHMEM's device bitcode (the ``shmem`` extra's ``nvidia-nvshmem-cu13`` wheel), on a machine
without a GPU, as the PTX checks do for the single-host kernels: ``tools/ptx_shmem.py``, in a
fresh process (it makes torch define its SHMEM Triton device functions before torch.distributed
is imported). Each SHMEM kernel must call NVSHMEM's non-blocking block put-with-signal and its
signal wait (a send half only the put, the dispatch's receive half only the wait), no
thread-scope signal, quiet or fence, and leave no function undefined; the same kernels with
``SHMEM`` = 0 must call none. Besides whole ops, the send and receive halves of
``return_recv_hook`` and the stages ``llcomm bench ep --calibrate`` launches alone are compiled,
so a stage group that does not compile as its own launch fails here, not on a GPU.

The same kernels compile for AMD's gfx942 with ``SHMEM`` = 2 (rocSHMEM through torch's
``_rocshmem_triton`` layer) up to the link of rocSHMEM's device library, which is not at hand:
``tools/ptx_shmem.py --target gfx942``. Each rocSHMEM kernel must declare exactly the layer's
put-with-signal and signal wait (no quiet, fence or signal of its own), pass them rocSHMEM's
constants and leave only those two undefined in its code object; a static assertion of the
layer (its ``signal_op``) or a function it does not define fails the compile.
"""
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The kernels ``tools/ptx_shmem.py`` compiles per target (``variants``).
VARIANTS = 19


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                    reason="NVSHMEM's wheels are for Linux on x86_64 (the shmem extra)")
def test_two_level_kernels_compile_with_nvshmem():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ptx_shmem.py"),
                        "--blocks", "32"], env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("hosts_")]
    assert len(lines) == VARIANTS and all(" ok " in ln for ln in lines), p.stdout
    whole = [ln for ln in lines if "_plain" not in ln and "_half" not in ln]
    assert all("nvshmemx_putmem_signal_nbi_block" in ln and "nvshmem_signal_wait_until" in ln
               and "quiet" not in ln and "signal_op" not in ln for ln in whole), p.stdout


def test_two_level_kernels_compile_with_rocshmem_for_gfx942():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ptx_shmem.py"),
                        "--target", "gfx942", "--blocks", "32"],
                       env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("hosts_")]
    assert len(lines) == VARIANTS and all(" ok " in ln for ln in lines), p.stdout
    whole = [ln for ln in lines if "_plain" not in ln and "_half" not in ln]
    plain = [ln for ln in lines if "_plain" in ln]
    assert len(whole) == 8 and len(plain) == 7, p.stdout
    assert all("rocshmem_putmem_signal_wg" in ln and "rocshmem_uint64_wait_until" in ln
               and not any(s in ln for s in ("quiet", "fence", "signal_op", "atomic_set"))
               for ln in whole), p.stdout
    assert all("rocshmem: none" in ln and "code object: none" in ln for ln in plain), p.stdout
