#!/usr/bin/env bash
# Quick start, step 2: install, lint, and run the test suite (tiny random models; a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export DVC_NO_ANALYTICS=1 DO_NOT_TRACK=1
ruff check .
ruff format --check .
python -m pytest "$@"
