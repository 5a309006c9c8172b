#!/usr/bin/env bash
# Creates (or completes) the Python virtual environment the strata package is built and tested
# in: ${STRATA_VENV:-.venv} at the repository root (ignored by git), with torch (the CPU wheel from
# download.pytorch.org when reachable, else PyPI's), nanobind, scikit-build-core, pytest, numpy,
# safetensors (the tests read save_16bit_model's file with it) and transformers (the tests train
# its GPT-2 and Llama, random init from a small config: nothing is downloaded from the Hub) and
# peft (a LoRA adapter on that Llama), accelerate (transformers.Trainer needs it) and trl (its
# SFT and DPO trainers on that Llama; it brings datasets),
# plus the extra packages named as arguments (tools/main.sh: matplotlib). Prints the venv's path on the last line. Idempotent: a
# complete venv is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${STRATA_VENV:-$PWD/.venv}
py=${PYTHON:-python3}
# Debian's python3 needs python3-venv (ensurepip) and python3-dev (Python.h for the module).
if command -v dpkg-query >/dev/null && [[ "$($py -c 'import sys; print(sys.prefix)')" == /usr ]]; then
  missing=()
  for p in python3-venv python3-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    SUDO=""
    [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    echo "python-env: installing ${missing[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
fi
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
vpy="$venv/bin/python"
# torch: the CPU wheel (~200 MB) from download.pytorch.org, else PyPI's (~3 GB with its CUDA
# libraries). The first attempt's output is kept out of sight: an unreachable index is the
# expected case on many machines, and pip's "Could not find a version" would read as a failure.
# It is shown only when the fallback fails too.
install_torch() {
  local log
  log=$(mktemp)
  echo "python-env: installing torch, trying the CPU wheel from download.pytorch.org" >&2
  if "$vpy" -m pip install -q --retries 0 --timeout 15 torch \
      --index-url https://download.pytorch.org/whl/cpu >"$log" 2>&1; then
    rm -f "$log"
    return 0
  fi
  echo "python-env: download.pytorch.org gave no CPU wheel (unreachable, or none for this" \
    "Python); installing torch from PyPI instead (~3 GB, a few minutes)" >&2
  if "$vpy" -m pip install -q torch >&2; then
    rm -f "$log"
    return 0
  fi
  echo "python-env: installing torch failed from both indexes; download.pytorch.org said:" >&2
  cat "$log" >&2
  rm -f "$log"
  return 1
}
if ! "$vpy" -c 'import torch' 2>/dev/null; then
  "$vpy" -m pip install -q --upgrade pip >&2
  install_torch
fi
"$vpy" -c 'import nanobind, scikit_build_core, pytest, numpy, safetensors, transformers, peft, accelerate, trl' \
  2>/dev/null ||
  "$vpy" -m pip install -q "nanobind>=2.2" "scikit-build-core>=0.10" pytest numpy safetensors \
    "transformers>=5.3" "peft>=0.10" accelerate "trl>=1.0" >&2
for extra in "$@"; do
  "$vpy" -c "import $extra" 2>/dev/null || "$vpy" -m pip install -q "$extra" >&2
done
echo "$venv"
