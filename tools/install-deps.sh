#!/usr/bin/env bash
# Installs the Debian (bookworm) packages strata builds and tests with. Run as root (or with
# sudo). The CUDA toolkit and NCCL are not Debian packages: when /usr/local/cuda/bin/nvcc exists
# the build uses them, otherwise CUDA code is switched off.
set -euo pipefail
pkgs=(
  build-essential cmake ninja-build pkg-config ccache git
  libtbb-dev libhwy-dev libhwloc-dev liburing-dev libgloo-dev
  nlohmann-json3-dev libcli11-dev libxxhash-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  fio python3 iproute2
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all packages present"
fi
