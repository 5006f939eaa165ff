"""Move an engine's DeepEP low-latency MoE calls onto ``llcomm.EPBuffer`` (docs/integration.md).

``DeepEPLowLatency`` has the signatures of DeepEP's ``Buffer.low_latency_dispatch`` /
``low_latency_combine`` (the subset llcomm implements) and returns the same tuples, so the MoE
layer's code stays as it is. The layer below routes tokens top-k, runs each local expert on its
rows and combines; the result is checked against every expert applied to every token on one rank.

    python examples/deepep_low_latency.py    # 2 local processes (GPUs if there are two, else CPU)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import llcomm
from _launch import device, launch


class _Done:
    """Stands in for DeepEP's EventOverlap: llcomm's calls are ordered on the current stream."""

    def current_stream_wait(self) -> None:
        pass


def _set_options(options: dict) -> list[str]:
    """DeepEP options given a value other than their off default (None / False)."""
    return sorted(k for k, v in options.items() if v is not None and v is not False)


def _no_hook() -> None:
    """Stands in for DeepEP's receive hook: the data has arrived when dispatch returns."""


class DeepEPLowLatency:
    """DeepEP's low-latency dispatch / combine calls on an ``llcomm.EPBuffer``.

    Construct where the engine constructs its ``deep_ep.Buffer`` (a collective), with the
    ``num_max_dispatch_tokens_per_rank``, ``hidden`` and ``num_experts`` it passes to the calls.
    Options llcomm does not implement raise NotImplementedError instead of being ignored.
    """

    def __init__(self, group, *, num_max_dispatch_tokens_per_rank: int, hidden: int,
                 num_experts: int, dtype: torch.dtype = torch.bfloat16):
        self.buf = llcomm.EPBuffer(group, num_experts=num_experts, hidden=hidden,
                                   num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                   dtype=dtype)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *,
                             use_fp8: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, **unsupported):
        """Returns ``(recv_x, recv_count, handle, event, hook)`` as DeepEP does (bf16 path)."""
        bad = _set_options(unsupported)
        if use_fp8 or bad:
            raise NotImplementedError(f"llcomm EPBuffer: use_fp8=True / {bad} are not "
                                      "implemented (docs/ep.md, 'Differences from DeepEP')")
        if (num_max_dispatch_tokens_per_rank, num_experts) != (self.buf.max_tokens,
                                                               self.buf.num_experts):
            raise ValueError("num_max_dispatch_tokens_per_rank / num_experts differ from the "
                             "EPBuffer's; create it with the values the calls use")
        recv_x, recv_count, handle = self.buf.dispatch(x, topk_idx)
        return recv_x, recv_count, handle, _Done(), _no_hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, **unsupported):
        """Returns ``(combined_x, event, hook)`` as DeepEP does."""
        bad = _set_options(unsupported)
        if bad:
            raise NotImplementedError(f"llcomm EPBuffer: {bad} are not implemented")
        return self.buf.combine(x, topk_idx, topk_weights, handle, out=out), _Done(), _no_hook


def expert_mlp(w1, w2, x):
    return torch.relu(x @ w1) @ w2


def main():
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hidden, ffn, num_experts, topk, max_tokens = 128, 64, 4 * ws, 2, 16
    local = num_experts // ws
    ep = DeepEPLowLatency(None, num_max_dispatch_tokens_per_rank=max_tokens, hidden=hidden,
                          num_experts=num_experts, dtype=dtype)

    g = torch.Generator().manual_seed(0)                      # the same experts on every rank
    w1 = (torch.randn(num_experts, hidden, ffn, generator=g) / hidden ** 0.5).to(dev, dtype)
    w2 = (torch.randn(num_experts, ffn, hidden, generator=g) / ffn ** 0.5).to(dev, dtype)
    g.manual_seed(100 + rank)                                 # each rank its own tokens
    n = max_tokens - rank
    x = torch.randn(n, hidden, generator=g).to(dev, dtype)
    logits = torch.randn(n, num_experts, generator=g).to(dev)
    topk_weights, topk_idx = torch.softmax(logits, -1).topk(topk, dim=-1)

    # --- the MoE layer, as an engine writes it against DeepEP's low-latency API ---------------
    recv_x, recv_count, handle, event, hook = ep.low_latency_dispatch(
        x, topk_idx, max_tokens, num_experts, use_fp8=False)
    event.current_stream_wait()
    expert_out = torch.empty_like(recv_x)
    counts = recv_count.tolist()      # a host sync, fine in an example (a grouped GEMM avoids it)
    for e in range(local):
        rows = recv_x[e, :counts[e]]
        expert_out[e, :counts[e]] = expert_mlp(w1[rank * local + e], w2[rank * local + e], rows)
    y, event, hook = ep.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

    # --- check: every expert on every token, weighted, on this rank alone ---------------------
    want = torch.zeros(n, hidden, dtype=torch.float32, device=dev)
    for k in range(topk):
        for t in range(n):
            e = int(topk_idx[t, k])
            want[t] += topk_weights[t, k] * expert_mlp(w1[e], w2[e], x[t:t + 1])[0].float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)
    ep.buf.check()
    ep.buf.close()
    if rank == 0:
        print(f"deepep_low_latency: ok (backend={ep.buf.backend})")


if __name__ == "__main__":
    launch(main)
