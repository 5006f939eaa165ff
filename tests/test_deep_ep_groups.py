"""The process groups engines pass, and receive hooks called from another thread (CPU, gloo).

vLLM makes ``deep_ep.Buffer`` on its CPU group (gloo); ``init_process_group()`` without a
backend, or ``new_group(backend="cpu:gloo,cuda:nccl")``, makes a mixed group, whose
``dist.get_backend`` is that string, not ``"gloo"``. What a group carries
(``llcomm.runtime.backend.parse_backends``) decides where the reference backend's tensors live
and whether its calls are bounded and checked: a ``"cpu:gloo"`` group must behave as a gloo
group (bounded waits, the call check that turns a mismatch into ``CommMismatchError`` instead of
an abort inside gloo). A GPU tensor given to a buffer on a CPU-only group is refused naming the
``group`` argument and the groups that carry GPU tensors. vLLM's dual-batch overlap runs one
micro-batch's receive hook from the other micro-batch's thread: here each hook of a round runs
in a new ``threading.Thread`` and the round is checked against the oracle of
``tests/_deep_ep_case.py``. tests/test_deep_ep_groups_gpu.py runs the same on the peer backend.
"""
from __future__ import annotations

import threading

import pytest
import torch

from _deep_ep_case import (VARIANTS, Quant, case, check_combine, check_dispatch,
                           combine_oracle, expert_outputs)
from _dist import run_distributed
from llcomm.runtime import backend as B

H, T, K, L = 512, 8, 4, 2
#: A hook that has not returned after this many seconds is a hang, reported as such.
HOOK_SECONDS = 120


