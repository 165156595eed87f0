"""Faults around a build: measurements kept in git survive a failed run, an unwritable output stops
`ortforge build` before DVC deletes anything, dead writers' temporaries go whatever DVC restores,
a killed build's `dvc repro` keeps the lock, settings tuned on another CPU are not used, and
bench without tuning still writes the settings it measured with."""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.dvc import BUILD_LOCK
from ortforge import machine
from ortforge.session import SessionSettings, runtime_config
from tests.conftest import REPO, TINY_PARAMS, dvc, fresh_clone, set_param, tiny_params, write_params

# bench@tiny-fp32 runs first; its measurements are what a failing run would delete.
MEASURED = ("artifacts/tiny/variants/fp32.runtime.json", "reports/tiny/variants/fp32/bench.json")


def ortforge(project, *args: str, **options) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ortforge.cli", "--root", str(project), *args]
    return subprocess.run(command, capture_output=True, text=True, **options)


@pytest.fixture
def built_clone(pushed, tmp_path):
    """A fresh clone of the built tiny project with its artifacts pulled: nothing to rebuild."""
    clone = fresh_clone(pushed, f"clone-{tmp_path.name}")
    dvc(clone, "pull")
    return clone


def test_bench_without_tuning_writes_the_settings_it_used(built, params, tmp_path):
    from tasks import bench, validate

    variant = tmp_path / "int4"
    shutil.copytree(built["int4"], variant)
    section = params.validation
    asked = validate.Asked.from_params(params, "tiny", "int4")
    validate.run(section.eval, asked, variant, built["reference"], tmp_path / "v.json", "int4")
    untuned = tiny_params(built["hf"])
    untuned["bench"] |= {"tune": False, "baseline": False}
    write_params(tmp_path, untuned)
    runtime = runtime_config(variant)
    argv = ["--model", "tiny", "--variant", "int4", "--variant-dir", str(variant), "--hf", str(built["hf"])]
    argv += ["--report", str(tmp_path / "bench.json"), "--runtime", str(runtime)]
    argv += ["--params", str(tmp_path / "params.yaml")]
    assert bench.main(argv) == 0
    written = json.loads(runtime.read_text())
    assert written["measured_by"] == "bench.tune false: not measured" and written["machine"]["features"] is not None
    assert SessionSettings.for_artifact(variant) == SessionSettings.from_dict(written["session"])


def test_runtime_ignores_settings_tuned_on_a_cpu_with_other_features(built, tmp_path, caplog):
    variant = tmp_path / "int4"
    shutil.copytree(built["int4"], variant)
    tuned = {"session": SessionSettings(intra_op_threads=1, graph_level="basic").to_dict()}
    runtime_config(variant).write_text(json.dumps(tuned | {"machine": {"cpu": "elsewhere", "features": ["amx_int8"]}}))
    with caplog.at_level(logging.WARNING, logger="ortforge.session"):
        assert SessionSettings.for_artifact(variant) == SessionSettings()
        assert SessionSettings.for_artifact(variant) == SessionSettings()  # said once per process
    [record] = caplog.records
    said = record.getMessage()
    assert "was tuned on elsewhere with features amx_int8" in said and "ortforge bench" in said and "\n" not in said
    runtime_config(variant).write_text(json.dumps(tuned))  # no machine recorded: trusted as before
    assert SessionSettings.for_artifact(variant).graph_level == "basic"


