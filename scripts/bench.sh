#!/usr/bin/env bash
# Benchmark llcomm on this host, from a fresh clone or any later state:
#
#   scripts/bench.sh                       # sets up .venv if needed, then: python -m llcomm bench
#   scripts/bench.sh tp --json bench/results/X.json --plot X.png   # arguments go to llcomm bench
#
# Needs CUDA GPUs for the peer backend; `scripts/bench.sh --help` lists the options.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/venv.sh
exec .venv/bin/python -m llcomm bench "$@"
