"""The fused joins of ``Communicator``: all-reduce + (residual add) + RMSNorm (+ FP8 quantisation)
in one kernel, the joins a decode step runs around every attention and MLP block.

``FusedJoins`` holds the four methods and their checks; ``Communicator`` inherits them. Each runs
one kernel of ``llcomm/tp/kernels/fused_norm.py`` on the peer backend (the variant a constexpr,
``peer.FUSED_VARIANTS``) and the same arithmetic in torch on the reference backend.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..runtime import fp8_format as F8
from ..runtime import validate as V

#: all_reduce_residual_rmsnorm algorithms (auto: lamport while x fits a Lamport slot).
FUSED_ALGOS = ("auto", "one_shot", "lamport")
#: all_reduce_residual_rmsnorm: longest row. The peer kernel keeps a whole row in one block's
#: registers (32 fp32 per thread at 16 warps); the reference backend enforces the same bound so
#: code that runs on one backend runs on the other.
FUSED_MAX_HIDDEN = 16384
#: Channels per scale of ``all_reduce_residual_rmsnorm_fp8_per_group``
#: (llcomm/runtime/fp8_format.py).
FP8_GROUP = F8.FP8_BLOCK


class _Join(NamedTuple):
    """One fused join: its method name (also the backends' variant and the error prefix),
    whether it reads a residual, and its FP8 output (None, "static" or "group")."""
    name: str
    residual: bool
    fp8: str | None


_RESIDUAL_RMSNORM = _Join("all_reduce_residual_rmsnorm", True, None)
_RMSNORM = _Join("all_reduce_rmsnorm", False, None)
_FP8 = _Join("all_reduce_residual_rmsnorm_fp8", True, "static")
_FP8_GROUP = _Join("all_reduce_residual_rmsnorm_fp8_per_group", True, "group")


def _apart(a, b) -> bool:
    """Outputs ``a`` and ``b`` (None: allocated) do not start at the same address."""
    return a is None or b is None or not a.numel() or a.data_ptr() != b.data_ptr()


def _check_result(pr: V.Problems, name: str, t, shape: tuple, dtype: torch.dtype,
                  device: torch.device, what: str) -> None:
    """An optional output ``t`` (None: allocated) has ``shape`` and ``dtype`` (``what``
    says why that dtype)."""
    if t is None or not V.check_tensor(pr, name, t, device, dtypes=None, written=True):
        return
    if tuple(t.shape) != tuple(shape):
        pr.add(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if t.dtype != dtype:
        pr.add(f"{name} has dtype {t.dtype}; expected {dtype} ({what})", type_error=True)


class FusedJoins:
    """The fused all-reduce + norm joins of ``Communicator`` (which defines ``device``,
    ``max_bytes``, ``backend``, ``_impl``, ``_hot_fused`` and the hot-path checks)."""

    def all_reduce_residual_rmsnorm(
            self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float = 1e-6, *, out: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None,
            algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """The join after a row-parallel projection: all-reduce, residual add, RMSNorm, fused.

        Per token row, with ``round`` the conversion to x's dtype::

            s = all_reduce(x)                                # fp32, rank order, rounded once
            h = round(float(s) + float(residual))            # -> residual_out
            y = round(h * rsqrt(mean(h * h) + eps) * weight) # fp32 -> out

        The norm reads the *rounded* ``h`` (what TensorRT-LLM / FlashInfer's allreduce fusion
        and vLLM's fused_add_rms_norm do), so ``out`` is the norm of exactly the residual stream
        the next layer reads; ``residual_out`` equals the unfused ``all_reduce(x) + residual``
        bit for bit on the peer backend.

        Args:
            x: ``[tokens, hidden]``, contiguous, bf16 / fp16 / fp32, at most ``max_bytes``,
                ``hidden <= FUSED_MAX_HIDDEN`` (16384). This rank's partial sums; not modified
                (unless ``out is x``).
            residual: ``[tokens, hidden]``, x's dtype. Must be the same on every rank for the
                results to be the same on every rank (it is, in tensor parallelism).
            weight: ``[hidden]``, bf16 / fp16 / fp32 (read in fp32).
            eps: positive finite float added to the mean square.
            out: optional ``[tokens, hidden]`` of x's dtype for the normalised rows (may be x).
            residual_out: optional ``[tokens, hidden]`` of x's dtype for ``h`` (may be
                ``residual``: in-place update of the residual stream). Must not be ``out``.
            algo: ``"lamport"`` (barrier-free, x up to ``lamport_bytes``), ``"one_shot"`` (one
                flag barrier, up to ``max_bytes``) or ``"auto"`` (lamport up to 1 MiB).
        Returns:
            ``(out, residual_out)``, allocated where not given. Stream, graph capture and error
            semantics as ``all_reduce``. The peer backend runs one kernel and gives every rank
            the same bits; the reference backend runs NCCL's / gloo's all_reduce and then the
            same fp32 arithmetic in torch (equal to the peer result within rounding).
        """
        # Hot path, as in all_reduce: a key that passed the full checks before (``_join``)
        # needs only the checks that depend on the tensors themselves.
        if type(eps) is float and type(algo) is str and self._ready(x) and self._ready(residual) \
                and self._ready(weight):
            call = self._hot_fused.get((_RESIDUAL_RMSNORM.name, x.shape, x.dtype, weight.shape,
                                        weight.dtype, eps, algo, False))
            if call is not None and residual.shape == x.shape and residual.dtype == x.dtype \
                    and self._fits(out, x) and self._fits(residual_out, x) \
                    and _apart(out, residual_out):
                out = torch.empty_like(x) if out is None else out
                residual_out = torch.empty_like(x) if residual_out is None else residual_out
                call(x, residual, weight, out, residual_out)
                return out, residual_out
        return self._join(_RESIDUAL_RMSNORM, x, residual, weight, eps, out, residual_out, algo)

    def all_reduce_rmsnorm(
            self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
            out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
            algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's join: all-reduce and RMSNorm, fused, with no residual to add.

        In a pre-norm model the all-reduced embedding is both the residual stream and the input
        of the first layer's norm, so both come back::

            h = round(all_reduce(x))                          # -> residual_out
            y = round(h * rsqrt(mean(h * h) + eps) * weight)  # fp32 -> out

        ``all_reduce_residual_rmsnorm``'s arithmetic with nothing added: on the peer backend
        the same bits as that op with a zero residual, and ``residual_out`` the bits of
        ``all_reduce(x)``.

        Args:
            x: ``[tokens, hidden]`` as in ``all_reduce_residual_rmsnorm``.
            weight: ``[hidden]``, bf16 / fp16 / fp32 (read in fp32).
            eps: positive finite float added to the mean square.
            out: optional ``[tokens, hidden]`` of x's dtype for the normalised rows (may be x).
            residual_out: optional ``[tokens, hidden]`` of x's dtype for ``h`` (may be x). Must
                not be ``out``.
            algo: as in ``all_reduce_residual_rmsnorm``.
        Returns:
            ``(out, residual_out)``, allocated where not given; stream, graph and error
            semantics as ``all_reduce``.
        """
        if type(eps) is float and type(algo) is str and self._ready(x) and self._ready(weight):
            call = self._hot_fused.get((_RMSNORM.name, x.shape, x.dtype, weight.shape,
                                        weight.dtype, eps, algo, False))
            if call is not None and self._fits(out, x) and self._fits(residual_out, x) \
                    and _apart(out, residual_out):
                out = torch.empty_like(x) if out is None else out
                residual_out = torch.empty_like(x) if residual_out is None else residual_out
                call(x, None, weight, out, residual_out)
                return out, residual_out
        return self._join(_RMSNORM, x, None, weight, eps, out, residual_out, algo)

    def all_reduce_residual_rmsnorm_fp8(
            self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float = 1e-6, *, scale: torch.Tensor, out: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None,
            algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """``all_reduce_residual_rmsnorm`` with the normalised rows quantised to FP8 e4m3 by a
        static (per-tensor) scale, fused: the input of a per-tensor scaled FP8 GEMM.

        ``h`` and ``y`` as in ``all_reduce_residual_rmsnorm`` (``y`` rounded to x's dtype), then::

            out = e4m3(clamp(float(y) * (1 / scale), -448, 448))   # round to nearest even

        ``1 / scale`` is rounded once to fp32 and multiplied, as vLLM's static FP8 quantisation
        does; values past +-448 saturate. ``out`` is byte for byte
        ``llcomm.runtime.fp8_format.quantize_static(y, scale)`` of the ``y`` that
        ``all_reduce_residual_rmsnorm`` returns for the same inputs.

        Args:
            x: as in ``all_reduce_residual_rmsnorm``.
            residual: as in ``all_reduce_residual_rmsnorm``.
            weight: as in ``all_reduce_residual_rmsnorm``.
            eps: as in ``all_reduce_residual_rmsnorm``.
            scale: float32 tensor of one element (shape ``()`` or ``(1,)``) on this
                communicator's device: the dequantisation scale, ``y ~ float(out) * scale``.
                Positive and finite (not checked: that would read device memory from the host).
                Read by the kernel at every call, so a new value reaches a captured CUDA graph.
            out: optional ``[tokens, hidden]`` ``torch.float8_e4m3fn``.
            residual_out: as in ``all_reduce_residual_rmsnorm`` (may be ``residual``).
            algo: as in ``all_reduce_residual_rmsnorm``.
        Returns:
            ``(out, residual_out)``, allocated where not given.
        """
        if type(eps) is float and type(algo) is str and self._ready(x) and self._ready(residual) \
                and self._ready(weight) and self._ready(scale):
            call = self._hot_fused.get((_FP8.name, x.shape, x.dtype, weight.shape, weight.dtype,
                                        eps, algo, False))
            if call is not None and residual.shape == x.shape and residual.dtype == x.dtype \
                    and scale.dtype == torch.float32 and scale.numel() == 1 \
                    and scale.dim() <= 1 and self._fits_fp8(out, x) \
                    and self._fits(residual_out, x) and _apart(out, residual_out):
                out = torch.empty_like(x, dtype=F8.FP8_DTYPE) if out is None else out
                residual_out = torch.empty_like(x) if residual_out is None else residual_out
                call(x, residual, weight, out, residual_out, scale)
                return out, residual_out
        return self._join(_FP8, x, residual, weight, eps, out, residual_out, algo, scale)

    def all_reduce_residual_rmsnorm_fp8_per_group(
            self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float = 1e-6, *, round_scale: bool = False, out: torch.Tensor | None = None,
            scales_out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
            algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``all_reduce_residual_rmsnorm`` with the normalised rows quantised to FP8 e4m3 with
        one float32 scale per 128 channels of each token (block-scaled FP8, as DeepSeek-V3's
        GEMMs take it; the format of ``EPBuffer.dispatch(use_fp8=True)``), fused.

        ``h`` and ``y`` as in ``all_reduce_residual_rmsnorm`` (``y`` rounded to x's dtype), then
        per token t and group g of channels ``[128 g, 128 (g + 1))``, in fp32::

            scale[t, g] = amax |y[t, group g]| / 448      # 1 where the group is all zero;
                                                          # round_scale: up to a power of two
            out[t, c]   = e4m3(clamp(float(y[t, c]) / scale[t, c // 128], -448, 448))

        IEEE division, round to nearest even: ``(out, scales)`` are byte for byte
        ``llcomm.runtime.fp8_format.quantize(y, round_scale)`` of the ``y`` that
        ``all_reduce_residual_rmsnorm`` returns for the same inputs.

        Args:
            x: as in ``all_reduce_residual_rmsnorm``, ``hidden`` a multiple of 128.
            residual: as in ``all_reduce_residual_rmsnorm``.
            weight: as in ``all_reduce_residual_rmsnorm``.
            eps: as in ``all_reduce_residual_rmsnorm``.
            round_scale: scales rounded up to a power of two (a Python bool).
            out: optional ``[tokens, hidden]`` ``torch.float8_e4m3fn``.
            scales_out: optional ``[tokens, hidden // 128]`` float32 (row-major: a token's
                scales are contiguous).
            residual_out: as in ``all_reduce_residual_rmsnorm`` (may be ``residual``).
            algo: as in ``all_reduce_residual_rmsnorm``.
        Returns:
            ``(out, scales, residual_out)``, allocated where not given.
        """
        if type(eps) is float and type(algo) is str and type(round_scale) is bool \
                and self._ready(x) and self._ready(residual) and self._ready(weight):
            call = self._hot_fused.get((_FP8_GROUP.name, x.shape, x.dtype, weight.shape,
                                        weight.dtype, eps, algo, round_scale))
            if call is not None and residual.shape == x.shape and residual.dtype == x.dtype \
                    and self._fits_fp8(out, x) and self._fits(residual_out, x) \
                    and (scales_out is None or (
                        self._ready(scales_out) and scales_out.dtype == F8.SCALE_DTYPE
                        and scales_out.shape == (x.shape[0], x.shape[1] // FP8_GROUP))) \
                    and _apart(out, residual_out) and _apart(out, scales_out) \
                    and _apart(residual_out, scales_out):
                out = torch.empty_like(x, dtype=F8.FP8_DTYPE) if out is None else out
                residual_out = torch.empty_like(x) if residual_out is None else residual_out
                if scales_out is None:
                    scales_out = torch.empty((x.shape[0], x.shape[1] // FP8_GROUP),
                                             dtype=F8.SCALE_DTYPE, device=x.device)
                call(x, residual, weight, out, residual_out, scales_out)
                return out, scales_out, residual_out
        return self._join(_FP8_GROUP, x, residual, weight, eps, out, residual_out, algo, None,
                          round_scale, scales_out)

    def choose_fused_algo(self, nbytes: int) -> str:
        """The algorithm the fused joins' ``algo="auto"`` runs for ``nbytes`` of x."""
        if self.backend != "peer":
            return "reference"
        return self._impl.fused_algo(nbytes)

    # -- shared by the four -----------------------------------------------------------------
    def _join(self, j: _Join, x, residual, weight, eps, out, residual_out, algo, scale=None,
              round_scale=False, scales_out=None):
        """A join's full path (the methods' hot paths failed): every check, the backend's
        bound call, kept for the hot path under the key the methods look up."""
        self._check_open(j.name)
        self._check_join(j, x, residual, weight, eps, out, residual_out, algo, scale,
                         round_scale, scales_out)
        run = self.choose_fused_algo(x.numel() * x.element_size()) if algo == "auto" else algo
        call = self._impl.fused_call(j.name, run, *x.shape, x.dtype, weight.dtype, float(eps),
                                     round_scale)
        if type(eps) is float and type(algo) is str and all(
                type(t) is torch.Tensor for t in (x, weight)):
            self._remember(self._hot_fused, (j.name, x.shape, x.dtype, weight.shape,
                                             weight.dtype, eps, algo, round_scale), call)
        return self._finish(j, call, x, residual, weight, out, residual_out, scale, scales_out)

    @staticmethod
    def _finish(j, call, x, residual, weight, out, residual_out, scale, scales_out):
        """Allocate the outputs not given, run ``call``, return the join's results."""
        if residual_out is None:
            residual_out = torch.empty_like(x)
        if out is None:
            out = torch.empty_like(x) if j.fp8 is None else torch.empty_like(x, dtype=F8.FP8_DTYPE)
        if j.fp8 != "group":
            call(x, residual, weight, out, residual_out, scale)
            return out, residual_out
        if scales_out is None:
            scales_out = torch.empty((x.shape[0], x.shape[1] // FP8_GROUP),
                                     dtype=F8.SCALE_DTYPE, device=x.device)
        call(x, residual, weight, out, residual_out, scales_out)
        return out, scales_out, residual_out

    def _fits_fp8(self, out, x: torch.Tensor) -> bool:
        """``out`` is None or ready and shaped like ``x``, float8_e4m3fn."""
        return out is None or (self._ready(out) and out.shape == x.shape
                               and out.dtype == F8.FP8_DTYPE)

    def _check_join(self, j, x, residual, weight, eps, out, residual_out, algo, scale,
                    round_scale, scales_out) -> None:
        """Every argument of join ``j``; one ValueError / TypeError naming each bad one."""
        pr = V.Problems(j.name)
        shape = None
        if V.check_tensor(pr, "x", x, self.device, max_bytes=self.max_bytes,
                          why=V.REDUCE_ONLY):
            if x.dim() != 2 or x.shape[1] == 0:
                pr.add(f"x has shape {tuple(x.shape)}; expected 2-D [tokens, hidden], hidden >= 1")
            elif x.shape[1] > FUSED_MAX_HIDDEN:
                pr.add(f"x has hidden={x.shape[1]}; at most {FUSED_MAX_HIDDEN} is supported (a "
                       "row is held in one block's registers); use all_reduce and a separate norm")
            elif j.fp8 == "group" and x.shape[1] % FP8_GROUP:
                pr.add(f"x has hidden={x.shape[1]}; the per-group FP8 output needs a multiple "
                       f"of {FP8_GROUP} (one scale per {FP8_GROUP} channels)")
            else:
                shape = tuple(x.shape)
        if shape is not None:
            if j.residual and V.check_tensor(pr, "residual", residual, self.device):
                if tuple(residual.shape) != shape:
                    pr.add(f"residual has shape {tuple(residual.shape)}; expected {shape} "
                           "(the shape of x)")
                if residual.dtype != x.dtype:
                    pr.add(f"residual has dtype {residual.dtype}; expected {x.dtype} (the dtype "
                           "of x)", type_error=True)
            if V.check_tensor(pr, "weight", weight, self.device):
                if tuple(weight.shape) != (shape[1],):
                    pr.add(f"weight has shape {tuple(weight.shape)}; expected ({shape[1]},) "
                           "(hidden of x)")
            if j.fp8 is None:
                V.check_out(pr, out, x, shape, self.device)
            else:
                _check_result(pr, "out", out, shape, F8.FP8_DTYPE, self.device, "FP8 e4m3 codes")
            V.check_out(pr, residual_out, x, shape, self.device, name="residual_out")
            if j.fp8 == "group":
                _check_result(pr, "scales_out", scales_out, (shape[0], shape[1] // FP8_GROUP),
                              F8.SCALE_DTYPE, self.device, f"one scale per {FP8_GROUP} channels")
            named = [(n, t) for n, t in (("out", out), ("residual_out", residual_out),
                                         ("scales_out", scales_out))
                     if isinstance(t, torch.Tensor) and t.numel()]
            for i, (a, ta) in enumerate(named):
                for b, tb in named[i + 1:]:
                    if ta.data_ptr() == tb.data_ptr():
                        pr.add(f"{a} and {b} are the same memory; they must be distinct")
        if j.fp8 == "static" and V.check_tensor(pr, "scale", scale, self.device,
                                                dtypes=(torch.float32,)):
            if scale.numel() != 1 or scale.dim() > 1:
                pr.add(f"scale has shape {tuple(scale.shape)}; expected one element, shape () "
                       "or (1,) (a per-tensor scale)")
        if j.fp8 == "group" and not isinstance(round_scale, bool):
            pr.add(f"round_scale={round_scale!r}; expected True or False", type_error=True)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) \
                or not math.isfinite(eps) or eps <= 0:
            pr.add(f"eps={eps!r}; expected a positive finite float", type_error=not isinstance(
                eps, (int, float)) or isinstance(eps, bool))
        if algo not in FUSED_ALGOS:
            pr.add(f"algo={algo!r}; expected one of {', '.join(FUSED_ALGOS)}")
        elif algo == "lamport" and shape is not None and self.backend == "peer" \
                and x.numel() * x.element_size() > self._impl.lamport_bytes:
            pr.add(f"algo='lamport' takes at most {self._impl.lamport_bytes} bytes; x has "
                   f"{x.numel() * x.element_size()}")
        pr.raise_if_any()
