"""Every architecture family ortforge takes, through every stage, as a table: a tiny random model
of each family (tests/families.py: the family's real config class) is downloaded, exported
(`auto`), optimized, quantized to fp32, int8, int4 and w8a8 (per-token int8, held to the tiny
int4's limits) and validated against PyTorch, and its fp32 artifact's prefill and cached decode
are compared with PyTorch. The families no exporter takes (tests/families.py's REFUSED) get a row
with their one-line refusal: before any work where config.json decides it (the build's preflight,
before DVC starts), else the export stage's. A configuration that changes how a family computes
(tests/families.py's CONFIGURATIONS: LongRoPE) gets its own row, its runtime check past the limit.

    python benchmarks/architectures.py     # writes benchmarks/results/architectures.{json,md}

The same pipeline is tests/test_architectures.py's fixture; this script records what it found.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402  (the repository on the path first)
from tests import families  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
COLUMNS = (
    "family",
    "config class",
    "exporter",
    "earlier exporters refused because",
    "fp32 vs PyTorch",
    "int8 ppl",
    "int4 ppl",
    "w8a8 ppl",
    "int4 coverage",
    "int4 KB",
)


def row(family: str, root: Path, name: str | None = None, overrides: dict | None = None, prefill: int = 14) -> dict:
    """name, overrides: a named configuration of the family (tests/families.py's CONFIGURATIONS);
    prefill: the prompt tokens the runtime-vs-PyTorch check runs whole before its cached steps."""
    from tests.conftest import TINY_PARAMS

    recipes = {"w8a8": ({"method": "int8_per_token"}, TINY_PARAMS["validate"]["thresholds"]["int4"])}
    variants = ("fp32", "int8", "int4", "w8a8")
    built = families.through_every_stage(family, root, variants, recipes, **(overrides or {}))
    folders, reports = built["folders"], built["reports"]
    record = json.loads((folders["onnx"] / "export.json").read_text(encoding="utf-8"))
    int4 = reports["int4"]
    return {
        "family": name or family,
        "config_class": families.FAMILIES[family][0],
        "exporter": record["exporter"],
        "refused": record["refused"],
        "export_parity": record["parity"]["max_relative_logit_diff"],
        "runtime_vs_pytorch": families.runtime_gap(folders["fp32"], folders["hf"], prefill=prefill),
        "ppl_ratio": {variant: figures["ppl_ratio"] for variant, figures in reports.items()},
        "int4_coverage": int4["coverage"]["share_as_asked"],
        "int4_by_role": {role: sorted(rows) for role, rows in int4["coverage"]["by_role"].items()},
        "int4_kb": sum(p.stat().st_size for p in folders["int4"].glob("model.onnx*")) / 1e3,
        "passed": all(figures["coverage"]["share_as_asked"] == 1.0 for figures in reports.values()),
    }


def refused_row(family: str, root: Path) -> dict:
    """The one-line refusal of a family no exporter takes (passed: it was refused): from its
    config.json before any work where that decides it, else the export stage's."""
    from tasks import export
    from tasks.core.params import ExportConfig
    from tasks.core.stage import StageError
    from tasks.graphs import exporters
    from tests.conftest import EVAL_TEXT

    found = {"family": family, "config_class": families.REFUSED[family][0], "passed": True}
    config = families.config_for(family)
    config.architectures = [families.REFUSED[family][1]]
    before_work = exporters.refusal(config, "auto")
    if before_work:
        return found | {"refusal": before_work, "refused_at": "before work"}
    hf = families.build(family, root / "hf", EVAL_TEXT)
    try:
        export.run(ExportConfig(), "auto", hf, root / "onnx")
    except StageError as refusal:
        return found | {"refusal": str(refusal), "refused_at": "export"}
    return found | {"refusal": None, "refused_at": None, "passed": False}


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "refusal" in r:
            why = (r["refusal"] or "exported: move it to tests/families.py's FAMILIES").replace("|", "/")
            where = f"refused {'at ' if r['refused_at'] == 'export' else ''}{r['refused_at']}"
            lines.append(f"| {r['family']} | {r['config_class']} | {where} | {why} |" + " - |" * 6)
            continue
        refused = "; ".join(f"{name}: {why.split(' (')[0]}" for name, why in r["refused"].items()) or "-"
        ppl = " | ".join(f"{r['ppl_ratio'][variant]:.4f}" for variant in ("int8", "int4", "w8a8"))
        lines.append(
            f"| {r['family']} | {r['config_class']} | {r['exporter']} | {refused} | {r['runtime_vs_pytorch']:.1e} | "
            f"{ppl} | {r['int4_coverage']:.0%} | {r['int4_kb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help, and no stray flags
    rows = []
    with tempfile.TemporaryDirectory(prefix="ortforge-architectures-") as scratch:
        for family in families.FAMILIES:
            rows.append(row(family, Path(scratch) / family))
            print(f"{family}: {rows[-1]['exporter']}, runtime vs PyTorch {rows[-1]['runtime_vs_pytorch']:.1e}")
        for name, (family, overrides, prefill) in families.CONFIGURATIONS.items():
            rows.append(row(family, Path(scratch) / name.replace(" ", "_"), name, overrides, prefill))
            print(f"{name}: {rows[-1]['exporter']}, runtime vs PyTorch {rows[-1]['runtime_vs_pytorch']:.1e}")
        for family in families.REFUSED:
            rows.append(refused_row(family, Path(scratch) / family))
            print(f"{family}: {rows[-1]['refusal']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    # Tiny random models it builds itself: nothing in dvc.lock describes them, the commit does.
    found = {"provenance": provenance.record(provenance.command("architectures.py", argv)), "rows": rows}
    (RESULTS / "architectures.json").write_text(json.dumps(found, indent=2) + "\n", encoding="utf-8")
    (RESULTS / "architectures.md").write_text(markdown(rows), encoding="utf-8")
    print(markdown(rows))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
