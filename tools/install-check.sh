#!/usr/bin/env bash
# Proves the installed strata is usable: installs a build into a temporary prefix, builds
# examples/cpp_trainer against it with find_package(strata) and, separately, with pkg-config,
# runs both, builds and runs examples/custom_device (a third-party Device with DeviceKernels from
# the installed headers alone, the engine stepping its state with them), then makes the .deb
# packages with CPack and checks their metadata and contents.
# Usage: tools/install-check.sh [BUILD_DIR]   (default build; run by ctest as install_check)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$src/build}" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/strata-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
export PATH="/usr/local/cuda/bin:$PATH"

echo "== cmake --install into $prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log"
for f in include/strata/store.h include/strata/device_kernels.h include/strata/version.h \
         lib/cmake/strata/strataConfig.cmake \
         lib/cmake/strata/strataConfigVersion.cmake lib/pkgconfig/strata.pc bin/offloadctl; do
  [[ -e "$prefix/$f" ]] || { echo "install-check: $f not installed"; exit 1; }
done
# Internal headers and third-party headers stay out of the installed tree.
if find "$prefix/include" -name '*.h' | grep -v '/strata/' | grep -q .; then
  echo "install-check: headers outside include/strata/ were installed"; exit 1
fi
"$prefix/bin/offloadctl" --version

echo "== find_package(strata) from examples/cpp_trainer"
cmake -S "$src/examples/cpp_trainer" -B "$work/example" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >"$work/example.log" \
  || { cat "$work/example.log"; exit 1; }
cmake --build "$work/example" >>"$work/example.log" 2>&1 || { cat "$work/example.log"; exit 1; }
"$work/example/cpp_trainer" "$src/examples/ds_zero3_offload.json"

echo "== find_package(strata) from examples/custom_device (a device with its own kernels)"
cmake -S "$src/examples/custom_device" -B "$work/custom_device" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >"$work/custom_device.log" \
  || { cat "$work/custom_device.log"; exit 1; }
cmake --build "$work/custom_device" >>"$work/custom_device.log" 2>&1 \
  || { cat "$work/custom_device.log"; exit 1; }
"$work/custom_device/custom_device"

echo "== pkg-config strata"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
pkg-config --modversion strata
# shellcheck disable=SC2046
g++ -std=c++20 -o "$work/cpp_trainer_pc" "$src/examples/cpp_trainer/main.cc" \
  $(pkg-config --cflags --libs strata)
"$work/cpp_trainer_pc" >/dev/null

echo "== cpack -G DEB"
(cd "$work" && cpack -G DEB --config "$build/CPackConfig.cmake" -B "$work/deb" >"$work/cpack.log") \
  || { cat "$work/cpack.log"; exit 1; }
version=$("$prefix/bin/offloadctl" --version | awk '{print $2}')
runtime=$(ls "$work"/deb/strata_"$version"_*.deb)
dev=$(ls "$work"/deb/strata-dev_"$version"_*.deb)
# Captured first: `dpkg-deb ... | grep -q` would fail under pipefail when grep exits early.
rt_info=$(dpkg-deb --info "$runtime"); rt_files=$(dpkg-deb --contents "$runtime")
dev_info=$(dpkg-deb --info "$dev"); dev_files=$(dpkg-deb --contents "$dev")
grep -q "Depends: .*libtbb12" <<<"$rt_info" || { echo "install-check: $runtime lacks its Depends"; exit 1; }
grep -q "./usr/bin/offloadctl" <<<"$rt_files" || { echo "install-check: offloadctl missing from $runtime"; exit 1; }
grep -q "Depends: strata (= $version)" <<<"$dev_info" \
  || { echo "install-check: $dev does not depend on strata $version"; exit 1; }
for f in ./usr/include/strata/store.h ./usr/lib/cmake/strata/strataConfig.cmake \
         ./usr/lib/pkgconfig/strata.pc; do
  grep -q "$f" <<<"$dev_files" || { echo "install-check: $f missing from $dev"; exit 1; }
done
echo "install-check: ok ($(basename "$runtime"), $(basename "$dev"))"
