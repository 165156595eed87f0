"""What a result file measured, so a figure can be told apart from one about an artifact that no
longer exists: the code commit, and the hashes dvc.lock gives the DVC outputs it read (artifacts,
their runtime settings and validation stamps, the HF folder PyTorch ran), the command that
measures it again, and the peers' versions.

Every benchmark writes `provenance` into its result file (record()); `scripts/readme_figures.py
--check` fails when a recorded hash differs from dvc.lock's now (stale()), naming the file and its
refresh command; `python -m benchmarks.refresh` runs the refresh command of every stale file.
A benchmark that builds what it measures (random-weight models, its own throwaway project)
records the commit alone: nothing in dvc.lock describes it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "dvc.lock"
# What a measurement runs, besides the artifacts (the result files beside the benchmarks are not code:
# a run that writes one while another's is uncommitted must not call the code modified).
CODE = ("tasks", "ortforge", "benchmarks", "flows", ":(exclude)benchmarks/results")
DEFAULT_SETTINGS = "onnxruntime's defaults"  # how settings_used starts when bench's settings do not apply here
UNRECORDED = "it records no provenance (measured before result files said what they measured)"


def lock_outputs(lock: Path = LOCK) -> dict[str, dict]:
    """Every output dvc.lock records: path -> {stage, md5}."""
    stages = (yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages", {})
    found = {}
    for name, stage in stages.items():
        for out in stage.get("outs", []):
            found[out["path"]] = {"stage": name, "md5": out["md5"]}
    return found


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def model_outputs(model: str, variants: Iterable[str], hf: bool = False) -> list[str]:
    """The DVC outputs a runtime measurement of model's variants reads: each variant's folder, the
    settings bench tuned for it and its validation stamp; with hf, the HF folder (PyTorch's rows)."""
    base = f"artifacts/{model}"
    paths = [f"{base}/hf"] if hf else []
    for variant in variants:
        paths += [f"{base}/variants/{variant}", f"{base}/variants/{variant}.runtime.json"]
        paths.append(f"{base}/variants/{variant}.valid.json")
    return paths


def current_variant(model: str, variant: str) -> tuple[Path, list[str]]:
    """A built variant's folder and the DVC outputs a measurement of it reads; SystemExit before
    any work when it is missing or differs from what dvc.lock records."""
    from tasks.core.paths import variant_dir

    folder = REPO / variant_dir(model, variant)
    if not (folder / "model.onnx").is_file():
        raise SystemExit(f"error: {folder} is missing; run `dvc repro` first")
    measured = model_outputs(model, [variant])
    require_current(measured)
    return folder, measured


def require_current(paths: list[str]) -> None:
    """SystemExit, before measuring, when an output is not in dvc.lock or differs from it on disk
    (a result would record hashes of something other than what it measured)."""
    outputs = lock_outputs()
    unknown = [path for path in paths if path not in outputs]
    if unknown:
        raise SystemExit(f"error: {', '.join(unknown)} not in dvc.lock; run `dvc repro` first")
    stages = sorted({outputs[path]["stage"] for path in paths})
    import sys

    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--quiet", *stages], cwd=REPO, capture_output=True, text=True
    )
    if status.returncode != 0:
        said = status.stdout.strip() or status.stderr.strip()
        raise SystemExit(
            f"error: what {', '.join(stages)} built differs from dvc.lock ({said}); run `dvc repro` first, so the "
            "figures describe what dvc.lock names"
        )


def command(script: str, argv: list[str] | None) -> str:
    """The command line that ran script with argv (sys.argv's when None): what refreshes its file."""
    import shlex
    import sys

    return shlex.join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def file_md5(path: Path) -> str:
    """The hash dvc.lock gives a single-file output (md5 of its bytes)."""
    import hashlib

    return hashlib.md5(path.read_bytes()).hexdigest()


def code_state(code: Iterable[str] = CODE) -> tuple[str, bool]:
    """The commit HEAD names, and whether the working tree's code differs from it."""
    return _git("rev-parse", "HEAD"), bool(_git("status", "--porcelain", "--", *code))


def record(refresh: str, paths: list[str] = (), peers: dict | None = None) -> dict:
    """The provenance a result file carries: the command that refreshes it, the commit (and
    whether the code differed from it), dvc.lock's hashes of paths, the peers' versions, and the
    machine it ran on (its figures are true of that CPU: compare them as ratios within the file)."""
    from ortforge import machine

    outputs = lock_outputs() if paths else {}
    commit, modified = code_state()
    return {
        "refresh": refresh,
        "commit": commit,
        "code_modified": modified,
        "measured": {path: outputs[path]["md5"] for path in paths},
        "peers": peers or {},
        "machine": machine.describe(),
    }


def settings_used(folder: Path) -> str:
    """Which session settings the runtime gives an artifact on this machine, said as a table cell:
    bench's (its runtime.json) where bench tuned them on this CPU, onnxruntime's defaults where it
    tuned them on another (ortforge.session.tuned_for, the rule SessionSettings.for_artifact applies)."""
    import json

    from ortforge import machine
    from ortforge.manifest import runtime_config
    from ortforge.session import tuned_for

    path = runtime_config(folder)
    if not path.is_file():
        return f"{DEFAULT_SETTINGS} (never benched)"
    tuned_on, here = json.loads(path.read_text(encoding="utf-8")).get("machine"), machine.describe()
    if tuned_on is None or tuned_for(tuned_on, here):
        return "tuned by bench (runtime.json)"
    if tuned_on.get("cpu") not in (None, here["cpu"]):
        return f"{DEFAULT_SETTINGS} (bench tuned it on {tuned_on['cpu']})"
    missing = [name for name in tuned_on["features"] if name not in here["features"]]
    return f"{DEFAULT_SETTINGS} (bench tuned it on a CPU with {'+'.join(missing)})"


def stale_stages(root: Path = REPO) -> list[str]:
    """The stages whose code, params or inputs changed since dvc.lock recorded them: the figures
    of their outputs describe artifacts that are no longer what the project builds. Asks DVC, as
    .github/workflows/lock.yml does; needs no data (absent outputs do not count)."""
    import re
    import sys

    said = subprocess.run(
        [sys.executable, "-m", "dvc", "repro", "--allow-missing", "--dry"],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "DVC_NO_ANALYTICS": "1"},
    )
    found = re.findall(r"(?:Running stage|failed to reproduce) '([^']+)'", said.stdout + said.stderr)
    if said.returncode != 0 and not found:
        raise RuntimeError(f"dvc repro --dry failed: {(said.stderr or said.stdout).strip()[-500:]}")
    return sorted(set(found))


def stale(result: dict, outputs: dict[str, dict] | None = None) -> list[str]:
    """Why result no longer describes what dvc.lock names ([] when it does)."""
    found = result.get("provenance")
    if not found:
        return [UNRECORDED]
    outputs = lock_outputs() if outputs is None else outputs
    reasons = []
    for path, md5 in found["measured"].items():
        now = outputs.get(path, {}).get("md5")
        if now != md5:
            reasons.append(f"{path} is {now or 'no longer built'} in dvc.lock, {md5} when measured")
    return reasons
