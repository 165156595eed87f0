#!/usr/bin/env bash
# Create a separate venv with OpenVINO GenAI, a benchmark peer that ortforge is compared against
# and never depends on: its transformers/optimum pins clash with ours (see STACK.md).
# Usage: benchmarks/peers/setup_openvino.sh [VENV_DIR]   (default: ../peers/openvino beside the repo)
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-$root/../peers/openvino}
mkdir -p "$(dirname "$venv")"
venv=$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")  # absolute, so messages and bin/ paths hold

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "needs Python 3.11, found " + sys.version' \
  || { echo "error: set PYTHON to a Python 3.11 interpreter" >&2; exit 2; }

torch_pin=torch==2.13.0
# transformers 5.0.0: optimum-intel 2.2.0 takes up to 5.5 but exports Gemma (2 and 3) only up to
# 5.0 ("Maximum required is 5.0"); LLaMA-family exports work at 5.0.0 too.
peer_pins=(openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0
  optimum-intel==2.2.0 nncf==3.4.0 transformers==5.0.0)

# True when every pin is installed, torch is the CPU build and torchvision is gone.
check() {
  "$venv/bin/python" - "$torch_pin" "${peer_pins[@]}" <<'PY'
import sys
from importlib import metadata

wrong = []
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    # torch's local label (+cpu) is part of what we want; for the others the public version is all
    if have is None or have.split("+")[0] != want or (name == "torch" and not have.endswith("+cpu")):
        wrong.append(f"{name}: want {want}, have {have}")
try:
    wrong.append(f"torchvision {metadata.version('torchvision')} is installed")
except metadata.PackageNotFoundError:
    pass
if not wrong:
    import openvino_genai  # noqa: F401  an install that cannot import is not in place
print("\n".join(wrong), file=sys.stderr)
sys.exit(1 if wrong else 0)
PY
}

if [ -x "$venv/bin/python" ] && check 2>/dev/null; then
  echo "OpenVINO peer venv in place: $venv"
  exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# torch first and pinned: any other spec pulls a multi-GB CUDA build. TORCH_INDEX_URL may point
# at https://download.pytorch.org/whl/cpu on machines without a local CPU wheel.
"${pip[@]}" install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$torch_pin"

# optimum-intel needs torchvision, whose newest release wants a newer (CUDA) torch. Holding torch
# at our pin makes pip pick the torchvision built for it instead of swapping torch out.
hold=$(mktemp)
trap 'rm -f "$hold"' EXIT
echo "$torch_pin" >"$hold"
"${pip[@]}" install -q -c "$hold" "${peer_pins[@]}"

# The STACK.md fix: torchvision is only used for vision models, so drop it; and if the hold above
# did not keep torch (pip may still swap it), remove the CUDA torch with its libraries and put the
# CPU one back. pip check then complains about optimum-intel's torchvision, harmlessly.
"${pip[@]}" uninstall -q -y torchvision
if ! "$venv/bin/python" -c 'import sys; from importlib.metadata import version
sys.exit(version("torch") != sys.argv[1] + "+cpu")' "${torch_pin#torch==}"; then
  "${pip[@]}" uninstall -q -y torch
  mapfile -t cuda < <("${pip[@]}" list --format=freeze | grep -E '^(nvidia-|triton=|cuda-)' | cut -d= -f1 || true)
  [ ${#cuda[@]} -eq 0 ] || "${pip[@]}" uninstall -q -y "${cuda[@]}"
  "${pip[@]}" install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$torch_pin"
fi

check
echo "OpenVINO peer venv ready: $venv"
"$venv/bin/python" -c 'import openvino_genai; print("openvino-genai", openvino_genai.__version__)'
