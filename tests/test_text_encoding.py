"""Text in and out is UTF-8 whatever the locale: the code names its encodings, and the command line
streams Korean, Japanese and emoji under LANG=C with Python's UTF-8 fallbacks turned off."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

from tests.conftest import REPO, tiny_params, write_params

SOURCE_FOLDERS = ("tasks", "ortforge", "flows", "benchmarks", "scripts")
TEXT_CALLS = {"read_text", "write_text", "open"}
PROMPT = "안녕하세요 日本語 🙂 café"


def calls_without_encoding(path) -> list[str]:
    """Text-mode open()/read_text()/write_text() calls in the module that do not name an encoding."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name not in TEXT_CALLS:
            continue
        keywords = {keyword.arg for keyword in node.keywords}
        mode = next((arg.value for arg in node.args[1:2] if isinstance(arg, ast.Constant)), "r")
        binary = "b" in str(mode) or "b" in str(next((k.value.value for k in node.keywords if k.arg == "mode"), ""))
        if not binary and "encoding" not in keywords and not (name == "open" and isinstance(node.func, ast.Attribute)):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}()")
    return found


def test_every_text_file_access_names_its_encoding():
    modules = [p for folder in SOURCE_FOLDERS for p in (REPO / folder).rglob("*.py")]
    assert modules
    assert [call for path in modules for call in calls_without_encoding(path)] == []


def c_locale_env() -> dict[str, str]:
    """A C locale in which Python keeps ASCII: no locale coercion (PEP 538), no UTF-8 mode (PEP 540)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIOENCODING", "PYTHONUTF8"))}
    return env | {"LANG": "C", "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}


def validated_project(built, params, folder):
    """A repository root holding the tiny int4 variant, validated, as `ortforge generate` expects."""
    from tasks import validate
    from tasks.core.params import Thresholds

    write_params(folder, tiny_params(built["hf"]))
    variant = folder / "artifacts" / "tiny" / "variants" / "int4"
    shutil.copytree(built["int4"], variant)
    loose = Thresholds(ppl_ratio=1e9, kl_divergence=1e9, top1_agreement=0.0, greedy_agreement=0.0, kv_max_prob_diff=1.0)
    asked = validate.Asked(params.variant("int4"), loose)
    validate.run(params.validation.eval, asked, variant, built["reference"], folder / "validate.json", "int4")
    return folder


def test_generate_streams_multibyte_text_under_the_c_locale(built, params, tmp_path):
    from ortforge.generate import TextGenerator

    root = validated_project(built, params, tmp_path)
    probe = [sys.executable, "-c", "import sys; print(sys.stdout.encoding)"]
    assert subprocess.run(probe, env=c_locale_env(), capture_output=True, text=True).stdout.strip() == "ascii"

    command = [sys.executable, "-m", "ortforge.cli", "--root", str(root), "generate", "tiny", PROMPT]
    result = subprocess.run(
        command + ["--variant", "int4", "--max-new-tokens", "16"], env=c_locale_env(), capture_output=True
    )
    assert result.returncode == 0, result.stderr.decode("utf-8", "replace")[-2000:]
    streamed = result.stdout.decode("utf-8")  # strict: a broken character would raise here
    expected = "".join(TextGenerator(root / "artifacts" / "tiny" / "variants" / "int4").stream(PROMPT, 16))
    assert streamed == expected + "\n"  # the prompt reached the model intact, as UTF-8
