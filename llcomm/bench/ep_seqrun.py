"""Run a random EP call sequence (``ep_sequences``) on one rank and check every result.

    runner = SequenceRunner(buf, rank, world, num_experts=E, dtype=torch.bfloat16)
    fails = runner.run(seq)      # [] when every dispatch and combine matched the oracle

``buf`` is an ``EPBuffer`` (``seq.api == "ep"``) or an ``llcomm.deep_ep.Buffer`` (``"deep_ep"``);
every rank runs the same sequence at once. The oracle needs no communication: every rank
regenerates every rank's inputs from the step's seed and computes what it must receive and
what its combine must return:

- dispatch: ``recv_count``, every filled row (bytes; FP8 codes and scales against
  ``ep_oracle.fp8_oracle``, UE8M0 words packed from those scales), ``src_info`` (deep_ep: the
  source token, and ``layout_range``);
- combine: the documented order (docs/ep.md): per expert rank the entries in top-k order in
  fp32, rounded once, then the partials in rank order, rounded once; compared bit for bit. The
  experts are ``ep_oracle``'s stand-ins applied to the rows the oracle says were received
  (dequantised for FP8), written into a NaN-poisoned ``expert_out``, so a combine that reads a
  row it should not shows.

Outputs are poisoned before each call where the API takes them (``out=``), ``x`` after a
dispatch's send half and the experts' outputs after a combine's send half (both may be reused
then). The slow rank sleeps before a step when the step says so.
"""
from __future__ import annotations

import time

import torch

from . import ep_oracle
from .ep_sequences import UE8M0_CHANNELS, Combine, Dispatch, Sequence

#: Share of a token's top-k entries dropped to -1 (no expert).
DROP_CHANCE = 0.15
#: The e4m3 code of NaN, the poison of FP8 outputs.
FP8_NAN_BYTE = 0x7F
_FP32_EXP_SHIFT = 23
_SCALES_PER_WORD = UE8M0_CHANNELS // ep_oracle.FP8_BLOCK


def step_inputs(step: Dispatch, rank: int, world: int, num_experts: int, hidden: int,
                dtype: torch.dtype):
    """Every rank's ``(x, topk_idx)`` of a dispatch (CPU), and this rank's carried or combine
    weights are ``weights(seed, rank, n, topk)``. Distinct experts per token, some dropped."""
    xs, idxs = [], []
    for s in range(world):
        g = torch.Generator(device="cpu").manual_seed(step.seed * 131 + s)
        n = step.tokens[s]
        xs.append(torch.randn(n, hidden, generator=g, dtype=torch.float32, device="cpu").to(dtype))
        scores = torch.rand(n, num_experts, generator=g, dtype=torch.float32, device="cpu")
        idx = scores.topk(step.topk, dim=1).indices
        drop = torch.rand(n, step.topk, generator=g, dtype=torch.float32,
                          device="cpu") < DROP_CHANCE
        idxs.append(torch.where(drop, -1, idx).to(torch.int64).contiguous())
    return xs, idxs


def weights(seed: int, rank: int, n: int, topk: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed * 131 + 17 + rank)
    return (torch.rand(n, topk, generator=g, dtype=torch.float32, device="cpu") + 0.1).contiguous()


