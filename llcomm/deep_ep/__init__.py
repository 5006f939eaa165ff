"""DeepEP's API on llcomm: ``import llcomm.deep_ep as deep_ep`` in place of ``import deep_ep``
(docs/deep_ep.md): the low-latency mode on ``llcomm.EPBuffer``, the normal mode on
torch.distributed's ``all_to_all_single``.

``Buffer`` (``buffer``) takes DeepEP's constructor arguments and offers its low-latency calls
with DeepEP's arguments, tuples and layouts; ``normal`` (a mixin of ``Buffer``, its ops in
``normal_ops``, ``Config`` in ``config``) its normal-mode calls; ``convert`` turns
``EPBuffer``'s outputs into DeepEP's layouts (source token and per-rank row ranges,
column-major and UE8M0 scales) as torch ops where the dispatch kernel does not write them (off
the peer backend); ``handle`` is DeepEP's handle tuple carrying llcomm's ``EPHandle``;
``event`` holds ``EventHandle`` and ``EventOverlap`` (``utils`` re-exports them under DeepEP's
module path); ``masks`` (shrink mode's mask calls), ``local`` (the local buffer:
``get_local_buffer_tensor``, the zero-copy combine buffers) and ``surface`` (class-level
settings and streams) are mixins of ``Buffer``; ``mpi`` maps an mpi4py ``comm`` to the
torch.distributed world; ``alias`` makes ``import deep_ep`` give this package
(``install_alias``; or ``LLCOMM_DEEP_EP_ALIAS=1``). Arguments and names llcomm cannot honour
raise NotImplementedError naming them.

This layer sits above ``llcomm.ep`` and uses its public API only; nothing in llcomm imports it.
"""
from .alias import alias_active, install_alias, remove_alias
from .buffer import Buffer, Config, topk_idx_t
from .event import EventHandle, EventOverlap
from .handle import LowLatencyHandle

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "LowLatencyHandle", "alias_active",
           "install_alias", "remove_alias", "topk_idx_t"]
