"""Bad input through the stage entry points, as DVC runs them: exit status 2, one line naming the bad
value and the fix, and no output folder left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def unknown_algorithm(tmp, built):
    params = tiny_params(built["hf"])
    params["quantize"]["int4"]["algorithm"] = "awq"
    write_params(tmp, params)
    return quantize_args(built, "int4")


def wrong_type(tmp, built):
    params = tiny_params(built["hf"])
    params["quantize"]["int4"]["block_size"] = "big"
    write_params(tmp, params)
    return quantize_args(built, "int4")


def out_of_range(tmp, built):
    params = tiny_params(built["hf"])
    params["validate"]["eval"]["max_tokens"] = -5
    write_params(tmp, params)
    return ["tasks.reference", "--model", "tiny", "--hf", str(built["hf"])]


def empty_model_folder(tmp, built):
    write_params(tmp, tiny_params(built["hf"]))
    (tmp / "empty").mkdir()
    return ["tasks.export", "--model", "tiny", "--hf", str(tmp / "empty")]


def empty_local_source(tmp, built):
    (tmp / "empty").mkdir()
    write_params(tmp, tiny_params(tmp / "empty"))
    return ["tasks.download", "--model", "tiny"]


def hub_id_offline(tmp, built):
    params = tiny_params(built["hf"])
    params["models"]["tiny"]["source"] = {
        "kind": "hub",
        "repo_id": "org/absent",
        "revision": "a" * 40,
        "path": "data/sources/pinned.txt",
    }
    write_params(tmp, params)
    (tmp / "hf-home").mkdir()
    return ["tasks.download", "--model", "tiny"], {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf-home")}


def output_under_a_file(tmp, built):
    write_params(tmp, tiny_params(built["hf"]))
    (tmp / "a-file").write_text("not a folder")
    args = ["tasks.export", "--model", "tiny", "--hf", str(built["hf"])]
    return args, {}, tmp / "a-file" / "onnx"


def output_under_read_only_folder(tmp, built):
    write_params(tmp, tiny_params(built["hf"]))
    # /proc refuses new entries even to root, which chmod cannot show.
    return ["tasks.export", "--model", "tiny", "--hf", str(built["hf"])], {}, Path("/proc/ortforge-test/onnx")


CASES = [
    (misspelled_key, "quantize.int4: unknown key `blok_size`; did you mean `block_size`?"),
    (unknown_variant, "unknown variant `int3`; params.yaml `quantize` has: fp32, int8, int4"),
    (missing_path, "no-such-folder has no config.json; run the download stage first"),
    (truncated_gguf, "cut.gguf is truncated or corrupt"),
    (unsupported_architecture, "cannot read it (The checkpoint you are trying to load has model type `mystery-net`"),
    (unknown_model, "unknown model `gpt-9`"),
    (unknown_algorithm, "quantize.int4.algorithm: Input should be 'rtn', 'imatrix', 'hqq' or 'gptq'"),
    (wrong_type, "quantize.int4.block_size: Input should be a valid integer"),
    (out_of_range, "validate.eval.max_tokens: Input should be greater than or equal to"),
    (empty_model_folder, "empty has no config.json; run the download stage first"),
    (empty_local_source, "has no config.json"),
    (hub_id_offline, "cannot fetch org/absent@aaaaaaaaaaaa: the Hub is unreachable or offline"),
    (output_under_a_file, "a-file is a file, not a folder; choose another output path"),
    (output_under_read_only_folder, "/proc is not writable; fix its permissions or choose another path"),
]


@pytest.mark.parametrize("make_case, message", CASES, ids=[case[0].__name__ for case in CASES])
def test_stage_rejects_bad_input_in_one_line(built, tmp_path, make_case, message):
    case = make_case(tmp_path, built)
    # A case gives its arguments, and optionally an environment and an output path of its own.
    args, env, out = (case, {}, None) if isinstance(case, list) else (*case, None)[:3]
    args += ["--out", str(out or tmp_path / "out" / "result")]
    before = set(tmp_path.iterdir())
    result = run_module(*args, cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert set(tmp_path.iterdir()) == before  # no output folder, no temporary left behind
