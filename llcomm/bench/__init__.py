"""The bodies of the ``llcomm`` command line (see bench/README.md). The library never imports
this package.

- ``tp``: ``llcomm bench tp``, the TP joins against NCCL and torch symmetric memory;
  ``tp_report`` prints its nccl-tests style table.
- ``fused``: ``llcomm bench fused``, all_reduce_residual_rmsnorm against the unfused sequence.
- ``check``: ``llcomm check``, the correctness self-test; ``doctor``: ``llcomm doctor``.
- ``common``: spawning, timing, correctness oracles, result files, tables and plots, shared by
  every benchmark; ``plot``: ``python -m llcomm.bench.plot results.json out.png``.
"""
