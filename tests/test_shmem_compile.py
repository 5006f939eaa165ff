"""The two-level EP kernels compile for sm_90 with their SHMEM puts and signals linked from
NVSHMEM's device bitcode (the ``shmem`` extra's ``nvidia-nvshmem-cu13`` wheel), on a machine
without a GPU, as the PTX checks do for the single-host kernels: ``tools/ptx_shmem.py``, in a
fresh process (it makes torch define its SHMEM Triton device functions before torch.distributed
is imported). Each SHMEM kernel must call NVSHMEM's non-blocking block put-with-signal and its
signal wait, no thread-scope signal, quiet or fence, and leave no function undefined; the same
kernels with ``SHMEM`` = 0 must call none.
"""
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert len(lines) == 10 and all(" ok " in ln for ln in lines), p.stdout
    shmem = [ln for ln in lines if "_plain" not in ln]
    assert all("nvshmemx_putmem_signal_nbi_block" in ln and "nvshmem_signal_wait_until" in ln
               and "quiet" not in ln and "signal_op" not in ln for ln in shmem), p.stdout
