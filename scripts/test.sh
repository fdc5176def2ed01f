#!/usr/bin/env bash
# The whole test suite: install and build, run the C++ (GoogleTest) tests, then pytest.
# Extra arguments go to pytest (e.g. -k all_reduce, or -m soak for the soak tests).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
bash tests/cpp/run.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
