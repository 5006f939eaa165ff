"""An engine's DeepEP low-latency MoE layer on llcomm: ``import llcomm.deep_ep as deep_ep`` in
place of ``import deep_ep`` (docs/deep_ep.md).

The layer below is written against DeepEP's API, as engines write it: the size hint, the
``Buffer``, ``low_latency_dispatch`` / ``low_latency_combine`` with DeepEP's arguments, tuples and
layouts (FP8 scales column-major, UE8M0 packed), the receive hook, the zero-copy combine buffer
and the per-expert receive statistics. It runs bf16, FP8 and FP8 with UE8M0 scales, each whole
and split by the hook, and checks every result against every expert applied to every token on
one rank.

    python examples/deepep_low_latency.py    # 2 local processes (GPUs if there are two, else CPU)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import llcomm.deep_ep as deep_ep
from _launch import device, launch

#: Relative error (Frobenius) of the layer's output allowed with FP8 dispatch.
FP8_REL_ERR = 0.1


def expert_mlp(w1, w2, x):
    return torch.relu(x @ w1) @ w2


def dequantize(q: torch.Tensor, scales: torch.Tensor, use_ue8m0: bool, dtype) -> torch.Tensor:
    """DeepEP's FP8 rows back to ``dtype`` (an FP8 grouped GEMM would take them as they are):
    one scale per 128 channels, or with UE8M0 four exponent bytes per int32 word."""
    if use_ue8m0:
        shifts = torch.arange(4, device=q.device, dtype=torch.int32) * 8
        exponent = (scales.unsqueeze(-1) >> shifts) & 0xFF          # [..., H / 512, 4]
        scales = torch.pow(2.0, (exponent - 127).float()).flatten(-2)
    blocks = q.float().unflatten(-1, (-1, 128)) * scales.unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


def main():
    group = dist.group.WORLD
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hidden, ffn, num_experts, topk, max_tokens = 512, 64, 4 * ws, 2, 16
    local = num_experts // ws

    # --- start-up, as an engine does it ----------------------------------------------------
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, ws,
                                                                   num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=local)

    g = torch.Generator().manual_seed(0)                      # the same experts on every rank
    w1 = (torch.randn(num_experts, hidden, ffn, generator=g) / hidden ** 0.5).to(dev, dtype)
    w2 = (torch.randn(num_experts, ffn, hidden, generator=g) / ffn ** 0.5).to(dev, dtype)
    g.manual_seed(100 + rank)                                 # each rank its own tokens
    n = max_tokens - rank
    x = torch.randn(n, hidden, generator=g).to(dev, dtype)
    logits = torch.randn(n, num_experts, generator=g).to(dev)
    topk_weights, topk_idx = torch.softmax(logits, -1).topk(topk, dim=-1)
    stats = torch.zeros(local, dtype=torch.int32, device=dev)   # load monitoring
    received = torch.zeros(local, dtype=torch.int32)

    def moe_layer(use_fp8: bool, use_ue8m0: bool, return_recv_hook: bool):
        # --- the MoE layer, as an engine writes it against DeepEP's low-latency API ---------
        recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts, cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8, round_scale=use_ue8m0, use_ue8m0=use_ue8m0,
            async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
        if return_recv_hook:
            hook()                    # other work would go before this (docs/ep.md, split phase)
        else:
            event.current_stream_wait()
        if use_fp8:
            recv_x = dequantize(*recv_x, use_ue8m0, dtype)
        expert_out = buffer.get_next_low_latency_combine_buffer(handle)
        counts = recv_count.tolist()  # a host sync, fine in an example (a grouped GEMM avoids it)
        received.add_(recv_count.cpu())
        for e in range(local):
            rows = recv_x[e, :counts[e]]
            expert_out[e, :counts[e]] = expert_mlp(w1[rank * local + e], w2[rank * local + e],
                                                   rows)
        y, event, hook = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                    zero_copy=True,
                                                    return_recv_hook=return_recv_hook)
        if hook is not None:
            hook()
        return y

    # --- check: every expert on every token, weighted, on this rank alone -------------------
    want = torch.zeros(n, hidden, dtype=torch.float32, device=dev)
    for k in range(topk):
        for t in range(n):
            e = int(topk_idx[t, k])
            want[t] += topk_weights[t, k] * expert_mlp(w1[e], w2[e], x[t:t + 1])[0].float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    fp8_err = 0.0
    for hooks in (False, True):
        torch.testing.assert_close(moe_layer(False, False, hooks).float(), want, rtol=tol,
                                   atol=tol)
        # FP8 rows: e4m3 keeps 3 mantissa bits (2^-4 relative), so compare the whole layer's
        # output by its relative error
        for ue8m0 in (False, True):
            err = float((moe_layer(True, ue8m0, hooks).float() - want).norm() / want.norm())
            fp8_err = max(fp8_err, err)
            if not err < FP8_REL_ERR:
                raise AssertionError(f"FP8 dispatch (ue8m0={ue8m0}, hooks={hooks}): relative "
                                     f"error {err:.3g} > {FP8_REL_ERR}")
    if not torch.equal(stats.cpu(), received):
        raise AssertionError(f"receive statistics {stats.tolist()} != {received.tolist()}")
    backend = buffer.ep_buffer.backend
    buffer.destroy()
    if rank == 0:
        print(f"deepep_low_latency: ok (backend={backend}, FP8 dispatch relative error "
              f"{fp8_err:.3g} on rank 0, {num_rdma_bytes / 2 ** 20:.2f} MiB buffer)")


if __name__ == "__main__":
    launch(main)
