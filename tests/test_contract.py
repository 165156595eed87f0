"""dvc.yaml, tasks/ and flows/ agree: the same stages, the same paths as tasks/core/paths.py, and every
helper a stage's code imports is a DVC dependency of that stage (so editing it reruns the stage)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tasks.core import imports, paths
from tasks.core.versions import STAGES
from tests.conftest import REPO


def expected_paths(stage: str, model: str, variant: str | None) -> tuple[set[Path], set[Path]]:
    """(inputs, outputs) of a stage according to tasks/core/paths.py."""
    hf, onnx, opt, ref = (
        paths.hf_dir(model),
        paths.export_dir(model),
        paths.optimized_dir(model),
        paths.reference_dir(model),
    )
    if variant:
        var, val = paths.variant_dir(model, variant), paths.validate_json(model, variant)
        stamp = paths.validation_stamp(model, variant)
    table = {
        "download": (set(), {hf}),
        "export": ({hf}, {onnx}),
        "optimize": ({onnx, hf}, {opt, paths.optimize_json(model)}),
        "reference": ({hf}, {ref}),
        "quantize": ({opt, hf}, {var} if variant else set()),
        "validate": ({var, ref} if variant else set(), {val, stamp} if variant else set()),
        "bench": (
            {var, stamp, hf} if variant else set(),
            {paths.bench_json(model, variant), paths.runtime_config(model, variant)} if variant else set(),
        ),
        "evaluate": (
            {var, stamp, paths.runtime_config(model, variant)} if variant else set(),
            {paths.tasks_json(model, variant)} if variant else set(),
        ),
        "report": (
            {paths.variant_reports(model)},
            {
                paths.report_md(model),
                paths.report_png(model),
                paths.report_load_png(model),
                paths.report_html(model),
                paths.report_json(model),
            },
        ),
    }
    return table[stage]


@pytest.fixture(scope="module")
def dvc_stages():
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        return list(repo.index.stages)


def split_address(stage) -> tuple[str, str, str | None]:
    """(stage, model, variant) of a matrix stage name such as quantize@smollm2-135m-int4."""
    from tasks.core.params import load_params

    name, _, item = stage.addressing.partition("@")
    if name in ("quantize", "validate", "bench", "evaluate"):
        for model in load_params(REPO / "params.yaml").models:
            if item.startswith(model + "-"):
                return name, model, item[len(model) + 1 :]
    return name, item, None


def test_dvc_runs_each_stage_module(dvc_stages):
    assert {split_address(s)[0] for s in dvc_stages} == set(STAGES)
    for stage in dvc_stages:
        name = split_address(stage)[0]
        assert stage.cmd.startswith(f"python -m tasks.{name} "), stage.addressing
        module = importlib.import_module(f"tasks.{name}")
        assert callable(module.run) and callable(module.main)


def test_dvc_paths_match_paths_module(dvc_stages):
    for stage in dvc_stages:
        name, model, variant = split_address(stage)
        inputs, outputs = expected_paths(name, model, variant)
        declared_outs = {Path(str(out.def_path)) for out in stage.outs}
        declared_deps = {Path(str(dep.def_path)) for dep in stage.deps}
        assert declared_outs == outputs, stage.addressing
        assert inputs <= declared_deps, stage.addressing
        for path in inputs | outputs:  # every path reaches the command explicitly, or is derived
            # the stamp and the tuned settings sit beside the variant folder
            derived = path.name.endswith((".valid.json", ".runtime.json"))
            assert derived or f" {path.as_posix()}" in stage.cmd, (stage.addressing, path)


def code_deps(stage) -> set[str]:
    return {str(dep.def_path) for dep in stage.deps if str(dep.def_path).startswith(imports.PACKAGES)}


def test_dvc_code_deps_are_exactly_what_each_stage_imports(dvc_stages):
    """Every repository module a stage's code imports is a dependency (editing it reruns the stage),
    and nothing else is: no folder, no module the stage never reaches (editing the CLI reruns nothing)."""
    for stage in dvc_stages:
        name = split_address(stage)[0]
        assert code_deps(stage) == imports.stage_code(name), stage.addressing


def test_dvc_params_pin_exactly_the_tools_each_stage_reaches(dvc_stages):
    from tasks.core.versions import load_pins, stage_tools

    pins = load_pins(REPO / "versions.yaml")
    for stage in dvc_stages:
        name = split_address(stage)[0]
        tracked = [dep for dep in stage.deps if str(dep.def_path) == "versions.yaml"]
        assert len(tracked) == 1, stage.addressing
        assert sorted(tracked[0].params) == sorted(stage_tools(name, pins)), stage.addressing


def test_tools_are_read_from_the_code(tmp_path):
    """A stage that starts importing a pinned tool gains it, with what the tool requires."""
    import shutil

    shutil.copytree(REPO / "tasks", tmp_path / "tasks")
    shutil.copytree(REPO / "ortforge", tmp_path / "ortforge")
    pins = {"matplotlib", "markdown", "numpy", "onnxruntime-genai", "onnxruntime"}
    before = imports.tools("report", pins, tmp_path)
    report = tmp_path / "tasks" / "report.py"
    report.write_text(report.read_text() + "\n\ndef _uses():\n    import onnxruntime_genai\n")
    after = imports.tools("report", pins, tmp_path)
    assert set(after) - set(before) >= {"onnxruntime-genai"}


def test_package_files_hold_nothing_but_a_docstring():
    """The one exemption from a stage's code deps (imports.is_package_file) shapes nothing."""
    import ast

    for path in sorted((REPO / "tasks").rglob("__init__.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        assert all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body), path


def test_core_modules_are_in_every_stage_key(dvc_stages):
    """tasks/core/ writes every JSON (files.py), the manifest's versions and the params' defaults:
    an edit there reruns the stages."""
    for stage in dvc_stages:
        assert {"tasks/core/files.py", "tasks/core/params.py", "tasks/core/stage.py"} <= code_deps(stage)


@pytest.mark.parametrize("distribution", sorted(imports.UNDECLARED))
def test_undeclared_tool_imports_are_still_there(distribution):
    """Each tool imports.UNDECLARED adds is imported by the distribution's installed code."""
    import importlib.metadata
    import re

    for tool in imports.UNDECLARED[distribution]:
        module = next(m for m, dists in imports._providers().items() if imports.normalized(tool) in dists)
        pattern = re.compile(rf"^\s*(import|from)\s+{module}\b", re.MULTILINE)
        files = [f for f in importlib.metadata.files(distribution) or [] if f.suffix == ".py"]
        assert any(pattern.search(Path(f.locate()).read_text(encoding="utf-8", errors="replace")) for f in files)


def test_onnx_ir_is_in_the_key_of_every_stage_that_reaches_onnxruntime(dvc_stages):
    from tasks.core.versions import load_pins, stage_tools

    pins = load_pins(REPO / "versions.yaml")
    for stage in {split_address(s)[0] for s in dvc_stages}:
        tools = stage_tools(stage, pins)
        assert ("onnxruntime" in tools) <= ("onnx-ir" in tools), stage


def test_flow_targets_name_real_stages(dvc_stages):
    source = (REPO / "flows" / "build.py").read_text(encoding="utf-8")
    for target in ("download", "report"):
        assert f'f"{target}@{{' in source
        assert target in {split_address(s)[0] for s in dvc_stages}


def test_measured_outputs_live_in_git_not_the_cache(dvc_stages):
    """bench's tuned settings are a measurement: a rebuild cannot reproduce the committed file, so a
    CI cache filled by another build would never hold it and bench would rerun on every restore.
    evaluate's answers likewise (another CPU's kernels may break a near-tie another way). Kept out
    of the cache and in git, they come with the checkout."""
    import subprocess

    measured = {"bench": ".runtime.json", "evaluate": "tasks.json"}
    for stage in dvc_stages:
        name = split_address(stage)[0]
        if name not in measured:
            continue
        (out,) = [out for out in stage.outs if out.def_path.endswith(measured[name])]
        assert not out.use_cache and out.persist, stage.addressing
        ignored = subprocess.run(["git", "check-ignore", "-q", out.def_path], cwd=REPO)
        assert ignored.returncode == 1, f"{out.def_path} is git-ignored; it must be committed"
