"""The bodies of the ``llcomm`` command line (see bench/README.md). The library never imports
this package.

- ``tp``: ``llcomm bench tp``, the TP joins against NCCL and torch symmetric memory;
  ``tp_report`` prints its nccl-tests style table.
- ``fused``: ``llcomm bench fused``, all_reduce_residual_rmsnorm against the unfused sequence.
- ``ep``: ``llcomm bench ep``, EPBuffer dispatch / combine, peer backend against the reference.
- ``decode``: ``llcomm bench decode``, whole synthetic decode steps with each communication
  implementation and with none; ``decode_models`` holds the steps (what each one contains).
- ``check``: ``llcomm check``, the correctness self-test; ``doctor``: ``llcomm doctor``.
- ``common``: options, spawning, timing (``Impl`` / ``time_impl``), correctness oracles, result
  files and tables, shared by every benchmark; ``plot``: the plot of each benchmark, and
  ``python -m llcomm.bench.plot results.json out.png``.
"""
