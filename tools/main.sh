#!/usr/bin/env bash
# The main job on sensible defaults: installs what is missing, builds, and plans memory for a
# 7B model on 8 GPUs (ZeRO stages, tiers, offload recommendation) with an example DeepSpeed config.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
bash tools/build.sh >/dev/null
./build/tools/offloadctl plan --params 7B --gpus 8 --config examples/ds_zero3_offload.json "$@"
