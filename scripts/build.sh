#!/usr/bin/env bash
# Quick start, step 1: install, build the default model through every stage, print the results.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export DVC_NO_ANALYTICS=1 DO_NOT_TRACK=1
dvc repro
for table in reports/*/report.md; do
  echo
  cat "$table"
done
