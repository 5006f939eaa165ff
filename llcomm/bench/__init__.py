"""The benchmarks of the ``llcomm`` command line (see bench/README.md; ``llcomm doctor``,
``check`` and ``tune`` are in ``llcomm.commands``). The library never imports this package.

- ``tp``: ``llcomm bench tp``, the TP joins against NCCL and torch symmetric memory;
  ``tp_report`` prints its nccl-tests style table.
- ``fused``: ``llcomm bench fused``, the fused joins against the unfused sequences
  (``fused_ops`` has the cases).
- ``ep``: ``llcomm bench ep``, EPBuffer dispatch / combine, peer backend against the reference;
  ``ep_oracle`` computes what each rank must receive, ``ep_report`` prints the tables.
- ``decode``: ``llcomm bench decode``, whole decode steps built from transformers' modules
  (sharded by ``llcomm.hf``) with each communication implementation and with none;
  ``decode_models`` holds the steps (what each one contains).
- ``soak``: ``llcomm bench soak``, many random ops, each checked, then a replayed CUDA graph.
- ``link``: ``llcomm bench link``, the bandwidth between this host's GPUs (``link_kernel``: its
  Triton kernel).

Shared by every benchmark:

- ``options``: sizes, integer lists, dtypes, and the options every benchmark has;
- ``spawn``: one process per GPU (or two gloo processes, through ``llcomm.multiproc``), and
  the collectives ranks agree by;
- ``timing``: graph and eager timing, slowest rank per iteration (``Impl`` / ``time_impl``);
- ``verify``: expected results from every rank's inputs, wrong-element counts, NaN poison;
- ``result_files``: the header of a result file (commit, machine, versions), ``--json`` /
  ``--plot``;
- ``console``: progress, tables and number formats;
- ``plot``: the plot of each benchmark, and ``python -m llcomm.bench.plot results.json out.png``.
"""
