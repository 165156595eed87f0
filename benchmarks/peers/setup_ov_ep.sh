#!/usr/bin/env bash
# Install onnxruntime's OpenVINO execution provider plugin (PyPI onnxruntime-ep-openvino, which
# bundles OpenVINO's runtime) into a folder beside the repo, for benchmarks/execution_providers.py.
# It is a benchmark candidate ortforge never depends on: the plugin registers with the
# onnxruntime the project pins (onnxruntime.register_execution_provider_library), so nothing of
# ours is replaced and no venv is needed.
# Usage: benchmarks/peers/setup_ov_ep.sh [DIR]   (default: ../peers/ov-ep beside the repo)
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/../peers/ov-ep}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)  # absolute, so messages name it plainly
pin=onnxruntime-ep-openvino==1.8.1
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || { echo "error: $python not found; run scripts/install.sh first (or set PYTHON)" >&2; exit 2; }
library=$dir/onnxruntime_ep_openvino/libonnxruntime_providers_openvino_plugin.so
if [ -f "$library" ]; then
  echo "OpenVINO EP plugin already in $dir"
  exit 0
fi
"$python" -m pip install --quiet --no-deps --target "$dir" "$pin"
[ -f "$library" ] || { echo "error: $pin installed no $library" >&2; exit 1; }
echo "OpenVINO EP plugin installed in $dir"
