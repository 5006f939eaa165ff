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

Buffer sets. Each op's block counter (``ctrl``) picks the set (counter % ``REGIONS.SETS``) and
the epoch of its flag and LL words; dispatch and combine count separately. With one send half in
flight (``EPBuffer(sends_in_flight=1)``) two sets suffice because every op waits for every rank:
when rank r starts dispatch k it has finished dispatch k - 1, which needed every peer to have
signalled k - 1, i.e. to have finished dispatch k - 2 (kernels on one stream run in order), so
dispatch k writes the set dispatch k - 2 used, which nobody reads any more, and no flag is
rewritten before its waiter saw it. The combine's phases follow the same argument. The counter
advances only in the receive half of a call, so both halves agree on it; the host refuses a
second send half before the first one's hook ran.

With D send halves in flight (``sends_in_flight`` D = 2; ``return_recv_hook=True``, as two-batch
overlap issues them: S0 S1 R0 R1 S2 ...) that induction breaks: rank r starts S2 after its R1,
which proves only that every peer p issued S1; p's R0, which reads p's set 0, may not have run
(its host may call hook 0 late), and with two sets S2 would write set 0 at p. So a buffer with
D in flight has 2 D sets (four) and S_k writes set k % 2D. The host rule (``inflight.py``): at
most D sends of an op without their hooks, hooks in send order, so a rank issues S_k only after
its own R_{k-D}. R_{k-D} waited for every peer's S_{k-D}, which that peer issued only after its
R_{k-2D}; so when S_k writes set k % 2D at p, p has read it (R_{k-2D}) and its flags and LL
words hold epoch k - 2D + 1, older than any wait of p still to come. The combine's phases: its
send half's weights and partials land in set k % 2D at p, whose earlier user, combine k - 2D, p
finished reading (send half: weights; receive half: partials) before its S_{k-D}, which our
R_{k-D} waited for. The two halves now count apart (``common._seq_at``, ``IN_FLIGHT`` = 2:
``ctrl`` is ``[2, NB]``): the send half reads and advances the send counter, the receive half
the receive counter; hooks in send order keep them matched (receive k reads k), and both stay
on the device, so CUDA graph replays advance them. A whole call reads the send counter and
advances both (none is pending then: the host refuses a call without a hook while one is).

Weights with the dispatch (``CARRY`` / ``CARRIED``, ``dispatch(topk_weights=...)``): the
dispatch pushes them into the weights region of the *handle slot's* set (byte ``w_off``; set k
serves handle slot k) and its signal releases them with the rows (the LL dispatch sends them as
LL words and its receiver copies them there); the combine then skips its weights stage and
reads them at ``w_off``. There are as many handle slots as sets (2 D: a handle lives for 2 D
dispatches). Slot k is written again by dispatch k + 2D, which a rank starts only after its
combine of handle k has finished on its stream (the host refuses a dispatch onto the slot of a
combine whose hook has not run, and a combine of a handle whose slot was reused), which waited
for every rank's partials of k, each pushed after that rank read its weights. The handle's
``row_of``, ``src_info`` and counts are written by the receive of dispatch k + 2D, after that
combine's send half on the same stream.

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
