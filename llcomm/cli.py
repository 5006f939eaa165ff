"""The ``llcomm`` command line: ``llcomm bench``, ``llcomm doctor``, ``llcomm check``,
``llcomm tune``.

    llcomm bench [tp] [--sizes 8,64K,1M] [--ops all] [--algos all] [--json F] [--plot F]
    llcomm bench fused [--ops all] [--tokens 1,8,32,64,128] [--hidden 7168,8192] [--json F]
    llcomm bench ep [--tokens 1,32,128,256,512] [--json F] [--plot F]
    llcomm bench decode [--parts tp,ep] [--batches 1,8,32,64] [--json F] [--plot F]
    llcomm bench soak [--ops N] [--json F]
    llcomm bench link [--sizes 64K,1M,8M,64M] [--json F]
    llcomm doctor
    llcomm check
    llcomm tune [--sizes 8,64K,1M] [--out F] | llcomm tune --from-bench RESULT.json

The library never imports this module; the benchmarks live in ``llcomm.bench``, the other
commands in ``llcomm.commands``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: ``llcomm bench <name>``: a module with ``add_arguments(parser)`` and ``run(args) -> int``.
BENCHES = {"tp": ("llcomm.bench.tp", "TP joins (all_reduce, broadcast, all_gather, "
                  "all_gather_2d, reduce_scatter) against NCCL and torch symmetric memory"),
           "fused": ("llcomm.bench.fused", "the fused joins (all-reduce + residual + RMSNorm, "
                     "+ FP8 quantisation) against llcomm all_reduce + the same in torch"),
           "ep": ("llcomm.bench.ep", "MoE dispatch / combine (EPBuffer): the peer backend "
                  "against the reference backend on NCCL"),
           "decode": ("llcomm.bench.decode", "whole decode steps built from transformers' modules "
                      "(Llama layers at TP, Qwen3-MoE blocks at EP; the hf extra) with each "
                      "communication implementation and with none"),
           "soak": ("llcomm.bench.soak", "soak test: many random ops of every kind, each result "
                    "checked, then a replayed CUDA graph; counts of ops, wrong, timeouts"),
           "link": ("llcomm.bench.link", "bandwidth between this host's GPUs (copy engine, SM "
                    "stores, SM loads; GPU 0 alone and every GPU at once); needs 2+ GPUs")}
#: What ``llcomm bench`` runs when no benchmark is named.
DEFAULT_BENCH = "tp"


def build_parser() -> argparse.ArgumentParser:
    from llcomm import __version__

    p = argparse.ArgumentParser(prog="llcomm", description="Low-latency GPU communication for "
                                "LLM inference: benchmarks, self-test and diagnostics.")
    p.add_argument("--version", action="version", version=f"llcomm {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{bench,doctor,check,tune}")

    bench = sub.add_parser("bench", help=f"benchmarks (default: {DEFAULT_BENCH})",
                           description="Benchmarks. `llcomm bench` alone runs "
                           f"`llcomm bench {DEFAULT_BENCH}`.")
    bsub = bench.add_subparsers(dest="bench", metavar="{" + ",".join(BENCHES) + "}")
    for name, (module, what) in BENCHES.items():
        mod = importlib.import_module(module)
        q = bsub.add_parser(name, help=what, description=what)
        mod.add_arguments(q)
        q.set_defaults(func=mod.run)

    doctor = sub.add_parser("doctor", help="GPUs, peer access, NVLink, versions, environment, "
                            "and the backend llcomm would pick")
    doctor.set_defaults(func=lambda a: importlib.import_module("llcomm.commands.doctor").run(a))

    check = sub.add_parser("check", help="correctness self-test of every op on this host "
                           "(exit status 1 on any failure)")
    check.add_argument("--backend", choices=("auto", "peer", "reference"), default="auto",
                       help="Communicator backend to check (default auto)")
    check.add_argument("--cpu", action="store_true",
                       help="run on CPU (2 gloo processes) even where GPUs are present")
    importlib.import_module("llcomm.bench.options").add_no_multicast_argument(check)
    check.set_defaults(func=lambda a: importlib.import_module("llcomm.commands.check").run(a))

    tune_mod = importlib.import_module("llcomm.commands.tune")
    tune = sub.add_parser("tune", help="measure the fastest all_reduce algorithm per size on "
                          "this host and write the table all_reduce(algo='auto') uses",
                          description=tune_mod.SUMMARY)
    tune_mod.add_arguments(tune)
    tune.set_defaults(func=tune_mod.run)
    return p


def _default_bench(argv: list[str]) -> list[str]:
    """``llcomm bench [options]`` -> ``llcomm bench tp [options]``."""
    if argv and argv[0] == "bench":
        names = (*BENCHES, "-h", "--help")
        if len(argv) == 1 or argv[1] not in names:
            return ["bench", DEFAULT_BENCH, *argv[1:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = _default_bench(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    from llcomm.bench.spawn import LaunchError
    try:
        return int(args.func(args) or 0)
    except LaunchError as e:
        print(f"llcomm {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
