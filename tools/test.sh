#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA code too when nvcc exists) and runs the whole
# test suite. GPU tests skip (and are reported as skipped) when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
bash tools/build.sh "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 600
