"""Benchmarks behind ``llcomm bench`` (see bench/README.md). Not imported by the library.

- ``tp``: the TP joins (all_reduce, broadcast, all_gather, all_gather_2d, reduce_scatter) against
  NCCL and torch symmetric memory.
- ``common``: spawning, timing, correctness oracles, result files, tables and plots, shared by
  every benchmark.
"""
