"""How much a restored DVC cache saves: a cold build, a no-op `dvc repro`, and a warm CI-style run
(fresh clone of the cold build's commit + its .dvc/cache restored), on the committed params, of one
model's whole DAG (`report@<model>`, what scripts/build.sh and CI build; the default model unless
--model says).

The cold build is `dvc repro --force` in a fresh clone with an empty cache: every stage executes,
including validate and bench, whose committed metrics would otherwise let DVC skip them when the
rebuilt artifacts hash the same as in dvc.lock.

    python benchmarks/cache_reuse.py [--model smollm2-135m] [--keep]

Clones HEAD into a temporary folder (commit first), prints a table and writes
benchmarks/results/cache_reuse.json. Takes about as long as one full build.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "cache_reuse.json"


def timed(command: list[str], cwd: Path) -> dict:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "DVC_NO_ANALYTICS": "1",
    }
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed in {cwd}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return {"seconds": round(seconds, 2), "stages_executed": len(re.findall(r"Running stage '", result.stdout))}


def clone(into: Path, origin: Path = REPO) -> Path:
    subprocess.run(["git", "clone", "-q", str(origin), str(into)], check=True)
    return into


def commit_build(repo: Path) -> None:
    """Commit what the build changed in git (dvc.lock, metrics, the tuned runtime.json files), as a
    developer does before pushing: those are measurements, so a restored cache matches the commit
    of the build that filled it, not an older one."""
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    identity = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run(["git", *identity, "commit", "-q", "--allow-empty", "-m", "cold build"], cwd=repo, check=True)


def measure(workdir: Path, model: str) -> dict:
    target = f"report@{model}"  # with --force, every stage upstream of it runs too
    cold_repo = clone(workdir / "cold")
    print(f"cold build of {target} (empty cache, every stage)...", flush=True)
    cold = timed([sys.executable, "-m", "dvc", "repro", "--force", target], cold_repo)
    dvc_repro = [sys.executable, "-m", "dvc", "repro", target]
    print("no-op dvc repro...", flush=True)
    noop = timed(dvc_repro, cold_repo)

    commit_build(cold_repo)
    warm_repo = clone(workdir / "warm", origin=cold_repo)
    started = time.perf_counter()
    shutil.copytree(cold_repo / ".dvc" / "cache", warm_repo / ".dvc" / "cache")  # what actions/cache restores
    restore_seconds = round(time.perf_counter() - started, 2)
    print("warm CI-style run (fresh clone + restored cache)...", flush=True)
    warm = timed(dvc_repro, warm_repo)
    cache_bytes = sum(p.stat().st_size for p in (cold_repo / ".dvc" / "cache").rglob("*") if p.is_file())
    return {
        "model": model,
        "cold_build": cold,
        "noop_repro": noop,
        "warm_ci_run": {**warm, "cache_restore_seconds": restore_seconds, "cache_mb": round(cache_bytes / 1e6)},
        "warm_share_of_cold": round(warm["seconds"] / cold["seconds"], 4),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="the model whose DAG is built")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clones")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ortforge-cache-bench-"))
    try:
        figures = measure(workdir, args.model)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    # It builds a clone of HEAD from nothing: the commit says what it measured.
    figures = {"provenance": provenance.record(provenance.command("cache_reuse.py", argv)), **figures}
    atomic_write_json(RESULTS, figures)
    print("\n| run | wall s | stages executed |\n|---|---|---|")
    for name in ("cold_build", "noop_repro", "warm_ci_run"):
        print(f"| {name.replace('_', ' ')} | {figures[name]['seconds']:.1f} | {figures[name]['stages_executed']} |")
    print(f"\nwarm run = {figures['warm_share_of_cold']:.1%} of the cold build; written to {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
