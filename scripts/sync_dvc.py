"""Rewrite dvc.yaml's code deps and tool params from the stages' imports (tasks/core/imports.py), so a
new import is one command away from its cache key: `python scripts/sync_dvc.py`.
tests/test_contract.py fails until dvc.yaml agrees with the code."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ruamel.yaml import YAML  # noqa: E402  (DVC's own YAML library: keeps comments and layout)

from tasks.core import imports  # noqa: E402
from tasks.core.versions import STAGES, load_pins, stage_tools  # noqa: E402


def code_first(stage: str):
    return lambda path: (path != f"tasks/{stage}.py", path.startswith("ortforge"), path)


def main() -> int:
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 120
    yaml.indent(mapping=2, sequence=4, offset=2)
    path = REPO / "dvc.yaml"
    document = yaml.load(path)
    pins = load_pins(REPO / "versions.yaml")
    for stage in STAGES:
        body = document["stages"][stage]
        body = body.get("do", body)
        data = [dep for dep in body["deps"] if not str(dep).startswith(imports.PACKAGES)]
        body["deps"][:] = sorted(imports.stage_code(stage, REPO), key=code_first(stage)) + data
        for param in body["params"]:
            if isinstance(param, dict) and "versions.yaml" in param:
                param["versions.yaml"][:] = list(stage_tools(stage, pins))
    yaml.dump(document, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
