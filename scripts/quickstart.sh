#!/usr/bin/env bash
# The main job on the embedded default: export SmolLM2-135M (once) and answer a prompt through
# the ONNX chain. Usage: bash scripts/quickstart.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
if [ ! -f models/smollm2-135m/manifest.json ]; then
  .venv/bin/edgelite-export smollm2-135m --out models/smollm2-135m
fi
.venv/bin/edgelite generate --model models/smollm2-135m --max-tokens 96 \
  "${1:-In two sentences, why do phones get warm when they run AI models?}"
