"""Move an engine's DeepEP low-latency MoE calls onto ``llcomm.EPBuffer`` (docs/integration.md).

``DeepEPLowLatency`` has the signatures of DeepEP's ``Buffer.low_latency_dispatch`` /
``low_latency_combine`` (the subset llcomm implements) and returns the same tuples, so the MoE
layer's code stays as it is. The layer below routes tokens top-k, runs each local expert on its
rows and combines, four ways (bf16 and FP8 dispatch, each whole and split by the receive hook);
each result is checked against every expert applied to every token on one rank.

    python examples/deepep_low_latency.py    # 2 local processes (GPUs if there are two, else CPU)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import llcomm
from llcomm.ep.fp8 import dequantize
from _launch import device, launch


class _Done:
    """Stands in for DeepEP's EventOverlap: llcomm's calls are ordered on the current stream."""

    def current_stream_wait(self) -> None:
        pass


def _set_options(options: dict) -> list[str]:
    """DeepEP options given a value other than their off default (None / False)."""
    return sorted(k for k, v in options.items() if v is not None and v is not False)


def _no_hook() -> None:
    """Stands in for DeepEP's receive hook when ``return_recv_hook=False``: the call was whole."""


class DeepEPLowLatency:
    """DeepEP's low-latency dispatch / combine calls on an ``llcomm.EPBuffer``.

    Construct where the engine constructs its ``deep_ep.Buffer`` (a collective), with the
    ``num_max_dispatch_tokens_per_rank``, ``hidden`` and ``num_experts`` it passes to the calls.
    ``use_fp8``, ``round_scale`` and ``return_recv_hook`` are forwarded to the EPBuffer (same
    meaning, same results as DeepEP's shapes; the FP8 format is docs/ep.md's). Options llcomm does
    not implement (``use_ue8m0``, the statistics tensors, ``use_logfmt``) raise
    NotImplementedError instead of being ignored.
    """

    def __init__(self, group, *, num_max_dispatch_tokens_per_rank: int, hidden: int,
                 num_experts: int, dtype: torch.dtype = torch.bfloat16):
        self.buf = llcomm.EPBuffer(group, num_experts=num_experts, hidden=hidden,
                                   num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                   dtype=dtype)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *,
                             use_fp8: bool = True, round_scale: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             **unsupported):
        """Returns ``(recv_x, recv_count, handle, event, hook)`` as DeepEP does; ``recv_x`` is
        ``(x_fp8, scales)`` with ``use_fp8`` (DeepEP's default; scales here are a plain
        row-major float32 ``[L, W * T, hidden / 128]``, see docs/ep.md). With
        ``return_recv_hook`` the outputs are filled when ``hook()`` has been called."""
        bad = _set_options(unsupported)
        if bad:
            raise NotImplementedError(f"llcomm EPBuffer: {bad} are not implemented "
                                      "(docs/ep.md, 'Differences from DeepEP')")
        if (num_max_dispatch_tokens_per_rank, num_experts) != (self.buf.max_tokens,
                                                               self.buf.num_experts):
            raise ValueError("num_max_dispatch_tokens_per_rank / num_experts differ from the "
                             "EPBuffer's; create it with the values the calls use")
        r = self.buf.dispatch(x, topk_idx, use_fp8=use_fp8, round_scale=round_scale,
                              return_recv_hook=return_recv_hook)
        return (*r[:3], _Done(), r[3] if return_recv_hook else _no_hook)

    def get_next_low_latency_combine_buffer(self, handle):
        """Where the experts may write their outputs for ``low_latency_combine(...,
        zero_copy=True)`` (``EPBuffer.get_combine_input``; llcomm's combine never copies its
        input, so any tensor of this shape is as good)."""
        return self.buf.get_combine_input(handle)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, **unsupported):
        """Returns ``(combined_x, event, hook)`` as DeepEP does (``zero_copy`` changes nothing:
        ``x`` is read in place either way)."""
        bad = _set_options(unsupported)
        if bad:
            raise NotImplementedError(f"llcomm EPBuffer: {bad} are not implemented")
        r = self.buf.combine(x, topk_idx, topk_weights, handle, out=out,
                             return_recv_hook=return_recv_hook)
        if return_recv_hook:
            return r[0], _Done(), r[1]
        return r, _Done(), _no_hook


#: Relative error (Frobenius) of the layer's output allowed with FP8 dispatch.
FP8_REL_ERR = 0.1


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

    def moe_layer(use_fp8: bool, return_recv_hook: bool):
        # --- the MoE layer, as an engine writes it against DeepEP's low-latency API -----------
        recv_x, recv_count, handle, event, hook = ep.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts, use_fp8=use_fp8, round_scale=use_fp8,
            return_recv_hook=return_recv_hook)
        event.current_stream_wait()
        hook()                        # other work would go before this (docs/ep.md, split phase)
        if use_fp8:
            recv_x = dequantize(*recv_x, dtype)      # or feed an FP8 grouped GEMM
        expert_out = ep.get_next_low_latency_combine_buffer(handle)
        counts = recv_count.tolist()  # a host sync, fine in an example (a grouped GEMM avoids it)
        for e in range(local):
            rows = recv_x[e, :counts[e]]
            expert_out[e, :counts[e]] = expert_mlp(w1[rank * local + e], w2[rank * local + e],
                                                   rows)
        y, event, hook = ep.low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                zero_copy=True, return_recv_hook=return_recv_hook)
        hook()
        return y

    # --- check: every expert on every token, weighted, on this rank alone ---------------------
    want = torch.zeros(n, hidden, dtype=torch.float32, device=dev)
    for k in range(topk):
        for t in range(n):
            e = int(topk_idx[t, k])
            want[t] += topk_weights[t, k] * expert_mlp(w1[e], w2[e], x[t:t + 1])[0].float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    fp8_err = 0.0
    for hooks in (False, True):
        torch.testing.assert_close(moe_layer(False, hooks).float(), want, rtol=tol, atol=tol)
        # FP8 rows: e4m3 keeps 3 mantissa bits (2^-4 relative), so compare the whole layer's
        # output by its relative error
        err = float((moe_layer(True, hooks).float() - want).norm() / want.norm())
        fp8_err = max(fp8_err, err)
        if not err < FP8_REL_ERR:
            raise AssertionError(f"FP8 dispatch (hooks={hooks}): relative error {err:.3g} > "
                                 f"{FP8_REL_ERR}")
    ep.buf.check()
    ep.buf.close()
    if rank == 0:
        print(f"deepep_low_latency: ok (backend={ep.buf.backend}, FP8 dispatch relative error "
              f"{fp8_err:.3g} on rank 0)")


if __name__ == "__main__":
    launch(main)
