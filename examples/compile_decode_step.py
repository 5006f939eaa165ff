"""A decode step with a TP all-reduce and an MoE dispatch / combine under
``torch.compile(fullgraph=True)``, through the custom ops of ``llcomm.ops`` (docs/compile.md).

    python examples/compile_decode_step.py   # 2 local processes (GPUs if there are two, else CPU)

On GPUs the default backend (Inductor) compiles it; on the CPU ``aot_eager`` (Inductor on the CPU
needs a C++ compiler and is slow to start).
"""
import torch
import torch.distributed as dist

import llcomm
import llcomm.ops as ops
from _launch import device, launch


def main():
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hidden, num_experts, topk, max_tokens = 256, 4 * ws, 2, 8
    comm = llcomm.Communicator(max_bytes=1 << 20)
    buf = llcomm.EPBuffer(num_experts=num_experts, hidden=hidden,
                          num_max_dispatch_tokens_per_rank=max_tokens, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    w_o = (torch.randn(hidden // ws, hidden, generator=g) / hidden ** 0.5).to(dev, dtype)
    w_router = torch.randn(hidden, num_experts, generator=g).to(dev, dtype)
    scale = torch.linspace(0.5, 1.5, num_experts // ws).to(dev, dtype).view(-1, 1, 1)

    def step(h_part):
        # attention output projection, row-parallel: partial products summed over ranks
        h = ops.all_reduce(comm, h_part @ w_o)
        # MoE: route, dispatch, experts (a per-expert scale here), combine
        weights, idx = torch.softmax(h.float() @ w_router.float(), -1).topk(topk, dim=-1)
        recv_x, recv_count, ticket = ops.ep_dispatch(buf, h, idx)
        y = ops.ep_combine(buf, recv_x * scale, idx, weights, ticket)
        return h + y

    compiled = torch.compile(step, fullgraph=True,
                             backend="inductor" if dev.type == "cuda" else "aot_eager")
    g.manual_seed(100 + rank)
    for tokens in (max_tokens, 3, max_tokens):   # TP: every rank has the batch's tokens
        h_part = torch.randn(tokens, hidden // ws, generator=g).to(dev, dtype)
        eager, got = step(h_part), compiled(h_part)
        torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
    comm.check()
    buf.check()
    buf.close()
    comm.close()
    if rank == 0:
        print(f"compile_decode_step: ok (backends {comm.backend} / {buf.backend})")


if __name__ == "__main__":
    launch(main)
