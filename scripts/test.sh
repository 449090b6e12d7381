#!/usr/bin/env bash
# The default test suite (what CI runs): lint, then pytest without the `slow` marker.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
