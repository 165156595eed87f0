#!/usr/bin/env bash
# Quick start, step 2: install, lint, and run the test suite (tiny random models; about 20 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export DVC_NO_ANALYTICS=1 DO_NOT_TRACK=1
# The HTML report test renders the page in Debian's Chromium; install it where we can (as root with
# apt-get, as CI runs). Elsewhere that one test skips and says why.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null \
    || echo "warning: could not install chromium; the HTML rendering test will skip" >&2
fi
ruff check .
ruff format --check .
# Two workers (pytest-xdist): the suite's DVC and Prefect builds are chains of one-process stages,
# so two at once use both cores; a file's tests stay on one worker to share its module fixtures.
# Arguments after these win: `bash scripts/test.sh -n 0 tests/test_x.py` runs in this process.
python -m pytest -n 2 --dist loadfile "$@"
