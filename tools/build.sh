#!/usr/bin/env bash
# Configures and builds strata into ${BUILD_DIR:-build}. Extra arguments go to cmake's configure
# step (e.g. -DSTRATA_CUDA=OFF, -DSTRATA_SANITIZE=address). Parallelism: ${JOBS:-nproc}.
# TARGETS="a b" builds only those targets (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} "$@"
targets=()
for t in ${TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build_dir" -j "${JOBS:-$(nproc)}" "${targets[@]}"
