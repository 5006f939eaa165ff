"""Single-batch overlap (SBO) arguments of ``Buffer.low_latency_combine``: send a block of
expert outputs only once the expert GEMM that writes it has signalled it done
(docs/deep_ep.md, "Single-batch overlap").

SGLang's single-batch overlap runs the down GEMM on one stream and the combine on another,
started together, and passes the GEMM's completion signals to the combine, in one of two forms
(DeepEP's branches that take them: ``antgroup-opt``, PR 483, for Hopper; ``hybrid-ep``, PR 468,
for Blackwell; SGLang's ``sglang.srt.batch_overlap.single_batch_overlap`` makes the signals
and ``sglang.srt.layers.moe.token_dispatcher.deepep`` passes them):

- **Hopper** ``overlap=True, packed_recv_count=, comp_signal=, block_m=, threshold=,
  num_sms=``: ``comp_signal`` is int32 ``[L * ceil(W * T / block_m)]`` (at least that many), one
  word per (local expert ``e``, block ``b`` of ``block_m`` rows), at ``e * ceil(W * T /
  block_m) + b``; rows ``b * block_m .. (b + 1) * block_m - 1`` of expert e may be sent once it
  reaches ``threshold`` (both set by DeepGEMM, which counts the tiles of the block it has
  finished). Only the blocks that hold rows, ``b < ceil(packed_recv_count[e] / block_m)``, are
  waited for; ``packed_recv_count`` is the dispatch's ``recv_count``. ``num_sms`` (the SMs
  DeepEP's send may use) is checked and unused.
- **Blackwell** ``overlap=True, src_signals=, src_signal_expect_value=``: ``src_signals`` is
  uint32 (or int32) ``[L]``, one word per local expert, whose rows may be sent once it reaches
  ``src_signal_expect_value``; every expert's word is waited for (as in DeepEP).

A signal counts as reached once its value is at least the threshold (DeepEP's kernels wait for
equality; a word past it would hold them forever). With ``overlap=False`` (the default) these
arguments are not read, as in DeepEP; ``overlap=True`` without any signal waits for nothing.

**What is implemented**: before the combine's send, one wait for *every* (expert, block) signal
the combine will read, then the normal combine: the result is correct while the GEMM is still
running, but no block is sent before the last one is done (no per-block overlap yet). The wait
is bounded by the buffer's ``timeout_ms``:

- on the CPU (the reference backend on gloo) the host polls the signals with torch ops and
  raises ``CommTimeoutError`` naming the first signal not reached, before anything is sent;
- on the GPU a small kernel (``overlap_kernel.py``) waits on the current stream, so the
  combine queued after it starts when it ends. A signal not reached in time is recorded (the
  combine then sends whatever the rows hold) and the next ``low_latency_combine`` with
  ``overlap=True`` raises ``CommTimeoutError`` naming it, before launching anything; every
  later one raises it again. The buffer's peers may time out waiting for this rank.
"""
from __future__ import annotations

import time

import torch

from ..errors import CommTimeoutError
from ..runtime import validate as V
from .checks import check_bools, check_int

#: Host polling interval of the CPU wait, seconds.
POLL_S = 0.0005
_SIGNAL_DTYPES = {"comp_signal": (torch.int32,), "src_signals": (torch.uint32, torch.int32)}


def _check_signal(pr: V.Problems, name: str, sig, numel: int, device) -> bool:
    """A 1-D contiguous signal tensor of ``_SIGNAL_DTYPES[name]`` with at least ``numel``
    elements on ``device``; True when it is one."""
    dtypes = _SIGNAL_DTYPES[name]
    if not isinstance(sig, torch.Tensor):
        pr.add(f"{name} must be a torch.Tensor, got {type(sig).__name__}", type_error=True)
    elif sig.dtype not in dtypes:
        pr.add(f"{name} has dtype {sig.dtype}; expected "
               f"{' or '.join(map(str, dtypes))}", type_error=True)
    elif sig.dim() != 1 or not sig.is_contiguous():
        pr.add(f"{name} must be a contiguous 1-D tensor, got shape {tuple(sig.shape)}")
    elif sig.numel() < numel:
        pr.add(f"{name} has {sig.numel()} elements; expected at least {numel}")
    elif sig.device != device:
        pr.add(f"{name} is on {sig.device}; expected {device}")
    else:
        return True
    return False


