#!/usr/bin/env bash
# Run llcomm's CPU test suite, from a fresh clone or any later state:
#
#   scripts/test.sh            # sets up .venv if needed, then: python -m pytest -q -m "not gpu"
#   scripts/test.sh -x -k validation     # extra arguments go to pytest
#
# Exits non-zero when a test fails and also when no test ran (pytest's exit status 5).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/venv.sh

start=$SECONDS
set +e
.venv/bin/python -m pytest -q -m "not gpu" "$@"
rc=$?
set -e
echo "scripts/test.sh: pytest exit status $rc after $((SECONDS - start)) s" >&2
if [[ $rc -eq 5 ]]; then
    echo "scripts/test.sh: no test ran; that is a failure" >&2
    exit 1
fi
exit $rc
