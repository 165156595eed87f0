"""Every path a stage reads or writes, declared once. dvc.yaml spells the same paths with
${item.model}/${item.variant}; tests/test_contract.py checks that the two agree."""

from __future__ import annotations

import json
from pathlib import Path

PARAMS = Path("params.yaml")
ARTIFACTS = Path("artifacts")
REPORTS = Path("reports")
EVAL_DIR = Path("data/eval")  # a DVC dependency of reference and validate: every evaluation text lives here
EVAL_TEXT = EVAL_DIR / "GPL-3.txt"  # prose; also the bench prompt's source
EVAL_TEXTS = (EVAL_TEXT, EVAL_DIR / "lstrlib.c")  # prose and C code
TASK_DIR = Path("data/tasks")  # a DVC dependency of evaluate: every task set lives here
CALIBRATION_TEXT = Path("data/calibration/python-docs.txt")
PARITY_TEXT = Path("data/tokenizer/parity.txt")  # download checks a GGUF's rebuilt tokenizer on it
SOURCE_FILE = "source.json"  # provenance record inside an HF folder written by download
# dvc.yaml makes every model's source.path a dependency of download: local folders and GGUF files
# are their own path; sources pinned in params.yaml (a Hub revision, a package's sha256) name this.
PINNED_SOURCE = Path("data/sources/pinned.txt")


def hf_dir(model: str) -> Path:
    return ARTIFACTS / model / "hf"


def export_dir(model: str) -> Path:
    return ARTIFACTS / model / "onnx"


def optimized_dir(model: str) -> Path:
    return ARTIFACTS / model / "optimized"


def reference_dir(model: str) -> Path:
    return ARTIFACTS / model / "reference"


def variant_dir(model: str, variant: str) -> Path:
    return ARTIFACTS / model / "variants" / variant


def validation_stamp(model: str, variant: str) -> Path:
    from ortforge.manifest import validation_stamp as stamp_of

    return stamp_of(variant_dir(model, variant))


def runtime_config(model: str, variant: str) -> Path:
    from ortforge.manifest import runtime_config as settings_of

    return settings_of(variant_dir(model, variant))


def variant_reports(model: str) -> Path:
    return REPORTS / model / "variants"


def validate_json(model: str, variant: str) -> Path:
    return variant_reports(model) / variant / "validate.json"


def bench_json(model: str, variant: str) -> Path:
    return variant_reports(model) / variant / "bench.json"


def tasks_json(model: str, variant: str) -> Path:
    return variant_reports(model) / variant / "tasks.json"


def optimize_json(model: str) -> Path:
    return REPORTS / model / "optimize.json"


def report_md(model: str) -> Path:
    return REPORTS / model / "report.md"


def report_png(model: str) -> Path:
    return REPORTS / model / "report.png"


def report_load_png(model: str) -> Path:
    return REPORTS / model / "load.png"


def report_html(model: str) -> Path:
    return REPORTS / model / "report.html"


def report_json(model: str) -> Path:
    return REPORTS / model / "report.json"


def remote_code_allowed(hf_dir: Path) -> bool:
    """Whether the user let the model's own Python run (models.<name>.trust_remote_code), as
    download recorded it in the folder's SOURCE_FILE: every stage that loads the model gives the
    same answer, so a model download accepted is never refused by a later stage."""
    try:
        record = json.loads((Path(hf_dir) / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("trust_remote_code") is True
