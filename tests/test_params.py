"""params.yaml: the project's own file is complete and valid, and bad input names the bad key."""

from __future__ import annotations

import copy

import pytest
import yaml
from pydantic import BaseModel

from tasks.core.params import Params, load_params
from tasks.core.stage import StageError
from tests.conftest import REPO, TINY_PARAMS, write_params


def unset_keys(model: BaseModel, prefix: str = "") -> list[str]:
    """Keys left to their defaults anywhere in a validated params tree (optional keys, whose
    default None means "not asked for", aside)."""
    fields = type(model).model_fields
    missing = [
        prefix + name for name in fields if name not in model.model_fields_set and fields[name].default is not None
    ]
    for name in model.model_fields_set:
        value = getattr(model, name)
        children = value.items() if isinstance(value, dict) else [(None, value)]
        for key, child in children:
            if isinstance(child, BaseModel):
                where = f"{prefix}{name}." + (f"{key}." if key is not None else "")
                missing += unset_keys(child, where)
    return missing


def test_load_params_accepts_the_repository_file():
    params = load_params(REPO / "params.yaml")
    assert {"fp32", "int8", "int4"} <= set(params.quantize)
    assert set(params.quantize) == set(params.validation.thresholds)


def test_repository_params_set_every_key_explicitly():
    # DVC tracks params.yaml values, not code defaults: a key left to its default could change
    # without any stage rerunning. Every section but quantize sets every key; a variant recipe names
    # only what differs from its method's defaults, which live in the quantize stage's own code.
    from tasks.core import imports

    params = load_params(REPO / "params.yaml")
    assert [key for key in unset_keys(params) if not key.startswith("quantize.")] == []
    assert "tasks/quantization/configs.py" in imports.stage_code("quantize")