def plan(fn: str, ep, overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms,
         src_signals, src_signal_expect_value):
    """Check the overlap arguments (ValueError / TypeError naming them); the wait to make as
    ``(signal, counts or None, per_expert, block_m, threshold, unsigned)``, or None."""
    pr = V.Problems(f"deep_ep.Buffer.{fn}")
    check_bools(pr, overlap=overlap)
    if overlap is not True:
        pr.raise_if_any()
        return None
    L, R, device = ep.num_local_experts, ep.num_ranks * ep.max_tokens, ep.device
    if comp_signal is not None and src_signals is not None:
        pr.add("comp_signal and src_signals are both given: pass one form of compute "
               "signals (comp_signal with block_m / threshold, or src_signals with "
               "src_signal_expect_value)")
    elif comp_signal is not None:
        ok = check_int(pr, "block_m", block_m, 1) & check_int(pr, "threshold", threshold, 1) \
            & check_int(pr, "num_sms", num_sms, 1)
        per_expert = -(-R // block_m) if ok else 0
        ok &= _check_signal(pr, "comp_signal", comp_signal, L * per_expert, device)
        if packed_recv_count is None:
            pr.add("overlap=True with comp_signal needs packed_recv_count: the dispatch's "
                   "recv_count (int32 [num_local_experts]), which says the blocks to wait for")
        elif not isinstance(packed_recv_count, torch.Tensor):
            pr.add(f"packed_recv_count must be a torch.Tensor, got "
                   f"{type(packed_recv_count).__name__}", type_error=True)
        elif packed_recv_count.dtype != torch.int32:
            pr.add(f"packed_recv_count has dtype {packed_recv_count.dtype}; expected "
                   "torch.int32", type_error=True)
        elif tuple(packed_recv_count.shape) != (L,):
            pr.add(f"packed_recv_count has shape {tuple(packed_recv_count.shape)}; expected "
                   f"[num_local_experts] = [{L}]")
        elif packed_recv_count.device != device:
            pr.add(f"packed_recv_count is on {packed_recv_count.device}; expected {device}")
        pr.raise_if_any()
        return comp_signal, packed_recv_count.contiguous(), per_expert, block_m, threshold, False
    elif src_signals is not None:
        _check_signal(pr, "src_signals", src_signals, L, device)
        if check_int(pr, "src_signal_expect_value", src_signal_expect_value) \
                and src_signal_expect_value >= 1 << 32:
            pr.add(f"src_signal_expect_value={src_signal_expect_value}; expected a uint32 "
                   f"(below {1 << 32})")
        pr.raise_if_any()
        return src_signals.view(torch.int32), None, 1, 1, src_signal_expect_value, True
    pr.raise_if_any()
    return None


def _status(buf, device):
    """This Buffer's record of a GPU wait that ran out: (device word, pinned host copy)."""
    st = getattr(buf, "_overlap_status", None)
    if st is None:
        st = buf._overlap_status = (
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=True))
    return st


def _timeout(fn: str, ep, index: int, per_expert: int, earlier: bool) -> CommTimeoutError:
    e, b = divmod(index, per_expert)
    when = ("an earlier low_latency_combine's wait" if earlier else "the wait before the send")
    return CommTimeoutError(
        f"llcomm.deep_ep.Buffer.{fn}: overlap=True: {when} ran past timeout_ms="
        f"{ep.timeout_ms}: the compute signal of local expert {e}, block {b} (element {index}) "
        "never reached its threshold. The expert GEMM did not signal it: check that it runs "
        "and that threshold / block_m are the ones it was given. The combine of that round "
        "did not send correct rows (or, on the CPU, nothing), so its peers fail too: destroy "
        "the Buffer and create a new one.", op="low_latency_combine",
        phase="compute signal wait", ranks=())


def wait_before_send(buf, fn: str, ep, **args) -> None:
    """``low_latency_combine``'s overlap arguments (``args``, DeepEP's names): check them, then
    wait until every signal the combine reads has reached its threshold (module doc)."""
    if ep.device.type == "cuda" and getattr(buf, "_overlap_status", None) is not None:
        word = int(buf._overlap_status[1][0])       # pinned copy: read without a sync
        if word:
            raise _timeout(fn, ep, word - 1, max(1, getattr(buf, "_overlap_per_expert", 1)),
                           True)
    p = plan(fn, ep, **args)
    if p is None:
        return
    signal, counts, per_expert, block_m, threshold, unsigned = p
    if ep.device.type == "cuda":
        from .overlap_kernel import wait_signals
        dev, host = _status(buf, ep.device)
        buf._overlap_per_expert = per_expert
        L = ep.num_local_experts
        wait_signals[(L,)](signal, counts if counts is not None else signal, dev, per_expert,
                           block_m, threshold, ep.timeout_ms * 1000,
                           HAS_COUNTS=counts is not None, UNSIGNED=unsigned)
        host.copy_(dev, non_blocking=True)
        return
    wait_on_host(signal, signals_to_wait(counts, ep.num_local_experts, per_expert, block_m),
                 threshold, unsigned, ep.timeout_ms,
                 lambda i: _timeout(fn, ep, i, per_expert, False))


def signals_to_wait(counts, num_experts: int, per_expert: int, block_m: int) -> list[int]:
    """Indices of the signals a wait reads: blocks ``b < ceil(counts[e] / block_m)`` of each
    expert, or one per expert where ``counts`` is None."""
    if counts is None:
        return [e * per_expert for e in range(num_experts)]
    return [e * per_expert + b for e, n in enumerate(counts.tolist())
            for b in range(-(-n // block_m))]


def wait_on_host(signal: torch.Tensor, indices: list[int], threshold: int, unsigned: bool,
                 timeout_ms: int, error) -> None:
    """The CPU wait: poll ``signal`` (written by another thread) until each of its elements
    ``indices`` is at least ``threshold`` (as uint32 where ``unsigned``); past ``timeout_ms``
    raise ``error(the first index not reached)``."""
    idx = torch.tensor(indices, dtype=torch.int64, device=signal.device)
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        got = signal.index_select(0, idx).to(torch.int64)
        if unsigned:
            got &= 0xFFFFFFFF
        short = (got < threshold).nonzero()
        if short.numel() == 0:
            return
        if time.monotonic() > deadline:
            raise error(indices[int(short[0, 0])])
        time.sleep(POLL_S)