def expert_input(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows as the experts see them: ``x`` itself, or its FP8 form dequantised (the oracle's
    codes times the oracle's scales, in fp32, rounded to x's dtype)."""
    if fmt == "bf16" or x.shape[0] == 0:
        return x
    codes, scales = ep_oracle.fp8_oracle(x, round_scale=fmt != "fp8")
    q = codes.view(torch.float8_e4m3fn).float().view(*x.shape[:-1], -1, ep_oracle.FP8_BLOCK)
    return (q * scales.unsqueeze(-1)).view(x.shape).to(x.dtype)


def ue8m0_words(scales: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales ``[..., G]`` -> int32 ``[..., G / 4]``: the biased exponent of
    scale ``4 i + b`` in byte ``b`` of word ``i`` (docs/deep_ep.md)."""
    exp = (scales.contiguous().view(torch.int32).to(torch.int64) >> _FP32_EXP_SHIFT) & 0xFF
    exp = exp.view(*scales.shape[:-1], scales.shape[-1] // _SCALES_PER_WORD, _SCALES_PER_WORD)
    word = sum(exp[..., b] << (8 * b) for b in range(_SCALES_PER_WORD))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


class _Expected:
    """One dispatch as this rank must see it: the rows' (expert, row, source rank, token)."""

    def __init__(self, xs, idxs, rank: int, L: int):
        e_ix, j_ix, src, tok = [], [], [], []
        for e in range(L):
            g = rank * L + e
            j = 0
            for s, idx in enumerate(idxs):
                for t in (idx == g).any(1).nonzero().flatten().tolist():
                    e_ix.append(e), j_ix.append(j), src.append(s), tok.append(t)
                    j += 1
        self.e = torch.tensor(e_ix, dtype=torch.long, device="cpu")
        self.j = torch.tensor(j_ix, dtype=torch.long, device="cpu")
        self.src, self.tok = src, tok
        self.count = torch.bincount(self.e, minlength=L).to(torch.int32)
        H = xs[0].shape[1]
        self.rows = torch.stack([xs[s][t] for s, t in zip(src, tok)]) if src else \
            torch.empty(0, H, dtype=xs[0].dtype, device="cpu")


class SequenceRunner:
    """Runs sequences on this rank's buffer; see the module doc."""

    def __init__(self, buf, rank: int, world: int, *, num_experts: int, dtype: torch.dtype,
                 device: torch.device, sleep=time.sleep):
        self.buf, self.rank, self.world, self.E, self.dtype = buf, rank, world, num_experts, dtype
        self.device = torch.device(device)
        self.L = num_experts // world
        self.sleep = sleep
        self.scale, self.bias = ep_oracle.expert_affine(num_experts, "cpu")
        self.dispatches = self.combines = 0

    def ep_buffer(self):
        return self.buf if self.api == "ep" else self.buf.ep_buffer

    def run(self, seq: Sequence) -> list[str]:
        """Every step of ``seq``; the failures (empty: all matched). Exceptions propagate (a
        timeout or mismatch breaks the buffer: the caller stops)."""
        self.api, self.T, self.H = seq.api, seq.max_tokens, seq.hidden
        self.slow = seq.slow_rank == self.rank
        self.handles: dict = {}
        fails: list[str] = []
        deferred = None
        for i, step in enumerate(seq.steps):
            tag = f"seq {seq.seed} {seq.api} step {i}"
            self._delay(step.delay_s)
            if isinstance(step, Dispatch):
                finish = self._dispatch(step, tag, fails)
                if step.defer_hook:
                    deferred = finish
                else:
                    finish()
            else:
                self._combine(step, tag, fails)
                if deferred is not None:
                    deferred()
                    deferred = None
        ep = self.ep_buffer()
        if ep is not None:
            ep.check()
        return fails

    def _delay(self, s: float) -> None:
        if self.slow and s > 0:
            self.sleep(s)

    # -- dispatch -----------------------------------------------------------------------------
    def _dispatch(self, step: Dispatch, tag: str, fails: list):
        """Issue the dispatch (its send half with a hook); return the rest: hook and checks."""
        self.dispatches += 1
        xs, idxs = step_inputs(step, self.rank, self.world, self.E, self.H, self.dtype)
        dev = self.device
        # copies: x is poisoned after a send half, the oracle keeps xs
        x, idx = xs[self.rank].to(dev, copy=True), idxs[self.rank].to(dev, copy=True)
        fp8 = step.fmt != "bf16"
        w = weights(step.seed, self.rank, x.shape[0], step.topk) if step.carry else None
        if self.api == "ep":
            shape = (self.L, self.world * self.T, self.H)
            if fp8:
                codes = torch.full(shape, FP8_NAN_BYTE, dtype=torch.uint8, device=dev)
                scales = torch.full((*shape[:2], self.H // ep_oracle.FP8_BLOCK), float("nan"),
                                    dtype=torch.float32, device=dev)
                out = (codes.view(torch.float8_e4m3fn), scales)
            else:
                out = torch.full(shape, float("nan"), dtype=self.dtype, device=dev)
            got = self.buf.dispatch(x, idx, out=out, use_fp8=fp8,
                                    round_scale=step.fmt == "round_scale",
                                    return_recv_hook=step.hook,
                                    topk_weights=None if w is None else w.to(dev))
            recv, count, handle = got[:3]
            hook = got[3] if step.hook else None
        else:
            recv, count, handle, _, hook = self.buf.low_latency_dispatch(
                x, idx, self.T, self.E, use_fp8=fp8, round_scale=step.fmt in ("round_scale",
                                                                               "ue8m0"),
                use_ue8m0=step.fmt == "ue8m0", return_recv_hook=step.hook)
        want = _Expected(xs, idxs, self.rank, self.L)
        xin = expert_input(want.rows, step.fmt)
        g = want.e + self.rank * self.L
        y = (xin.float() * self.scale[g].unsqueeze(1) + self.bias[g].unsqueeze(1)).to(self.dtype)
        expert_out = torch.full((self.L, self.world * self.T, self.H), float("nan"),
                                dtype=self.dtype, device="cpu")
        expert_out[want.e, want.j] = y
        self.handles[step.handle] = dict(step=step, handle=handle, idx=idx, w=w,
                                         x=expert_input(xs[self.rank], step.fmt),
                                         expert_out=expert_out.to(dev))

        def finish():
            if hook is not None:
                x.fill_(float("nan"))           # the send half has the rows: x may be reused
                self._delay(step.hook_delay_s)
                hook()
            fails.extend(f"{tag} dispatch {step.fmt}: {m}" for m in
                         self._check_dispatch(step, want, recv, count, handle))
        return finish

    def _check_dispatch(self, step: Dispatch, want: _Expected, recv, count, handle) -> list[str]:
        fails = []
        if not torch.equal(count.cpu(), want.count):
            return [f"recv_count {count.tolist()} != {want.count.tolist()}"]
        dev = count.device
        e, j = want.e.to(dev), want.j.to(dev)
        if step.fmt == "bf16":
            if not torch.equal(_bits(recv[e, j].cpu()), _bits(want.rows)):
                fails.append("rows differ")
        else:
            codes, scales = ep_oracle.fp8_oracle(want.rows, step.fmt != "fp8")
            if not torch.equal(recv[0][e, j].cpu().view(torch.uint8), codes):
                fails.append("FP8 codes differ")
            got_s = recv[1][e, j].cpu()
            want_s = ue8m0_words(scales) if step.fmt == "ue8m0" else scales
            if not torch.equal(_bits(got_s), _bits(want_s)):
                fails.append(f"{'UE8M0 words' if step.fmt == 'ue8m0' else 'scales'} differ")
        tok = torch.tensor(want.tok, dtype=torch.int32, device="cpu")
        if self.api == "ep":
            src = torch.tensor(want.src, dtype=torch.int32, device="cpu") * self.T + tok
            if not torch.equal(handle.src_info[e, j].cpu(), src):
                fails.append("src_info differs")
            return fails
        if not torch.equal(handle[0][e, j].cpu(), tok):
            fails.append("src_info (source token) differs")
        per = torch.zeros(self.L, self.world, dtype=torch.int64, device="cpu")
        for ee, s in zip(want.e.tolist(), want.src):
            per[ee, s] += 1
        begin = per.cumsum(1) - per
        if not torch.equal(handle[1].cpu(), (begin << 32) | per):
            fails.append("layout_range differs")
        return fails

    # -- combine ------------------------------------------------------------------------------
    def _combine(self, step: Combine, tag: str, fails: list) -> None:
        self.combines += 1
        h = self.handles[step.handle]
        d: Dispatch = h["step"]
        idx, expert_out = h["idx"], h["expert_out"]
        if step.hook:               # poisoned after the send half; a later combine needs it
            expert_out = expert_out.clone()
        dev, n = idx.device, idx.shape[0]
        w = h["w"] if d.carry else weights(step.seed, self.rank, n, d.topk)
        out = torch.full((n, self.H), float("nan"), dtype=self.dtype, device=dev)
        if self.api == "ep":
            got = self.buf.combine(expert_out, idx, None if d.carry else w.to(dev), h["handle"],
                                   out=out, return_recv_hook=step.hook)
            hook = got[1] if step.hook else None
            reused = expert_out
        else:
            x = expert_out
            if step.zero_copy:
                zc = self.buf.get_next_low_latency_combine_buffer(h["handle"])
                zc.copy_(expert_out)
                x = torch.full_like(expert_out, float("nan"))   # not read: poisoned
                reused = zc
            else:
                reused = expert_out
            _, _, hook = self.buf.low_latency_combine(x, idx, w.to(dev), h["handle"],
                                                      zero_copy=step.zero_copy,
                                                      return_recv_hook=step.hook, out=out)
        if hook is not None:
            reused.fill_(float("nan"))      # the send half has read the experts' outputs
            self._delay(step.hook_delay_s)
            hook()
        want = ep_oracle.Expected._combine(h["x"], idx.cpu(), w, self.world, self.L,
                                           self.scale, self.bias)
        if not torch.equal(_bits(out.cpu()), _bits(want)):
            diff = (out.cpu().float() - want.float()).abs()
            fails.append(f"{tag} combine of handle {step.handle} ({d.fmt}"
                         f"{', carried' if d.carry else ''}"
                         f"{', zero copy' if step.zero_copy else ''}"
                         f"{', hook' if step.hook else ''}): {int((diff != 0).sum())} elements "
                         f"differ (max {float(diff.nan_to_num(float('inf')).max()) if n else 0})")

