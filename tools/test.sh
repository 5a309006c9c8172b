#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA code too when nvcc exists) and runs the whole
# test suite. GPU tests skip (and are reported as skipped) when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
# The Python package's tests (python/tests, pytest, run by ctest as python_tests) need a venv
# with torch: STRATA_PYTHON_TESTS=1 creates it (tools/python-env.sh) and runs them; "auto" (the
# default) runs them when the venv already exists; 0 skips them.
py_tests=${STRATA_PYTHON_TESTS:-auto}
venv=${STRATA_VENV:-$PWD/.venv}
py_args=()
if [[ $py_tests == 1 ]] ||
   { [[ $py_tests == auto ]] && "$venv/bin/python" -c 'import torch, nanobind' 2>/dev/null; }; then
  venv=$(bash tools/python-env.sh | tail -n 1)
  py_args=(-DSTRATA_PYTHON=ON "-DPython_EXECUTABLE=$venv/bin/python")
else
  echo "test.sh: Python tests skipped (no venv with torch at $venv; STRATA_PYTHON_TESTS=1 makes one)"
fi
bash tools/build.sh "${py_args[@]}" "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 600
