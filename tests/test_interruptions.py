"""A stage killed with SIGKILL while writing leaves nothing where DVC would cache its output, and
running it again completes with exactly the files of an uninterrupted run."""

from __future__ import annotations

import signal
import sys
import textwrap

from ortforge.manifest import file_records
from tasks.core.files import remove_abandoned_temporaries
from tests.conftest import run_module, tiny_params, write_params

# Runs the quantize stage's entry point, but SIGKILLs the process right after the model file is
# written into the stage's temporary folder: the manifest and the rename into place never happen.
KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, runpy, signal, sys
    from tasks.graphs import onnx_io

    real_save = onnx_io.save_graph_only

    def save_then_die(model, folder):
        real_save(model, folder)
        os.kill(os.getpid(), signal.SIGKILL)

    onnx_io.save_graph_only = save_then_die
    sys.argv = ["tasks.quantize", *sys.argv[1:]]
    runpy.run_module("tasks.quantize", run_name="__main__")
    """
)


def quantize_args(built, out):
    return [
        "--model",
        "tiny",
        "--variant",
        "int4",
        "--optimized",
        str(built["optimized"]),
        "--hf",
        str(built["hf"]),
    ] + [
        "--out",
        str(out),
    ]


def test_killed_stage_leaves_no_output_and_rerun_matches_clean_run(built, tmp_path):
    import subprocess

    write_params(tmp_path, tiny_params(built["hf"]))
    out = tmp_path / "variants" / "int4"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, *quantize_args(built, out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()
    leftovers = list(out.parent.glob(".int4.tmp-*"))
    assert leftovers and any((leftover / "model.onnx").is_file() for leftover in leftovers)  # died mid-output

    resumed = run_module("tasks.quantize", *quantize_args(built, out), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not list(out.parent.glob(".int4.tmp-*"))  # the dead writer's temporary is cleaned up

    clean = tmp_path / "clean" / "int4"
    assert run_module("tasks.quantize", *quantize_args(built, clean), cwd=tmp_path).returncode == 0
    assert file_records(out) == file_records(clean)
    assert (out / "manifest.json").read_bytes() == (clean / "manifest.json").read_bytes()


def test_temporaries_of_live_writers_are_left_alone(tmp_path):
    import os

    live = tmp_path / f".out.tmp-{os.getpid()}-abcd1234"
    dead = tmp_path / ".out.tmp-999999999-abcd1234"
    live.mkdir()
    dead.mkdir()
    assert remove_abandoned_temporaries(tmp_path / "out") == [dead]
    assert live.is_dir() and not dead.exists()
