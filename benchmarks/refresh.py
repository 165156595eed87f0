"""Measure again the result files the README's figures come from, one command for all:

    python -m benchmarks.refresh           # the files whose measured artifacts changed (dvc.lock)
    python -m benchmarks.refresh --all     # every one
    python -m benchmarks.refresh --list    # what each file measured and whether it is current

Each file's own provenance names the command that wrote it (benchmarks/provenance.py); a file
from before provenance was recorded runs its script's default command. Runs one at a time: two
benchmarks on the same cores would measure each other.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks import provenance

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# Each result file and the command that writes it (the default when the file records none).
COMMANDS = {
    "kv_cache.json": "python benchmarks/kv_cache.py",
    "serving.json": "python benchmarks/serving.py",
    "side_by_side.json": "python benchmarks/side_by_side.py",
    "fanout.json": "python benchmarks/fanout.py",
    "architectures.json": "python benchmarks/architectures.py",
    "moe_decode.json": "python benchmarks/moe_decode.py",
    "cache_reuse.json": "python benchmarks/cache_reuse.py",
    "scale.json": "python benchmarks/scale.py",
    "continuations-gemma3-270m.json": "python benchmarks/continuations.py --model gemma3-270m",
    "step_profile.json": "python benchmarks/step_profile.py",
    "step_profile-512.json": (
        "python benchmarks/step_profile.py --prompt-tokens 512 --variants w8a8 w8a8_attn w8a8_attn_kv8"
    ),
    "quantize_chain.json": "python benchmarks/quantize_chain.py",
    "server_soak.json": "python benchmarks/server_soak.py",
    "structured.json": "python benchmarks/structured.py",
    "kernels.json": "python benchmarks/kernels.py",
    "attention.json": "python benchmarks/attention.py",
    "attention_kernel.json": "python benchmarks/attention_kernel.py",
    "attention_op.json": "python benchmarks/attention_op.py",
    "attention_op-gemma3-270m.json": "python benchmarks/attention_op.py --model gemma3-270m",
    "attention_replies.json": "python benchmarks/attention_replies.py",
    "attention_replies-gemma3-270m.json": "python benchmarks/attention_replies.py --model gemma3-270m",
    "load_peers.json": "python benchmarks/load_peers.py --variants int4 int8 w8a8 w8a8_attn_kv8",
    "load_peers-gemma3-270m.json": "python benchmarks/load_peers.py --model gemma3-270m",
    "execution_providers.json": "python benchmarks/execution_providers.py",
    "prefill_pieces.json": "python benchmarks/prefill_pieces.py",
    "prefill_pieces-gemma3-270m.json": "python benchmarks/prefill_pieces.py --model gemma3-270m",
}


MISSING = "it does not exist (never measured, or deleted)"


def read(name: str) -> dict | list:
    path = RESULTS / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def command(name: str) -> str:
    result = read(name)
    found = result.get("provenance", {}) if isinstance(result, dict) else {}
    return found.get("refresh") or COMMANDS[name]


def stale(outputs: dict | None = None) -> dict[str, list[str]]:
    """Each result file whose figures no longer describe what dvc.lock names, with why."""
    outputs = provenance.lock_outputs() if outputs is None else outputs
    found = {}
    for name in COMMANDS:
        if not (RESULTS / name).is_file():
            found[name] = [MISSING]
            continue
        result = read(name)
        reasons = provenance.stale(result if isinstance(result, dict) else {}, outputs)
        if reasons:
            found[name] = reasons
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every result file, current or not")
    parser.add_argument("--list", action="store_true", help="only say what is stale")
    args = parser.parse_args(argv)
    behind = stale()
    if args.list:
        for name in COMMANDS:
            print(f"{name}: {'; '.join(behind[name]) if name in behind else 'current'} ({command(name)})")
        return 0
    chosen = list(COMMANDS) if args.all else list(behind)
    if not chosen:
        print("every result file describes what dvc.lock names; nothing to measure")
        return 0
    for name in chosen:
        print(f"== {name}: {command(name)}", flush=True)
        subprocess.run(shlex.split(command(name)), cwd=REPO, check=True)
    print("now: python scripts/readme_figures.py, then commit benchmarks/results and README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