def test_runtime_keeps_settings_tuned_on_the_same_cpu_model_with_fewer_features(built, tmp_path, caplog):
    """A probe that finds one more flag on the same CPU model (avx_vnni beside avx512_vnni) keeps
    the tuned settings and says nothing; a missing feature or another model does not."""
    variant = tmp_path / "int4"
    shutil.copytree(built["int4"], variant)
    here = machine.describe()
    tuned = {"session": SessionSettings(intra_op_threads=1, graph_level="basic").to_dict()}
    with caplog.at_level(logging.WARNING, logger="ortforge.session"):
        for recorded, kept in (
            ({"cpu": here["cpu"], "features": here["features"][:-1]}, True),
            ({"cpu": here["cpu"], "features": [*here["features"], "amx_tile"]}, False),
            ({"cpu": here["cpu"] + " v2", "features": here["features"]}, False),
        ):
            runtime_config(variant).write_text(json.dumps(tuned | {"machine": recorded}))
            assert (SessionSettings.for_artifact(variant).graph_level == "basic") is kept, recorded
    assert len(caplog.records) == 1  # the two declined: one file, said once


@pytest.mark.e2e
def test_a_failed_bench_keeps_the_measurements_in_git(built_clone):
    before = {path: (built_clone / path).read_text() for path in MEASURED}
    set_param(built_clone, ["bench", "prompt_tokens"], 100_000)  # past the model's context
    result = dvc(built_clone, "repro", check=False)
    assert result.returncode != 0 and "exceed the model's context" in result.stdout + result.stderr
    assert {path: (built_clone / path).read_text() for path in MEASURED} == before  # they persist


@pytest.mark.e2e
def test_git_kept_outputs_a_failed_build_lost_come_back(built_clone):
    from flows.preflight import measurements_kept

    report = built_clone / "reports/tiny/variants/int4/validate.json"  # beside a cached output: no persist
    before = report.read_text()
    with pytest.raises(RuntimeError), measurements_kept(built_clone):
        report.unlink()  # what DVC does before running validate@tiny-int4
        raise RuntimeError("the stage died before writing its report")
    assert report.read_text() == before
    with measurements_kept(built_clone):  # a stage that wrote its own report keeps it
        report.write_text('{"passed": false}\n')
    assert report.read_text() == '{"passed": false}\n'


