#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA code too when nvcc exists) and runs the whole
# test suite: the C++ tests and the Python package's (python/tests, pytest, run by ctest as
# python_tests against torch from PyPI on the CPU). GPU tests skip (and are reported as skipped)
# when no GPU is present.
#
# The Python tests need a venv with torch: tools/python-env.sh creates (or completes) it at
# ${STRATA_VENV:-.venv}; the first time that downloads torch (the CPU wheel, ~200 MB, or PyPI's
# ~3 GB CUDA wheel when download.pytorch.org is unreachable). STRATA_PYTHON_TESTS=0 skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
py_args=()
if [[ ${STRATA_PYTHON_TESTS:-1} != 0 ]]; then
  venv=$(bash tools/python-env.sh | tail -n 1)
  py_args=(-DSTRATA_PYTHON=ON "-DPython_EXECUTABLE=$venv/bin/python")
else
  echo "test.sh: Python tests skipped (STRATA_PYTHON_TESTS=0)"
  py_args=(-DSTRATA_PYTHON=OFF)
fi
bash tools/build.sh "${py_args[@]}" "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 600
