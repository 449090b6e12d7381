#!/usr/bin/env bash
# The default test suite (what CI runs): lint, then pytest without the `slow` marker, listing
# every test that took a second or more. A tier alone: bash scripts/test.sh -m unit (no model,
# process or compiler: under a minute), -m engine, -m e2e, -m slow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest --durations=0 --durations-min=1 "$@"