@pytest.mark.parametrize(
    ("key", "change"),
    [
        ("bench.text", lambda p: p["bench"].update(text="data/eval/no-such.txt")),
        ("calibration.text", lambda p: p["calibration"].update(text="data/no-such.txt")),
        (
            "validate.eval.texts[1]",
            lambda p: p["validate"]["eval"].update(texts=["data/eval/GPL-3.txt", "data/eval/x.c"]),
        ),
        ("models.tiny.source.path", lambda p: p["models"]["tiny"]["source"].update(path="no/such/folder")),
        ("tasks.sets.chat_qa.file", lambda p: p["tasks"]["sets"]["chat_qa"].update(file="data/tasks/no-such.jsonl")),
    ],
)
def test_build_refuses_a_path_params_names_that_does_not_exist_before_dvc(built, tmp_path, capsys, key, change):
    """DVC would say `[Errno 2]` (for bench.text only after reference and validate ran)."""
    from ortforge import cli

    params = tiny_params(built["hf"])
    params.setdefault("bench", {})
    change(params)
    write_params(tmp_path, params)
    for folder in ("eval", "tasks"):
        shutil.copytree(REPO / "data" / folder, tmp_path / "data" / folder)
    assert cli.main(["--root", str(tmp_path), "build"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: params.yaml {key}: ") and "does not exist; fix the path" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "logs").exists()  # DVC never started


def refused_before_dvc(tmp_path, capsys, source, **changed) -> str:
    """`ortforge build` of the tiny project over a local model folder (with changed sections of its
    params): its one-line refusal, after checking that it is one line and that DVC never started."""
    from ortforge import cli

    params = tiny_params(source, **changed)
    params.setdefault("bench", {})
    write_params(tmp_path, params)
    for folder in ("eval", "tasks"):
        shutil.copytree(REPO / "data" / folder, tmp_path / "data" / folder)
    assert cli.main(["--root", str(tmp_path), "build"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not (tmp_path / "logs").exists(), err  # DVC never started
    return err


def test_build_refuses_blocks_a_models_widths_cannot_hold_before_dvc(tmp_path, capsys):
    """A local model whose MLP is 72 wide (8 x 9: no block of 16 or more divides it) and weight-only
    builds (int8 is the first): quantize would refuse it only after export, optimize and reference ran."""
    from tests import tiny_models
    from tests.conftest import EVAL_TEXT

    source = tiny_models.build_hf_model(tmp_path / "src", EVAL_TEXT, intermediate_size=72)
    err = refused_before_dvc(tmp_path, capsys, source)
    assert err.startswith("error: params.yaml builds tiny-int8: tiny's intermediate_size is 72, which no block"), err
    assert "build tiny with method int8_dynamic or fp16 instead of int8" in err


def test_build_refuses_a_w8a8_its_exports_opset_cannot_hold_before_dvc(tiny_hf, tmp_path, capsys):
    """w8a8 writes opset-21 nodes, which optimum's export at opset 17 cannot be raised to; with
    exporter auto, ortforge's own exporter (tried first, its own opset) takes the model, so it passes."""
    from flows import preflight
    from tasks.core.params import load_params

    changed = copy.deepcopy({key: TINY_PARAMS[key] for key in ("models", "quantize", "validate")})
    changed["quantize"]["w8a8"] = {"method": "int8_per_token"}
    changed["validate"]["thresholds"]["w8a8"] = changed["validate"]["thresholds"]["int4"]
    changed |= {"builds": {"tiny-w8a8": {"model": "tiny", "variant": "w8a8"}}, "export": {"opset": 17}}
    changed["models"]["tiny"] |= {"exporter": "optimum", "source": {"kind": "local", "path": str(tiny_hf)}}
    err = refused_before_dvc(tmp_path, capsys, tiny_hf, **changed)
    assert err.startswith("error: params.yaml builds tiny-w8a8: int8_per_token writes opset 21 nodes"), err
    assert err.rstrip().endswith("cannot be raised to it (below 18); set export.opset to 18 or above"), err
    changed["models"]["tiny"]["exporter"] = "auto"  # ortforge's own exporter takes the tiny Llama first
    write_params(tmp_path, tiny_params(tiny_hf, **changed))
    preflight.check_per_token_opset(tmp_path, load_params(tmp_path / "params.yaml"))


def test_build_refuses_a_model_no_exporter_takes_before_dvc(tmp_path, capsys):
    """StarCoder2: ortforge's and genai's exporters do not write it and optimum exports it without
    a KV cache only, all decided from its config.json before DVC downloads or runs anything."""
    from tests import families
    from tests.conftest import EVAL_TEXT

    err = refused_before_dvc(tmp_path, capsys, families.build("starcoder2", tmp_path / "src", EVAL_TEXT))
    assert err.startswith("error: params.yaml models.tiny: no exporter can take Starcoder2ForCausalLM (ortforge: "), err
    assert err.rstrip().endswith("with a KV cache); use a supported causal LM")


def test_build_refuses_a_hub_models_widths_from_its_config_alone_before_download(tmp_path, capsys, monkeypatch):
    """A Hub source not fetched yet: preflight reads its config.json alone at the pinned revision
    (here from a pre-filled hub cache, offline) and refuses before DVC downloads any weight."""
    from huggingface_hub import constants

    from ortforge import cli
    from tests import tiny_models
    from tests.conftest import EVAL_TEXT

    revision = "a" * 40
    source = tiny_models.build_hf_model(tmp_path / "src", EVAL_TEXT, intermediate_size=72)
    snapshot = tmp_path / "hub" / "models--org--wide" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    shutil.copy(source / "config.json", snapshot / "config.json")  # the cache holds no weights at all
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    params = tiny_params(source)
    pinned = "data/sources/pinned.txt"
    params["models"]["tiny"]["source"] = {"kind": "hub", "repo_id": "org/wide", "revision": revision, "path": pinned}
    params.setdefault("bench", {})
    write_params(tmp_path, params)
    (tmp_path / pinned).parent.mkdir(parents=True)
    (tmp_path / pinned).write_text(f"org/wide@{revision}\n")
    for folder in ("eval", "tasks"):
        shutil.copytree(REPO / "data" / folder, tmp_path / "data" / folder)
    assert cli.main(["--root", str(tmp_path), "build"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: params.yaml builds tiny-int8: tiny's intermediate_size is 72, which no block"), err
    assert err.count("\n") == 1 and not (tmp_path / "logs").exists()  # DVC never started


def test_a_killed_builds_copies_of_kept_measurements_go_at_the_next_build(tmp_path):
    """kill -9 runs no cleanup: the next build removes the dead build's temp folder, not a live one's."""
    from flows.preflight import KEPT_PREFIX, remove_dead_builds_copies

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f"{KEPT_PREFIX}{dead.stdout.strip()}-x1y2"
    live = tmp_path / f"{KEPT_PREFIX}{os.getpid()}-a3b4"
    unrelated = tmp_path / f"{KEPT_PREFIX}notapid"
    for folder in (killed, live, unrelated):
        folder.mkdir()
        (folder / "0").write_text("a kept bench.json\n")
    assert remove_dead_builds_copies(tmp_path) == [killed]
    assert not killed.exists() and live.is_dir() and unrelated.is_dir()


@pytest.mark.e2e
def test_build_refuses_an_unwritable_output_before_dvc_deletes_anything(built_clone):
    stamp = built_clone / "artifacts/tiny/variants/int4.valid.json"
    reports = built_clone / "reports/tiny/variants/int8"
    shutil.rmtree(reports)
    reports.write_text("a file where a folder of outputs belongs\n")
    set_param(built_clone, ["quantize", "int4", "block_size"], 16)  # int4's stages must run again
    result = ortforge(built_clone, "build")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot write ")
    assert "reports/tiny/variants/int8 is a file, not a folder" in result.stderr
    assert stamp.is_file() and all((built_clone / path).is_file() for path in MEASURED)


@pytest.mark.e2e
def test_build_removes_dead_writers_temporaries_even_when_nothing_runs(built_clone):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    abandoned = built_clone / f"artifacts/tiny/variants/.int4.tmp-{dead.pid}-0123abcd"
    (abandoned / "model.onnx").parent.mkdir(parents=True)
    (abandoned / "model.onnx").write_bytes(b"half")
    result = ortforge(built_clone, "build")
    assert result.returncode == 0 and "no stage executed" in result.stdout
    assert not abandoned.exists()


@pytest.mark.e2e
def test_a_killed_build_takes_its_dvc_repro_and_stage_along(built_clone):
    set_param(built_clone, ["quantize", "int4", "block_size"], 16)  # work for `dvc repro` to do
    command = [sys.executable, "-m", "ortforge.cli", "--root", str(built_clone), "build"]
    build = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    repro = wait_for_child(build.pid, b"dvc repro")
    stage = wait_for_child(repro, b"tasks.")
    os.kill(build.pid, signal.SIGKILL)
    build.wait()
    wait_gone(repro)
    wait_gone(stage)
    with open(built_clone / BUILD_LOCK, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds the lock any more
        fcntl.flock(handle, fcntl.LOCK_UN)
    again = ortforge(built_clone, "build")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Data and pipelines are up to date" in dvc(built_clone, "status").stdout


def wait_for_child(parent: int, marker: bytes) -> int:
    """The pid of parent's child whose command line holds marker (not a dry run)."""
    for _ in range(1200):
        found = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
        for pid in found:
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            if marker in cmdline and b"--dry" not in cmdline:
                return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"{parent} never started {marker!r}")


def wait_gone(pid: int) -> None:
    """Until pid is dead and reaped: DVC's lock counts a zombie's pid as its holder, and orphans
    wait for init (in a container, a slower one) to reap them."""
    for _ in range(400):
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} outlived the build that started it")
