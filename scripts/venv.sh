#!/usr/bin/env bash
# Create (once) and fill the project's virtual environment in .venv, then print nothing more.
#
#   scripts/venv.sh            # used by scripts/test.sh, scripts/bench.sh and .ci/run
#
# Installs torch first, pinned (LLCOMM_TORCH, default torch==2.13.0, the release CI runs the
# suite with), so that the torch build is the one you chose rather than whatever pip resolves
# for llcomm's `torch>=2.11`: set LLCOMM_TORCH to your engine's release, and pip's own variables
# (PIP_INDEX_URL, PIP_FIND_LINKS) to where its CPU or CUDA build comes from. Then llcomm itself,
# editable, with the test, bench, gpu, shmem, docs and hf extras (test: pytest and ruff; shmem:
# NVSHMEM's device bitcode, which tests/test_shmem_compile.py links; docs: mkdocs,
# so the suite's `mkdocs build --strict` test runs; hf: transformers for llcomm.hf, `llcomm bench
# decode`, tests/test_hf_models.py and examples/hf_*.py, which asks for no torch of its own, so
# the pinned torch stays). A stamp in .venv records what was installed, so later calls return at
# once until pyproject.toml or LLCOMM_TORCH changes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${LLCOMM_TORCH:-torch==2.13.0}
VENV=.venv
STAMP=$VENV/.llcomm-installed
want="$TORCH_SPEC $(sha256sum pyproject.toml | cut -d' ' -f1)"

if [[ ! -x $VENV/bin/python ]]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || { echo "scripts/venv.sh: llcomm needs Python >= 3.10 ($PYTHON is older)" >&2; exit 1; }
    echo "scripts/venv.sh: creating $VENV with $("$PYTHON" --version)" >&2
    "$PYTHON" -m venv "$VENV"
fi
if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" ]] \
        && "$VENV/bin/python" -c 'import torch, llcomm' 2>/dev/null; then
    exit 0
fi
echo "scripts/venv.sh: installing $TORCH_SPEC and llcomm[test,bench,gpu,shmem,docs,hf] into $VENV" >&2
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e ".[test,bench,gpu,shmem,docs,hf]"
echo "$want" > "$STAMP"