def call_in_thread(hook, device: torch.device, enter: bool = True) -> None:
    """``hook()`` in a new thread, on the stream current here: torch's current stream is per
    thread, so the thread enters a side stream (as an engine's micro-batch thread sets its own);
    on the default stream it calls the hook as it starts, on CUDA's default device (device 0,
    whatever this rank's is), where the launch must still go to the buffer's device.
    ``enter=False``: the thread calls it on its own default stream even when a side stream is
    current here (the hook must still launch on the stream of its send half, as DeepEP's).
    Re-raises what the hook raised."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" and enter else None
    if stream is not None and stream == torch.cuda.default_stream(stream.device):
        stream = None
    raised = []

    def body():
        try:
            if stream is None:
                hook()
            else:
                with torch.cuda.stream(stream):
                    hook()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread, re-raised
            raised.append(e)

    t = threading.Thread(target=body, name="receive-hook")
    t.start()
    t.join(HOOK_SECONDS)
    assert not t.is_alive(), f"the receive hook did not return within {HOOK_SECONDS} s"
    if raised:
        raise raised[0]


def group_round(buf, rank: int, W: int, seed: int, variant, device, *, thread_hooks: bool,
                tag: str = "", enter: bool = True) -> list[str]:
    """One low-latency round on ``buf`` (a ``deep_ep.Buffer``) with ``return_recv_hook=True``:
    dispatch, its hook (in another thread with ``thread_hooks``), every row checked, the
    stand-in experts, combine, its hook, the result against the fp64 weighted sum. Failures."""
    device = torch.device(device)
    E = L * W
    inputs = case(W, E, T, H, K, seed)
    x, idx, w = (t.to(device) for t in inputs[rank])
    fp8, round_scale, ue8m0 = variant
    tag = f"[{tag} rank={rank} seed={seed} fp8/round/ue8m0={variant} thread={thread_hooks}]"
    quant = Quant()

    def run(hook):
        if thread_hooks:
            call_in_thread(hook, device, enter)
        else:
            hook()

    recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
        x, idx, T, E, use_fp8=fp8, round_scale=round_scale, use_ue8m0=ue8m0,
        return_recv_hook=True)
    run(hook)
    fails, rows_in = check_dispatch(tag, rank, inputs, recv_x, recv_count, handle, variant,
                                    quant, seed, W, E, T, H)
    if fails:
        return fails
    expert_out = expert_outputs(rows_in, rank, L, W, T, H, torch.bfloat16, device)
    want, bound = combine_oracle(inputs, rank, variant, quant, seed, E, torch.bfloat16)
    y, _, hook = buf.low_latency_combine(expert_out, idx, w, handle, return_recv_hook=True)
    run(hook)
    return check_combine(tag, y, want, bound)


@pytest.mark.parametrize("spec, want", [
    ("gloo", {"cpu": "gloo"}),
    ("nccl", {"cuda": "nccl"}),
    ("cpu:gloo", {"cpu": "gloo"}),
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    ("cuda:nccl,cpu:gloo", {"cpu": "gloo", "cuda": "nccl"}),
    ("CPU:gloo, cuda:NCCL", {"cpu": "gloo", "cuda": "nccl"}),
    ("mpi", {"cpu": "mpi"}),
])
def test_what_a_group_carries(spec, want):
    assert B.parse_backends(spec) == want


def _cpu_groups_body(rank, W):
    import torch.distributed as dist

    import llcomm
    import llcomm.deep_ep as deep_ep
    from llcomm.runtime import bounded
    E = L * W
    fails = []
    for n, spec in enumerate(("cpu:gloo", "gloo")):
        g = dist.new_group(list(range(W)), backend=spec)
        assert dist.get_backend(g) == spec
        assert B.device_backends(g) == {"cpu": "gloo"}, B.device_backends(g)
        assert B.reference_device(g) == torch.device("cpu")
        assert bounded.default_check_calls(g) is True, spec

        buf = deep_ep.Buffer(g, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
            T, H, W, E), low_latency_mode=True, num_qps_per_rank=L)
        for i, variant in enumerate(VARIANTS[:2]):
            fails += group_round(buf, rank, W, 400 + 10 * n + i, variant, "cpu",
                                 thread_hooks=True, tag=spec)
        ep = buf.ep_buffer
        assert ep.backend == "reference" and ep.device == torch.device("cpu"), ep.backend_reason
        assert ep.check_calls is True and ep._impl.calls.bounded is True, spec
        buf.destroy()

        # the call check runs on this group: ranks that disagree get CommMismatchError, not an
        # abort inside gloo
        ep = llcomm.EPBuffer(g, num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T)
        x = torch.zeros(2, H, dtype=torch.bfloat16, device="cpu")
        idx = torch.zeros(2, 2 if rank == 0 else 1, dtype=torch.int64, device="cpu")
        with pytest.raises(llcomm.CommMismatchError):
            ep.dispatch(x, idx)
        ep.close()

        # a tensor of another device: refused naming the group argument and what carries GPUs
        ep = llcomm.EPBuffer(g, num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T)
        with pytest.raises(ValueError) as e:
            ep.dispatch(torch.zeros(2, H, dtype=torch.bfloat16, device="meta"),
                        torch.zeros(2, K, dtype=torch.int64, device="cpu"))
        msg = str(e.value)
        assert "x is on meta; expected cpu" in msg and "group argument" in msg, msg
        assert 'backend="cpu:gloo,cuda:nccl"' in msg, msg
        ep.close()

        comm = llcomm.Communicator(g, max_bytes=1 << 16)
        assert comm.backend == "reference" and comm._impl.calls.bounded is True
        y = comm.all_reduce(torch.full((8,), rank + 1.0, dtype=torch.float32, device="cpu"))
        assert torch.equal(y, torch.full((8,), W * (W + 1) / 2, dtype=torch.float32,
                                         device="cpu"))
        comm.close()
    return fails


@pytest.mark.parametrize("W", [2, 3])
def test_cpu_and_mixed_groups_with_hooks_from_another_thread(W):
    fails = [f for r in run_distributed(_cpu_groups_body, W, timeout=300) for f in r]
    assert not fails, "\n".join(fails[:20])


def _thread_hooks_world_body(rank, W):
    """The default group: every variant, hooks in another thread and on this one alternately,
    in one Buffer (the other thread's hooks keep the buffer's order of calls)."""
    import llcomm.deep_ep as deep_ep
    buf = deep_ep.Buffer(None)
    fails = []
    for i, variant in enumerate(VARIANTS):
        fails += group_round(buf, rank, W, 500 + i, variant, "cpu", thread_hooks=i % 2 == 0,
                             tag="world")
    buf.destroy()
    return fails


def test_hooks_from_another_thread_on_the_reference_backend():
    fails = [f for r in run_distributed(_thread_hooks_world_body, 2, timeout=300) for f in r]
    assert not fails, "\n".join(fails[:20])
