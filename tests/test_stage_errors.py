"""Bad input through the stage entry points, as DVC runs them: exit status 2, one line naming the bad
value and the fix, and no output folder left behind."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_module, tiny_params, write_params


def quantize_args(built, variant):
    return ["tasks.quantize", "--model", "tiny", "--variant", variant, "--optimized", str(built["optimized"])]


def misspelled_key(tmp, built):
    params = tiny_params(built["hf"])
    params["quantize"]["int4"]["blok_size"] = params["quantize"]["int4"].pop("block_size")
    write_params(tmp, params)
    return quantize_args(built, "int4")


def unknown_variant(tmp, built):
    write_params(tmp, tiny_params(built["hf"]))
    return quantize_args(built, "int3")


def missing_path(tmp, built):
    write_params(tmp, tiny_params(built["hf"]))
    return ["tasks.export", "--model", "tiny", "--hf", str(tmp / "no-such-folder")]


def truncated_gguf(tmp, built):
    from tests.tiny_models import write_gguf

    full = write_gguf(built["hf"], tmp / "full.gguf")
    (tmp / "cut.gguf").write_bytes(full.read_bytes()[:4096])
    params = tiny_params(built["hf"])
    params["models"]["tiny"]["source"] = {"kind": "gguf", "path": str(tmp / "cut.gguf")}
    write_params(tmp, params)
    return ["tasks.download", "--model", "tiny"]


def unsupported_architecture(tmp, built):
    hf = tmp / "odd-hf"
    shutil.copytree(built["hf"], hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"model_type": "mystery-net"}))
    write_params(tmp, tiny_params(hf))
    return ["tasks.export", "--model", "tiny", "--hf", str(hf)]


def unknown_model(tmp, built):
    write_params(tmp, tiny_params(built["hf"]))
    return ["tasks.reference", "--model", "gpt-9", "--hf", str(built["hf"])]


CASES = [
    (misspelled_key, "quantize.int4: unknown key `blok_size`; did you mean `block_size`?"),
    (unknown_variant, "unknown variant `int3`; params.yaml `quantize` has: fp32, int8, int4"),
    (missing_path, "no-such-folder has no config.json; run the download stage first"),
    (truncated_gguf, "cut.gguf is truncated or corrupt"),
    (unsupported_architecture, "model_type `mystery-net`"),
    (unknown_model, "unknown model `gpt-9`"),
]


@pytest.mark.parametrize("make_case, message", CASES, ids=[case[0].__name__ for case in CASES])
def test_stage_rejects_bad_input_in_one_line(built, tmp_path, make_case, message):
    args = make_case(tmp_path, built) + ["--out", str(tmp_path / "out" / "result")]
    before = set(tmp_path.iterdir())
    result = run_module(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert set(tmp_path.iterdir()) == before  # no output folder, no temporary left behind
