"""GPU tests (2 ranks) of the peer backend under the engines' habits.

- ``deep_ep.Buffer`` (and a ``Communicator``) on a **gloo group** of GPU ranks, as vLLM makes its
  buffer on the EP group's CPU group, and on a **mixed group** (``"cpu:gloo,cuda:nccl"``, what
  ``init_process_group()`` without a backend makes): ``backend="peer"`` must run there (the
  choice's exchange, torch's symmetric-memory rendezvous through the group's store, the
  barriers), ``"auto"`` must pick it, and the rounds must equal the oracle.
- **Receive hooks called from another Python thread**, as vLLM's dual-batch overlap runs one
  micro-batch's hook from the other's thread: on the default stream (the new thread's current
  device is CUDA's default, device 0, whatever the rank's is: the launch must go to the buffer's
  device) and on a side stream that the thread enters, every variant, checked against the oracle.

Run on a 2-GPU host: ``python -m pytest -q -m gpu tests/test_deep_ep_groups_gpu.py``; on one GPU:
``python tools/one_gpu_check.py --pytest tests/test_deep_ep_groups_gpu.py`` (the gloo group and
the hooks run there with the workspace shared by CUDA IPC; the mixed group needs NCCL, which
refuses two ranks on one GPU, so it is skipped).
"""
from __future__ import annotations

import pytest
import torch

from _deep_ep_case import VARIANTS
from _dist import run_distributed
from test_deep_ep_groups import H, L, T, group_round

pytestmark = pytest.mark.gpu

MIXED = "cpu:gloo,cuda:nccl"


def _peer_on_group_body(rank, W, spec):
    import torch.distributed as dist

    import llcomm
    import llcomm.deep_ep as deep_ep
    if spec == MIXED and torch.cuda.device_count() < W:
        pytest.skip(f"a {MIXED} group needs NCCL, which refuses two ranks on one GPU")
    E = L * W
    g = dist.new_group(list(range(W)), backend=spec)
    fails = []
    buf = deep_ep.Buffer(g, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, H, W, E), low_latency_mode=True, num_qps_per_rank=L, backend="peer")
    for i, variant in enumerate(VARIANTS):
        fails += group_round(buf, rank, W, 600 + i, variant, "cuda", thread_hooks=False,
                             tag=f"{spec} peer")
    if buf.ep_buffer.backend != "peer":
        fails.append(f"[{spec}] backend {buf.ep_buffer.backend}: {buf.ep_buffer.backend_reason}")
    buf.destroy()

    auto = deep_ep.Buffer(g)                    # what an engine gets without asking
    auto.clean_low_latency_buffer(T, H, E)
    if auto.ep_buffer.backend != "peer":
        fails.append(f"[{spec}] backend='auto' chose {auto.ep_buffer.backend}: "
                     f"{auto.ep_buffer.backend_reason}")
    fails += group_round(auto, rank, W, 610, VARIANTS[1], "cuda", thread_hooks=False,
                         tag=f"{spec} auto")
    auto.destroy()

    comm = llcomm.Communicator(g, max_bytes=1 << 20, backend="peer")
    x = torch.full((64, 128), rank + 1.0, dtype=torch.bfloat16, device=comm.device)
    y = comm.all_reduce(x)
    torch.cuda.synchronize(comm.device)
    if not bool((y.float() == W * (W + 1) / 2).all()):
        fails.append(f"[{spec}] Communicator.all_reduce on the peer backend: {y.flatten()[:4]}")
    comm.close()
    return fails


@pytest.mark.parametrize("spec", ["gloo", MIXED])
def test_peer_backend_on_the_group_an_engine_passes(spec):
    fails = [f for r in run_distributed(_peer_on_group_body, 2, spec, backend="nccl",
                                        timeout=600) for f in r]
    assert not fails, "\n".join(fails[:20])


def _thread_hooks_body(rank, W, side_stream, enter=True):
    import llcomm.deep_ep as deep_ep
    E = L * W
    buf = deep_ep.Buffer(None, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, H, W, E), backend="peer")
    buf.clean_low_latency_buffer(T, H, E)
    assert buf.ep_buffer.backend == "peer", buf.ep_buffer.backend_reason
    fails = []
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):         # the round, its hooks (in the thread) and checks
        for i, variant in enumerate(VARIANTS):
            fails += group_round(buf, rank, W, 700 + i, variant, "cuda", thread_hooks=True,
                                 tag=f"thread hooks, side stream {side_stream}", enter=enter)
    torch.cuda.current_stream().wait_stream(stream)
    buf.destroy()
    return fails


@pytest.mark.parametrize("side_stream,enter", [(False, True), (True, True), (True, False)],
                         ids=["default-stream", "side-stream", "side-stream-hook-elsewhere"])
def test_receive_hooks_from_another_thread(side_stream, enter):
    """``side-stream-hook-elsewhere``: the round runs on a side stream and each hook is called
    from a thread on its own default stream; the hook still launches on its send half's
    stream (DeepEP's rule), so the results are right without the engine ordering streams."""
    fails = [f for r in run_distributed(_thread_hooks_body, 2, side_stream, enter, backend="nccl",
                                        timeout=600) for f in r]
    assert not fails, "\n".join(fails[:20])
