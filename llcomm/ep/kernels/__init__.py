"""Triton kernels of EP dispatch and combine (DeepEP low-latency shapes, deterministic).

Three kernels, each one launch on a fixed grid of NB blocks, each fusing its pushes, its
bounded waits and the local work that follows: ``flag_dispatch_kernel`` (``dispatch_flag``),
``ll_dispatch_kernel`` (``dispatch_ll``) and ``combine_kernel`` (``combine``). Shared device
code: ``common`` (flags, waits, masks, stamps), ``dispatch_common`` (the send stage's scan,
counts and metadata), ``fp8_rows`` (the FP8 row quantisers). The two-level kernels across
hosts live in ``llcomm/ep/hosts/kernels/``.

Parameters. The runtime arguments come first, flat (what the host passes in order: the
dispatch's are ``dispatch_common.DISPATCH_ARGS``, the same for both dispatch kernels), then
the constexprs, bundled in namedtuples the host builds once per buffer (``peer.kernel_consts``)
and the device helpers take as they are: ``SIZES`` (``common.Sizes``: tokens, hidden, top-k,
experts, ranks, blocks), ``REGIONS`` (byte offsets in a buffer set:
``dispatch_common.DispatchRegions``, ``combine.CombineRegions``), and for the dispatch
``TILING`` (``dispatch_common.Tiling``: how its loops are cut) and ``ROW``
(``dispatch_common.RowFormat``: scales and int32 words per row); then the mode switches
(``STAGES``, ``FP8``, ``MASKS``, ``PROFILE``, ``CARRY`` / ``CARRIED``, ``STATS``,
``DEEP_EP``, ``PDL``). Runtime values the helpers share are bundled in the kernel:
``common.Region`` (the region table, this rank, the set's offset) and ``dispatch_common.Out``.

Buffer sets. Each op's block counter (``ctrl``) picks the set (counter % 2) and the epoch of
its flag and LL words; dispatch and combine count separately. Two sets suffice because every op
waits for every rank: when rank r starts dispatch k it has finished dispatch k - 1, which
needed every peer to have signalled k - 1, i.e. to have finished dispatch k - 2 (kernels on one
stream run in order), so dispatch k writes the set dispatch k - 2 used, which nobody reads any
more, and no flag is rewritten before its waiter saw it. The combine's phases follow the same
argument. The counter advances only in the receive half of a call, so both halves agree on it;
the host refuses a second send half before the first one's hook ran.

Weights with the dispatch (``CARRY`` / ``CARRIED``, ``dispatch(topk_weights=...)``): the
dispatch pushes them into the weights region of the *handle slot's* set (byte ``w_off``; set k
serves handle slot k) and its signal releases them with the rows (the LL dispatch sends them as
LL words and its receiver copies them there); the combine then skips its weights stage and
reads them at ``w_off``. Slot k is written again by dispatch k + 2, which a rank starts only
after its combine k, which waited for every rank's partials of k, each pushed after that rank
read its weights.

Wait statistics (``STATS`` = 1, ``dispatch / combine(wait_stats=...)``): the kernels take a
``stats`` pointer (``[W]`` int64) and add the nanoseconds each block waited per source rank
(``common._wait_flags``, ``dispatch_ll._take_ll_timed``); without them ``stats`` is None, which
Triton makes a constexpr, and the kernels compile exactly as before.

DeepEP's layouts (``DEEP_EP`` != 0, ``dispatch(deep_ep=...)``): the dispatch kernels' receive
stages also write DeepEP's ``src_info``, ``layout_range``, column-major scales and statistics
(``deep_ep_layout``); their pointers are None otherwise, and the kernels compile as before.

Stages. A launch runs the stages whose bits are in ``STAGES`` (``common.py``: ``D_*`` and
``C_*`` for the host, ``STAGE_*`` as the kernels test them): all of them, or a send half and a
receive half (``return_recv_hook=True``). The CPU tests run the data stages alone
(``D_SEND``, then ``D_RECV``; ``C_WEIGHTS``, ``C_REDUCE``, ``C_SUM``) for every virtual rank
in turn under ``TRITON_INTERPRET=1``, since the waits read the GPU clock.
"""
from .combine import CombineRegions, combine_kernel
from .common import (C_REDUCE, C_SIGNAL_P, C_SUM, C_SYNC_W, C_WAIT_P, C_WEIGHTS, COMBINE_ALL,
                     COMBINE_RECV_HALF, COMBINE_SEND_HALF, D_RECV, D_SEND, D_SIGNAL, D_WAIT,
                     DISPATCH_ALL, DISPATCH_RECV_HALF, DISPATCH_SEND_HALF, ERR_MASK, Sizes)
from .deep_ep_layout import DEEP_EP_FP32, DEEP_EP_OFF, DEEP_EP_UE8M0
from .dispatch_common import DISPATCH_ARGS, DispatchRegions, RowFormat, Tiling
from .dispatch_flag import flag_dispatch_kernel
from .dispatch_ll import ll_dispatch_kernel

__all__ = ["flag_dispatch_kernel", "ll_dispatch_kernel", "combine_kernel", "D_SEND", "D_RECV",
           "D_SIGNAL", "D_WAIT", "DISPATCH_ALL", "DISPATCH_SEND_HALF", "DISPATCH_RECV_HALF",
           "C_WEIGHTS", "C_REDUCE", "C_SUM", "C_SYNC_W", "C_SIGNAL_P", "C_WAIT_P", "COMBINE_ALL",
           "COMBINE_SEND_HALF", "COMBINE_RECV_HALF", "ERR_MASK", "DEEP_EP_OFF", "DEEP_EP_FP32",
           "DEEP_EP_UE8M0", "Sizes", "DispatchRegions", "Tiling", "RowFormat", "CombineRegions",
           "DISPATCH_ARGS"]
