"""The peer backend: TP ops as Triton kernels over the symmetric workspace (one host, NVLink).

Host side of ``llcomm/tp/kernels/``: owns the workspace, picks launch shapes, launches on the
caller's current stream. No host synchronisation and no allocation per call, so every op can be
captured in a CUDA graph. Device errors (timeouts, mismatches) land in a host-visible word that
is read before each launch and by ``check()``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import protocol as P
from ..runtime.kernels.lamport import ALL_STAGES
from ..runtime.launch import Launcher, Plan
from ..runtime.settings import TPSettings
from ..runtime.workspace import REGION_ALIGN, SymmetricWorkspace

# The grid size and the Lamport slot are TPSettings fields (llcomm/runtime/settings.py), read
# once by Communicator; the measured choices are constants below. The grid is fixed
# per communicator: block b of every op advances counter ctrl[b], so all counters stay equal to
# the number of ops run.

#: Largest slice one block moves per loop iteration, and its warps: 32 bytes in flight per thread
#: at 8 warps, enough outstanding NVLink stores to approach the link's bandwidth.
MAX_BLOCK_BYTES = 16 << 10
MAX_WARPS = 8
#: A block with several Lamport chunks receives chunk i - LAMPORT_LAG right after pushing chunk
#: i (lamport_all_reduce.lamport_kernel, LAG); a lag of 2 was no faster
#: (bench/results/ab/2026-11-30-lamport-chunk/).
LAMPORT_LAG = 1
#: Bytes a Lamport block moves per step (bench/results/ab/2026-11-30-lamport-chunk/).
LAMPORT_CHUNK_BYTES = 4 << 10
#: Launch plans kept per communicator (_plan: one per algorithm, size and dtype in use); past
#: this many the cache starts over, so an endless variety of sizes cannot grow it without bound.
PLAN_CACHE_MAX = 4096
#: The fused all-reduce + norm's "auto" takes Lamport up to this many bytes (measured there),
#: the flag one-shot above, whatever the slot size.
FUSED_LAMPORT_MAX_BYTES = 1 << 20
#: Idle Lamport words hold this 16-bit pattern (-0.0 in bf16 / fp16).
SENTINEL16 = -32768                      # 0x8000
SENTINEL32 = -2147450880                 # 0x80008000, the same two half-words seen as int32
#: Bytes of a Lamport tag word (int32, one per half, block and source rank; idle at 0), kept
#: after the data words in the Lamport region (runtime/kernels/lamport.py).
LAMPORT_TAG_BYTES = 4
#: broadcast / all-gather as LL words up to this, flag kernels above (kernels/ll.py; the LL
#: region holds 2 halves x W sources x twice the bytes).
#: Provenance: bench/results/ab/2026-11-30-ll-movement/.
LL_MAX_BYTES = 64 << 10
#: Bytes of an LL word: a 4-byte data word and its 4-byte epoch.
LL_WORD_BYTES = 8
#: Two-shot shards are rounded to this many elements so every shard starts 16-byte aligned.
SHARD_ALIGN = 16
#: Staging halves used alternately by consecutive ops (see kernels/all_reduce.py for why 2).
HALVES = 2
#: Mixes the row length into an all-gather's (and the fused norm's) size tag, and the root into
#: a broadcast's, so [2, 8] on one rank and [4, 4] on another, or two roots, are a mismatch.
GATHER_TAG_MIX = 65599
#: int64 words after the op counters in the (private) ctrl tensor: device error word, host word
#: address.
CTRL_ERR_WORDS = 2
#: Flag slots per block: entry barrier and exit barrier.
FLAG_PHASES = 2

#: The fused norms (``kernels/fused_norm.py``), by the Communicator method they run: the RESIDUAL
#: constexpr, the OUT mode (a name in fused_norm) and the op codes of the Lamport and the
#: one-shot kernel. Each variant has its own codes, so ranks that call two different ones in the
#: same round get a mismatch, and errors name the method.
FUSED_VARIANTS = {
    "all_reduce_residual_rmsnorm": (1, "PLAIN", P.OP_FUSED_LAMPORT, P.OP_FUSED_ONE_SHOT),
    "all_reduce_rmsnorm": (0, "PLAIN", P.OP_NORM_LAMPORT, P.OP_NORM_ONE_SHOT),
    "all_reduce_residual_rmsnorm_fp8": (1, "FP8_STATIC", P.OP_FP8_LAMPORT, P.OP_FP8_ONE_SHOT),
    "all_reduce_residual_rmsnorm_fp8_per_group": (1, "FP8_GROUP", P.OP_FP8_GROUP_LAMPORT,
                                                  P.OP_FP8_GROUP_ONE_SHOT),
}

#: Fused all-reduce + RMSNorm: a block holds one whole row in registers, 16 elements per thread
#: (32 bytes of bf16) up to FUSED_MAX_WARPS warps; hidden 8192 -> 16 warps.
FUSED_ELEMS_PER_WARP = 32 * 16
FUSED_MAX_WARPS = 16
#: Smallest row tile (a Triton block is a power of two of at least this many elements).
FUSED_MIN_BLOCK = 16

_TL_FLOAT = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def ll_bytes(max_bytes: int) -> int:
    """Largest LL broadcast / all-gather: LL_MAX_BYTES, at most max_bytes, in whole 4-byte
    words."""
    return min(max_bytes, LL_MAX_BYTES) // 4 * 4


def lamport_lag(n: int, block: int, nb: int) -> int:
    """LAG of ``lamport_all_reduce.lamport_kernel`` for n elements in chunks of ``block`` over
    ``nb`` blocks: 0 (the single-chunk kernel) unless some block has several chunks, else
    LAMPORT_LAG."""
    return LAMPORT_LAG if n > nb * block else 0


def _launch_shape(n: int, itemsize: int, nb: int,
                  max_block_bytes: int = MAX_BLOCK_BYTES) -> tuple[int, int]:
    """(BLOCK elements, num_warps): 16 bytes per thread per access, all ``nb`` blocks busy
    when there is enough work, at most ``max_block_bytes`` per block-iteration."""
    per_thread = max(16 // itemsize, 1)
    chunks = max(-(-n // nb), 1)
    block = 1 << (chunks - 1).bit_length()
    block = min(max(block, 32 * per_thread), max(max_block_bytes // itemsize, 32 * per_thread))
    return block, max(1, min(MAX_WARPS, block // (32 * per_thread)))


def _row_shape(hidden: int) -> tuple[int, int]:
    """(BLOCK elements, num_warps) of the fused kernels: one whole row per block-iteration."""
    block = max(1 << (hidden - 1).bit_length(), FUSED_MIN_BLOCK)
    return block, max(1, min(FUSED_MAX_WARPS, block // FUSED_ELEMS_PER_WARP))


def _nothing_to_reduce(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out


def _nothing_to_norm(x, residual, weight, out, res_out, qscale=None):
    return None


class PeerBackend:
    """Symmetric workspace plus the kernels. Created by ``Communicator``; a collective."""

    name = "peer"

    def __init__(self, group: dist.ProcessGroup, max_bytes: int, timeout_ms: int,
                 settings: TPSettings):
        import triton.language as tl  # kernels need Triton: fail here, not mid-op
        from .kernels import (all_reduce, fused_norm, lamport_all_reduce, ll, movement,
                              reduce_scatter)

        self._tl_float = {d: getattr(tl, name) for d, name in _TL_FLOAT.items()}
        self._k_ar = all_reduce
        self._k_lam = lamport_all_reduce
        self._k_mv = movement
        self._k_rs = reduce_scatter
        self._k_ll = ll
        self._k_fn = fused_norm
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = W = dist.get_world_size(group)
        self.nb = nb = settings.num_blocks
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_bytes = max_bytes
        self.timeout_us = timeout_ms * P.US_PER_MS
        self.lamport_bytes = min(max_bytes, settings.lamport_bytes)
        self.ll_bytes = ll_bytes(max_bytes)
        # the largest reduce_scatter output of the Lamport kernel (tests set 0: the flag one)
        self.rs_lamport_bytes = self.lamport_bytes
        self.cap_bytes = (max_bytes + 255) // 256 * 256
        # launch plans: (algo, n, dtype) all_reduce (_plan), ("reduce_scatter", m, dtype)
        # (_rs_plan), ("fused", ...) (fused_call)
        self._plans: dict = {}
        # Lamport region: the data slots, then the tag words (at an aligned offset, the same
        # for every dtype). The workspace is zeroed: tags start idle; data words idle at SENTINEL.
        lamport_data = -(-HALVES * W * self.lamport_bytes // REGION_ALIGN) * REGION_ALIGN
        self.ws = SymmetricWorkspace(group, {
            "flags": 8 * FLAG_PHASES * nb * W,
            "stage": HALVES * W * self.cap_bytes,
            "gather": HALVES * self.cap_bytes,
            "lamport": lamport_data + HALVES * nb * W * LAMPORT_TAG_BYTES,
            "ll": HALVES * W * self.ll_bytes // 4 * LL_WORD_BYTES,
        }, self.device)
        self.ws.local("lamport", torch.int16)[:lamport_data // 2].fill_(SENTINEL16)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)
        # Op counters and error words live in private device memory, not in the workspace: no
        # peer can rewrite this rank's round index or the address its error word is stored to.
        ctrl = torch.zeros(nb + CTRL_ERR_WORDS, dtype=torch.int64, device=self.device)
        self.ctrl = ctrl[:nb]
        self.err = ctrl[nb:]
        self.flags = self.ws.local("flags", torch.int64)
        self.tabs = {name: self.ws.table(name)
                     for name in ("flags", "stage", "gather", "lamport", "ll")}
        self.tabs["lamport_tags"] = self.tabs["lamport"] + lamport_data
        # Host-visible error word: pinned host memory is mapped into the GPU's address space
        # (UVA), so kernels store to it directly and the host reads it without a sync.
        self._launch = Launcher(self.device, settings.pdl)
        self._err = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=True)
        self._err_np = self._err.numpy()
        self.err[1].fill_(self._err.data_ptr())
        self._failure = P.FailureLatch(self.rank, "communicator")
        self.WP = 1 << (W - 1).bit_length()

    def _shape(self, block: int) -> dict:
        """The constexprs every TP kernel takes: ranks, ranks rounded up to a power of two (the
        flag vectors), the grid, and the elements a block moves per step."""
        return dict(WORLD=self.world_size, WORLD_POW2=self.WP, NUM_BLOCKS=self.nb, BLOCK=block)

    # -- errors ---------------------------------------------------------------------------------
    def _precheck(self) -> None:
        self._failure.check(self._err_np[0])

    def check(self) -> None:
        """Wait for this rank's queued work, then raise any error a kernel reported."""
        torch.cuda.current_stream(self.device).synchronize()
        self._precheck()

    def _tag(self, op: int, n: int, dtype: torch.dtype) -> int:
        return P.size_tag(op, n, str(dtype).removeprefix("torch."))

    @staticmethod
    def _lamport_tag(op: int, n: int, dtype: torch.dtype) -> int:
        return P.lamport_tag(op, n, str(dtype).removeprefix("torch."))

    @staticmethod
    def _rows_numel(tokens: int, hidden: int) -> int:
        """What the fused kernels' tags hash as the element count: the row length mixed in, so
        [2, 8] on one rank and [4, 4] on another differ."""
        return tokens * hidden * GATHER_TAG_MIX + hidden

    # -- all_reduce -----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, out: torch.Tensor, algo: str) -> torch.Tensor:
        return self.all_reduce_call(algo, x.numel(), x.dtype)(x, out)

    def all_reduce_call(self, algo: str, n: int, dtype: torch.dtype):
        """``all_reduce`` by ``algo`` of n elements of ``dtype``, bound to its launch plan:
        ``f(x, out) -> out`` (``Communicator.all_reduce``'s hot path)."""
        if n == 0:
            return _nothing_to_reduce
        plan = self._plan(algo, n, dtype)
        run, check, err = self._launch.run, self._failure.check, self._err_np

        def call(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            check(err[0])
            run(plan, x, out)
            return out
        return call

    def _plan(self, algo: str, n: int, dtype: torch.dtype) -> Plan:
        """The kept plan of ``algo`` on n elements of ``dtype`` (made on first use)."""
        return self._plans.get((algo, n, dtype)) or self._keep((algo, n, dtype),
                                                                self._make_plan(algo, n, dtype))

    def _make_plan(self, algo: str, n: int, dtype: torch.dtype) -> Plan:
        """What every all_reduce by ``algo`` ("one_shot", "two_shot" or "lamport") of n elements
        of ``dtype`` launches, bar its two tensors (a ``launch.Plan``: kernel, the arguments
        after x and out, num_warps, constexprs, the int views the Lamport kernel reads them as).
        Made once per (algo, n, dtype) and kept (PLAN_CACHE_MAX at most), so the per-call host
        path does no shape, tag, constexpr or cache-key work beyond the two tensors."""
        itemsize = dtype.itemsize
        W = self.world_size
        cap = self.cap_bytes // itemsize
        if algo == "lamport":
            return self._lamport_plan(self._k_lam.lamport_kernel, P.OP_LAMPORT, n, dtype)
        if algo == "one_shot":
            block, warps = _launch_shape(n, itemsize, self.nb)
            return Plan(self._k_ar.one_shot_kernel, self.nb, (
                n, self.tabs["stage"], self.tabs["flags"], self.flags, self.ctrl, self.err,
                self.rank, self._tag(P.OP_ONE_SHOT, n, dtype), self.timeout_us, cap), warps,
                self._shape(block), (None, None))
        shard = -(-n // W)
        shard = -(-shard // SHARD_ALIGN) * SHARD_ALIGN
        block, warps = _launch_shape(shard, itemsize, self.nb)
        return Plan(self._k_ar.two_shot_kernel, self.nb, (
            n, shard, self.tabs["stage"], self.tabs["gather"], self.tabs["flags"],
            self.flags, self.ctrl, self.err, self.rank, self._tag(P.OP_TWO_SHOT, n, dtype),
            self.timeout_us, cap), warps, self._shape(block),
            (None, None))

    def _lamport_plan(self, fn, op: int, n: int, dtype: torch.dtype) -> Plan:
        """The launch of a Lamport kernel ``fn`` (all-reduce, or reduce-scatter into n
        elements) tagged with ``op``: x and out read as int views, chunks of the Lamport chunk
        size, pipelined (LAG) where a block has several."""
        itemsize = dtype.itemsize
        block, warps = _launch_shape(n, itemsize, self.nb, LAMPORT_CHUNK_BYTES)
        view, sent = (torch.int16, SENTINEL16) if itemsize == 2 else (torch.int32, SENTINEL32)
        return Plan(fn, self.nb, (
            n, self.tabs["lamport"], self.tabs["lamport_tags"], self.ctrl, self.err,
            self.rank, self._lamport_tag(op, n, dtype), self.timeout_us,
            self.lamport_bytes // itemsize), warps, dict(
            SENTINEL=sent, FLOAT=self._tl_float[dtype], **self._shape(block), STAGES=ALL_STAGES,
            LAG=lamport_lag(n, block, self.nb)),
            (view, view))

    def _keep(self, key: tuple, plan: Plan) -> Plan:
        """Keep ``plan`` under ``key`` (PLAN_CACHE_MAX plans at most: then start over)."""
        if len(self._plans) >= PLAN_CACHE_MAX:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    # -- fused all-reduce + residual + RMSNorm -------------------------------------------------
    def fused_algo(self, nbytes: int) -> str:
        """Lamport up to FUSED_LAMPORT_MAX_BYTES (and the slot), the flag one-shot beyond."""
        return "lamport" if nbytes <= min(self.lamport_bytes, FUSED_LAMPORT_MAX_BYTES) \
            else "one_shot"

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps, out, res_out, algo):
        self.fused_call("all_reduce_residual_rmsnorm", algo, *x.shape, x.dtype, weight.dtype,
                        eps)(x, residual, weight, out, res_out)
        return out, res_out

    def fused_call(self, variant: str, algo: str, tokens: int, hidden: int, dtype: torch.dtype,
                   wdtype: torch.dtype, eps: float, round_scale: bool = False):
        """The fused norm ``variant`` (a FUSED_VARIANTS name) by ``algo`` of ``[tokens,
        hidden]`` rows, bound to its launch plan: ``f(x, residual, weight, out, res_out,
        qscale=None)``, which writes the outputs (``residual`` None without a residual;
        ``qscale`` the static scale or the per-group scales' output, None for plain outputs;
        the Communicator's hot paths keep it)."""
        if tokens == 0:
            return _nothing_to_norm
        key = ("fused", variant, algo, tokens, hidden, dtype, wdtype, eps, round_scale)
        plan = self._plans.get(key) or self._keep(key, self._fused_plan(
            variant, algo, tokens, hidden, dtype, eps, round_scale))
        run, check, err = self._launch.run, self._failure.check, self._err_np
        residual_read, out_mode = FUSED_VARIANTS[variant][:2]
        if out_mode == "PLAIN" and residual_read:
            def call(x, residual, weight, out, res_out, qscale=None):
                check(err[0])
                run(plan, x, residual, weight, out, res_out)
        elif out_mode == "PLAIN":
            # no residual: the kernel (RESIDUAL=0) never reads that pointer; x stands in for it
            def call(x, residual, weight, out, res_out, qscale=None):
                check(err[0])
                run(plan, x, x, weight, out, res_out)
        else:
            def call(x, residual, weight, out, res_out, qscale=None):
                check(err[0])
                run(plan, x, residual, weight, out, res_out, qscale)
        return call

    def _fused_plan(self, variant: str, algo: str, tokens: int, hidden: int, dtype: torch.dtype,
                    eps: float, round_scale: bool) -> Plan:
        """The fused kernel's launch bar x, residual, weight, out, res_out and (FP8 outputs)
        qscale: x read as ints, an FP8 out as bytes. A plain output's qscale is None in the
        tail: Triton takes a None argument as a compile-time constant, so the plain kernels
        have no such parameter at all (their code is the same as without it)."""
        block, warps = _row_shape(hidden)
        itemsize = dtype.itemsize
        view, sent = (torch.int16, SENTINEL16) if itemsize == 2 else (torch.int32, SENTINEL32)
        residual, out_name, op_lamport, op_one_shot = FUSED_VARIANTS[variant]
        out_mode = getattr(self._k_fn, out_name)
        plain = out_mode == self._k_fn.PLAIN
        views = (view, None, None, None, None) if plain else (view, None, None, torch.uint8,
                                                             None, None)
        lead = (None,) if plain else ()             # qscale, when it is not a leading tensor
        variant_consts = dict(RESIDUAL=residual, OUT=out_mode, ROUND=int(bool(round_scale)))
        ft = self._tl_float[dtype]
        rows = self._rows_numel(tokens, hidden)
        if algo == "lamport":
            return Plan(self._k_fn.lamport_norm_kernel, self.nb, (
                *lead, tokens, hidden, eps, self.tabs["lamport"], self.tabs["lamport_tags"],
                self.ctrl, self.err, self.rank, self._lamport_tag(op_lamport, rows, dtype),
                self.timeout_us, self.lamport_bytes // itemsize), warps, dict(
                SENTINEL=sent, FLOAT=ft, **self._shape(block),
                STAGES=ALL_STAGES, OP=op_lamport, **variant_consts), views)
        return Plan(self._k_fn.one_shot_norm_kernel, self.nb, (
            *lead, tokens, hidden, eps, self.tabs["stage"], self.tabs["flags"], self.flags,
            self.ctrl, self.err, self.rank, self._tag(op_one_shot, rows, dtype),
            self.timeout_us, self.cap_bytes // itemsize), warps, dict(
            FLOAT=ft, **self._shape(block), STAGES=ALL_STAGES,
            OP=op_one_shot, **variant_consts), views)

    # -- movement -------------------------------------------------------------------------------
    @staticmethod
    def _word_views(row_bytes: int, *ts: torch.Tensor) -> list[torch.Tensor]:
        """Movement kernels copy words, whatever the dtype (bool, float8, int64, ...): int32
        views when every row and every address is 4-byte aligned, else uint8 views (a 1-byte
        dtype of 3 elements, a row of 6 bytes). Either is exact."""
        words = row_bytes % 4 == 0 and all(t.data_ptr() % 4 == 0 for t in ts)
        return [t.view(-1).view(torch.uint8).view(torch.int32 if words else torch.uint8)
                for t in ts]

    @staticmethod
    def _moved_numel(xb: torch.Tensor, mix: int) -> int:
        """What a movement op's tag hashes as its element count (beside x's dtype, which has a
        code of its own: protocol.DTYPE_CODES): the words of ``xb`` (its word view), their
        width, and ``mix`` (a broadcast's root, a gather's row length in words). So ranks that
        disagree about numel, dtype, root or row length are a mismatch, and so are ranks whose
        tensors are aligned differently: one moves int32 words, the other bytes, and their
        blocks would copy different ranges (without the width, 8 bytes as 2 words would meet
        2 bytes as 2 bytes)."""
        return (xb.numel() * 2 + (xb.element_size() == 4)) * GATHER_TAG_MIX + mix

    def _ll(self, xb: torch.Tensor, n: int, numel_tag: int, dtype: torch.dtype, op: int,
            out: torch.Tensor, part: int, src: int) -> bool:
        """Launch the LL kernel (kernels/ll.py) if LL is on and the message fits in 4-byte
        words; else return False for the flagged kernel."""
        if xb.element_size() != 4 or n * 4 > self.ll_bytes:
            return False
        block, warps = _launch_shape(n, 4, self.nb)
        self._launch(self._k_ll.ll_gather_kernel, self.nb, (
            xb, out, n, part, src, self.tabs["ll"], self.tabs["lamport_tags"], self.ctrl,
            self.err, self.rank, self._lamport_tag(op, numel_tag, dtype), self.timeout_us,
            self.ll_bytes // 4), warps,
            op=op, BCAST=int(op == P.OP_BROADCAST), **self._shape(block), STAGES=ALL_STAGES)
        return True

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        xb, = self._word_views(x.numel() * x.element_size(), x)
        n = xb.numel()
        if n == 0:
            return x
        self._precheck()
        # the root is in the tag: ranks that disagree about it are a mismatch
        numel_tag = self._moved_numel(xb, src)
        if self._ll(xb, n, numel_tag, x.dtype, P.OP_BROADCAST, xb, n, src):
            return x
        block, warps = _launch_shape(n, xb.element_size(), self.nb)
        self._launch(self._k_mv.broadcast_kernel, self.nb, (
            xb, n, src, self.tabs["stage"], self.tabs["flags"], self.flags, self.ctrl,
            self.err, self.rank, self._tag(P.OP_BROADCAST, numel_tag, x.dtype), self.timeout_us,
            self.cap_bytes // xb.element_size()), warps,
            **self._shape(block))
        return x

    def _gather(self, x: torch.Tensor, out: torch.Tensor, rows: int) -> torch.Tensor:
        xb, ob = self._word_views(x.numel() * x.element_size() // max(rows, 1), x, out)
        n = xb.numel()
        if n == 0:
            return out
        self._precheck()
        numel_tag = self._moved_numel(xb, n // rows)
        if self._ll(xb, n, numel_tag, x.dtype, P.OP_ALL_GATHER, ob, n // rows, 0):
            return out
        block, warps = _launch_shape(n, xb.element_size(), self.nb)
        self._launch(self._k_mv.all_gather_kernel, self.nb, (
            xb, ob, n, n // rows, self.tabs["stage"], self.tabs["flags"], self.flags, self.ctrl,
            self.err, self.rank, self._tag(P.OP_ALL_GATHER, numel_tag, x.dtype),
            self.timeout_us, self.cap_bytes // xb.element_size()), warps,
            **self._shape(block))
        return out

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self._gather(x, out, 1)

    def all_gather_2d(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self._gather(x, out, x.shape[0])

    # -- reduce_scatter -------------------------------------------------------------------------
    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        m = out.numel()
        if m == 0:
            return out
        self._precheck()
        self._launch.run(self._rs_plan(m, x.dtype), x, out)
        return out

    def _rs_plan(self, m: int, dtype: torch.dtype) -> Plan:
        """The kept plan of a reduce_scatter into m elements of ``dtype`` (made on first use)."""
        key = ("reduce_scatter", m, dtype)
        return self._plans.get(key) or self._keep(key, self._make_rs_plan(m, dtype))

    def _make_rs_plan(self, m: int, dtype: torch.dtype) -> Plan:
        """reduce_scatter's launch bar x and out: the Lamport kernel for outputs up to the
        Lamport slot, the flag kernel above (the Lamport one was faster at every size
        measured: bench/results/ab/2026-11-30-reduce-scatter-lamport/)."""
        if m * dtype.itemsize <= self.rs_lamport_bytes:
            return self._lamport_plan(self._k_rs.lamport_reduce_scatter_kernel,
                                      P.OP_LAMPORT_REDUCE_SCATTER, m, dtype)
        block, warps = _launch_shape(m, dtype.itemsize, self.nb)
        return Plan(self._k_rs.reduce_scatter_kernel, self.nb, (
            m, self.tabs["stage"], self.tabs["flags"], self.flags, self.ctrl, self.err,
            self.rank, self._tag(P.OP_REDUCE_SCATTER, m, dtype), self.timeout_us,
            self.cap_bytes // dtype.itemsize), warps,
            self._shape(block), (None, None))

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
