"""The ``llcomm`` commands that are not benchmarks, each run on one host (the library never
imports this package):

- ``doctor``: ``llcomm doctor``, what llcomm sees (GPUs, peer access, versions, settings, the
  backend it would pick and why);
- ``check``: ``llcomm check``, every op against the reference on this host (``check_fused``:
  the fused joins' cases and oracle; ``check_ep``: EP dispatch / combine through ``EPBuffer``
  and ``llcomm.deep_ep``);
- ``tune``: ``llcomm tune``, the fastest all_reduce algorithm per size on this host, written
  as the table ``all_reduce(algo="auto")`` reads.

They start their ranks, time and verify with ``llcomm.bench``'s shared modules.
"""
