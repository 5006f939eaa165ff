"""On one GPU (``-m gpu``): the compiled wait kernel of ``low_latency_combine(overlap=True)``
(``llcomm/deep_ep/overlap_kernel.py``) and the NVFP4 quantiser on the device.

The signals are raised by work on a second stream that starts with a long sleep kernel, so
the wait (on the current stream) must spin on words another kernel stores meanwhile; a word
that never arrives must end the kernel within its bound and record the word. The quantiser
must give on the GPU exactly the bytes it gives on the CPU (its steps are IEEE float32 ops).
"""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu(gpus=1)


def _wait(sig, counts, per, block_m, threshold, timeout_us, unsigned=False):
    from llcomm.deep_ep.overlap_kernel import wait_signals
    status = torch.zeros(1, dtype=torch.int64, device="cuda")
    wait_signals[(counts.numel(),)](sig, counts, status, per, block_m, threshold, timeout_us,
                                    HAS_COUNTS=True, UNSIGNED=unsigned)
    return status


def test_wait_kernel_sees_signals_from_another_stream():
    counts = torch.tensor([3, 0, 5], dtype=torch.int32, device="cuda")
    per, block_m, threshold = 3, 2, 4
    sig = torch.zeros(3 * per, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)                       # tens of ms on any GPU
        sig.fill_(threshold)
    status = _wait(sig, counts, per, block_m, threshold, 10_000_000)
    done.fill_(1)                                           # after the wait, on its stream
    torch.cuda.synchronize()
    assert int(status[0]) == 0 and int(done[0]) == 1


def test_wait_kernel_times_out_and_records_the_word():
    counts = torch.tensor([2, 2], dtype=torch.int32, device="cuda")
    sig = torch.full((2,), 7, dtype=torch.int32, device="cuda")
    sig[1] = 6                                              # expert 1, block 0: never 7
    t0 = time.monotonic()
    status = _wait(sig, counts, 1, 2, 7, 200_000)
    torch.cuda.synchronize()
    assert int(status[0]) == 1 + 1 and time.monotonic() - t0 < 5


def test_wait_kernel_unsigned_threshold():
    counts = torch.tensor([1], dtype=torch.int32, device="cuda")
    sig = torch.tensor([2 ** 31 + 9 - 2 ** 32], dtype=torch.int32, device="cuda")
    status = _wait(sig, counts, 1, 1, 2 ** 31 + 9, 10_000_000, unsigned=True)
    torch.cuda.synchronize()
    assert int(status[0]) == 0


def test_nvfp4_quantiser_same_bytes_on_the_gpu():
    from llcomm.deep_ep import nvfp4
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 7168, generator=g) * 3).bfloat16()
    gs = torch.tensor(448 * 6 / float(x.float().abs().max()), dtype=torch.float32)
    p_cpu, s_cpu = nvfp4.quantize(x, gs)
    p_gpu, s_gpu = nvfp4.quantize(x.cuda(), gs.cuda())
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(s_gpu.cpu().view(torch.uint8), s_cpu.view(torch.uint8))
