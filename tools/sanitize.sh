#!/usr/bin/env bash
# Runs the test suite under a sanitizer: `tools/sanitize.sh address` (ASan+UBSan) or
# `tools/sanitize.sh thread` (TSan). CUDA is off in these builds (nothing runs on a GPU here and
# the sanitizer runtimes do not cover device code). Optional ctest -R filter as the second argument;
# TARGETS="x_test y_test" builds only those executables (pair it with a matching filter).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: tools/sanitize.sh address|thread [ctest-regex]}
export BUILD_DIR=build-$kind
BUILD_TYPE=Debug bash tools/build.sh -DSTRATA_SANITIZE="$kind" -DSTRATA_CUDA=OFF -DSTRATA_BUILD_BENCHMARKS=OFF
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export LSAN_OPTIONS=suppressions=$PWD/tools/lsan.supp
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tools/tsan.supp"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" --timeout 900 -LE gpu ${2:+-R "$2"}
