#!/usr/bin/env bash
# Quick start, step 1: install, build a model through every stage, print its results table.
#   bash scripts/build.sh                 # the default model, smollm2-135m
#   bash scripts/build.sh gemma3-270m     # any model of params.yaml `models` (several allowed)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export DVC_NO_ANALYTICS=1 DO_NOT_TRACK=1
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m)
options=()
for model in "${models[@]}"; do
  options+=(--model "$model")
done
# One line per stage and the results table; everything else goes to the log it names.
ortforge build "${options[@]}"
ortforge report "${options[@]}"
