"""The `ortforge` command: instant help, one-line errors with the fix, and the commands over a
built repository (status, report, generate, doctor)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ortforge import cli
from tests.conftest import REPO

HEAVY = ("torch", "onnxruntime", "transformers", "prefect", "dvc", "numpy", "matplotlib")


def test_help_imports_nothing_heavy():
    probe = "import sys, ortforge.cli as c; c.parser().format_help(); print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert [name for name in loaded if name.split(".")[0] in HEAVY] == []


def commands(parser) -> dict:
    (subparsers,) = [action for action in parser._actions if action.dest == "command"]
    return subparsers.choices


def test_every_command_is_registered_with_a_handler():
    registered = commands(cli.parser())
    assert set(registered) == {"build", "status", "bench", "report", "generate", "serve", "doctor"}
    for name, sub in registered.items():
        assert callable(sub.get_default("handler")), name


def test_the_runtime_alone_has_generate_and_serve_only(monkeypatch):
    monkeypatch.setattr(cli, "_plugins", lambda group: [])
    assert set(commands(cli.parser())) == {"generate", "serve"}


def test_a_folder_without_a_model_needs_the_build_side_to_name_a_model(monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "_plugins", lambda group: [])
    with pytest.raises(cli.CliError, match=f"{tmp_path} is not an artifact folder \\(no model.onnx\\)"):
        cli.artifact_folder(tmp_path, str(tmp_path), None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "gpt-9", "hi"], "unknown model `gpt-9`"),
        (["report", "--model", "smollm2-135m"], None),  # present in this repository: no error
        (["--root", "/nonexistent", "status"], "/nonexistent has no params.yaml; run ortforge in the repository root"),
    ],
)
def test_errors_are_one_line_with_exit_status_2(argv, message, capsys):
    status = cli.main(["--root", str(REPO), *argv] if argv[0] != "--root" else argv)
    err = capsys.readouterr().err
    if message is None:
        assert status == 0
        return
    assert status == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_generate_refuses_a_variant_without_a_validation_stamp(built, tmp_path, capsys):
    import shutil

    from tests.conftest import tiny_params, write_params

    write_params(tmp_path, tiny_params(built["hf"]))
    shutil.copytree(built["int8"], tmp_path / "artifacts" / "tiny" / "variants" / "int8")
    status = cli.main(["--root", str(tmp_path), "generate", "tiny", "hello", "--variant", "int8"])
    assert status == 2
    assert "has no validation stamp int8.valid.json" in capsys.readouterr().err
    folder = str(tmp_path / "artifacts" / "tiny" / "variants" / "int8")
    assert cli.main(["generate", folder, "hello"]) == 2  # a folder is checked the same way
    assert "has no validation stamp int8.valid.json" in capsys.readouterr().err
    assert cli.main(["generate", folder, "hello", "--variant", "int8"]) == 2
    assert f"{folder} is an artifact folder already; drop --variant int8" in capsys.readouterr().err


def test_doctor_reports_versions_cpu_threads_and_disk(capsys):
    assert cli.main(["--root", str(REPO), "doctor"]) == 0
    out = capsys.readouterr().out
    for fact in ("python:", "avx2", "threads:", "memory:", "disk:", "onnxruntime", "attention kernel"):
        assert fact in out


def test_doctor_says_when_the_attention_kernel_cannot_be_built(monkeypatch):
    from flows import doctor

    monkeypatch.setenv("CC", "no-such-compiler")
    assert doctor.kernel_line().startswith("attention kernel (attention: ortforge): unavailable: ")


def test_generate_with_prompt_lookup_prints_the_same_text(built, params, tmp_path, capsys):
    from ortforge.generate import TextGenerator
    from tests.test_text_encoding import validated_project

    root = validated_project(built, params, tmp_path)
    prompt = "the GNU General Public License is free; the GNU General Public License is"
    args = ["--root", str(root), "generate", "tiny", prompt, "--variant", "int4", "--max-new-tokens", "20"]
    assert cli.main(args + ["--prompt-lookup", "3"]) == 0
    expected = "".join(TextGenerator(root / "artifacts" / "tiny" / "variants" / "int4").stream(prompt, 20))
    assert capsys.readouterr().out == expected + "\n"
    assert cli.main(args + ["--prompt-lookup", "-1"]) == 2
    assert "prompt_lookup -1 must be >= 0" in capsys.readouterr().err
