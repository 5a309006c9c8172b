#!/usr/bin/env bash
# The main job on sensible defaults: installs what is missing (Debian packages, a Python venv with
# torch and matplotlib: tools/python-env.sh), builds strata's Python module, and trains a
# character-level GPT on Shakespeare (examples/train_gpt.py) with ZeRO-3, the optimizer state on
# NVMe and the parameters on cpu, on 2 CPU ranks under torchrun, with the DeepSpeed config
# examples/ds_gpt_zero3_nvme.json. Prints a progress bar and a summary; writes runs/train_gpt/
# (summary.json, train_gpt.png). Extra arguments go to the example (e.g. --steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
venv=$(bash tools/python-env.sh matplotlib | tail -n 1)
TARGETS=_strata bash tools/build.sh -DSTRATA_PYTHON=ON "-DPython_EXECUTABLE=$venv/bin/python" >/dev/null
export PYTHONPATH="$PWD/build/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
exec "$venv/bin/torchrun" --standalone --nproc_per_node "${RANKS:-2}" examples/train_gpt.py "$@"