BAD_PARAMS = [
    (
        lambda p: p["quantize"]["int4"].update(blok_size=32),
        "quantize.int4: unknown key `blok_size`; did you mean `block_size`?",
    ),
    (lambda p: p.update(quantise={}), "unknown key `quantise`; did you mean `quantize`?"),
    (
        lambda p: p["quantize"].update(int2={"method": "int2"}),
        "quantize.int2: Input tag 'int2' found using 'method' does not match any of the expected tags",
    ),
    (lambda p: p["quantize"]["int4"].update(block_size=48), "block_size 48 is not a power of two"),
    (lambda p: p["quantize"]["fp32"].update(bits=4), "quantize.fp32: `bits` does not apply to method fp32"),
    (lambda p: p["quantize"]["int4"].update(bits=3), "quantize.int4.bits: Input should be 4 or 8"),
    (lambda p: p["quantize"]["int4"].update(algorithm="hqq", zero_point="integer"), "hqq solves for float zero points"),
    (lambda p: p["quantize"]["int4"].update(algorithm="gptq"), "gptq works on an integer grid"),
    (lambda p: p["quantize"]["int8"].update(eight_bit_blocks=[0]), "eight_bit_blocks mixes 8-bit blocks"),
    (lambda p: p["calibration"].update(samples=0), "calibration.samples: Input should be greater than or equal to 1"),
    (lambda p: p["report"].update(recommend_by="vibes"), "report.recommend_by: Input should be"),
    (lambda p: p["bench"].update(repeats=0), "bench.repeats: Input should be greater than or equal to 1"),
    (lambda p: p["bench"].update(repeats="many"), "bench.repeats: Input should be a valid integer"),
    (lambda p: p["validate"]["thresholds"].pop("int4"), "validate.thresholds has no entry for variant(s) ['int4']"),
    (lambda p: p["models"]["tiny"]["source"].update(kind="ftp"), "does not match any of the expected tags"),
    (
        lambda p: p["models"]["tiny"]["source"].update(pth="x"),
        "models.tiny.source: unknown key `pth`; did you mean `path`?",
    ),
    (
        lambda p: p["models"].update(hubby={"source": {"kind": "hub", "repo_id": "org/name", "revision": "main"}}),
        "models.hubby.source.revision: String should match pattern",
    ),
    (
        lambda p: p["models"].update({"Bad Name": p["models"]["tiny"]}),
        "models.Bad Name.[key]: name `Bad Name` may hold only lowercase letters, digits, `_` and single `-`",
    ),
    (lambda p: p.update(quantize=None), "`quantize` is empty; add a variant recipe under it"),
    (lambda p: p.update(quantize={}), "`quantize` is empty; add a variant recipe under it"),
    (lambda p: p.update(models={}), "`models` is empty; add a model under it"),
    (lambda p: p.update(builds=None), "`builds` is empty; add `<model>-<variant>"),
    (
        lambda p: p["quantize"].update({"int 4": p["quantize"]["int4"]}),
        "quantize.int 4.[key]: name `int 4` may hold only lowercase letters",
    ),
    (
        lambda p: p["quantize"].update({"int4/fast": p["quantize"]["int4"]}),
        "quantize.int4/fast.[key]: name `int4/fast` may hold only lowercase letters",
    ),
    (
        lambda p: p["models"].update({"qwen2.5": p["models"]["tiny"]}),
        "models.qwen2.5.[key]: name `qwen2.5` may hold only",
    ),
    (
        lambda p: p["quantize"]["int4"].update(block_size="32"),
        "quantize.int4.block_size: Input should be a valid integer",
    ),
    (lambda p: p["bench"].update(tune="yes"), "bench.tune: Input should be a valid boolean"),
    (lambda p: p["report"].update(max_ppl_ratio="1.07"), "report.max_ppl_ratio: Input should be a valid number"),
    (
        lambda p: p["builds"].update({"tiny-int9": {"model": "tiny", "variant": "int9"}}),
        "builds.tiny-int9: variant `int9` is not in `quantize` (fp32, int8, int4)",
    ),
    (
        lambda p: p["builds"].update({"tiny-x": {"model": "tiny", "variant": "int4"}}),
        "builds.tiny-x: the key must be `tiny-int4` (model-variant)",
    ),
    (
        lambda p: p["tasks"]["sets"]["chat_qa"].update(file="/tmp/qa.jsonl"),
        "tasks.sets.chat_qa: file /tmp/qa.jsonl is not under data/tasks/, the folder dvc.yaml tracks for evaluate",
    ),
    (
        lambda p: p["tasks"]["sets"]["chat_qa"].update(kind="trivia"),
        "tasks.sets.chat_qa.kind: Input should be 'qa', 'choice' or 'instruct'",
    ),
    (lambda p: p["tasks"].update(reference="fp64"), "tasks.reference `fp64` is not in `quantize`"),
    (lambda p: p["tasks"].update(limit=0), "tasks.limit: Input should be greater than or equal to 1"),
    (
        lambda p: p["report"].update(require_task_gate="yes"),
        "report.require_task_gate: Input should be a valid boolean",
    ),
]


def test_duplicate_yaml_key_names_the_key_and_both_lines(tmp_path):
    path = write_params(tmp_path, TINY_PARAMS)
    text = path.read_text().replace("quantize:\n", "quantize:\n  fp32:\n    method: fp32\n", 1)
    path.write_text(text)
    line = text.splitlines().index("  fp32:", text.splitlines().index("quantize:")) + 1
    with pytest.raises(StageError, match=rf"key `fp32` appears twice, at lines {line} and \d+; keep one"):
        load_params(path)


@pytest.mark.parametrize("mutate, message", BAD_PARAMS)
def test_load_params_names_the_bad_key(tmp_path, mutate, message):
    params = copy.deepcopy(TINY_PARAMS)
    mutate(params)
    with pytest.raises(StageError) as error:
        load_params(write_params(tmp_path, params))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_load_params_reports_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(StageError, match="not found; run from the repository root"):
        load_params(tmp_path / "nope.yaml")
    (tmp_path / "params.yaml").write_text("models: [unclosed\n", encoding="utf-8")
    with pytest.raises(StageError, match="is not valid YAML"):
        load_params(tmp_path / "params.yaml")


def test_params_lookup_names_known_choices():
    params = Params.model_validate(yaml.safe_load((REPO / "params.yaml").read_text()))
    with pytest.raises(StageError, match="unknown variant `int3`; params.yaml `quantize` has: fp32, fp16, int8, "):
        params.variant("int3")
    with pytest.raises(StageError, match="unknown model `gpt5`"):
        params.model("gpt5")
