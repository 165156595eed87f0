"""One table and one plot across a model's variants: quality, size and speed side by side.

Reads reports/<model>/variants/<variant>/{validate,bench}.json for the variants in params.yaml
`quantize`; writes reports/<model>/report.md and reports/<model>/report.png.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tasks import paths
from tasks.files import atomic_write_text, read_json
from tasks.stage import StageError, stage_cli

log = logging.getLogger(__name__)

BASELINE = "pytorch fp32 (KV cache)"
COLUMNS = (
    ("variant", "{}"),
    ("valid", "{}"),
    ("perplexity", "{:.2f}"),
    ("ppl ratio", "{:.3f}"),
    ("greedy match", "{}"),
    ("size MB", "{:.1f}"),
    ("decode tok/s", "{:.1f}"),
    ("decode ms p50 / p95", "{}"),
    ("first token ms p50", "{:.0f}"),
    ("peak RSS MB", "{:.0f}"),
    ("decode x baseline", "{:.2f}"),
)


def collect(reports_dir: Path, variants: list[str]) -> list[dict]:
    rows = []
    for variant in variants:
        folder = reports_dir / variant
        try:
            validation, bench = read_json(folder / "validate.json"), read_json(folder / "bench.json")
        except FileNotFoundError as error:
            raise StageError(f"{error.filename} is missing; run `dvc repro` to validate and bench {variant}") from None
        rows.append({"variant": variant, "validation": validation, "bench": bench})
    return rows


def table_rows(rows: list[dict]) -> list[tuple]:
    out = []
    for row in rows:
        v, b = row["validation"], row["bench"]
        out.append(
            (
                row["variant"],
                "yes" if v["passed"] else "NO",
                v["perplexity"],
                v["ppl_ratio"],
                f"{v['greedy_tokens_matched']}/{v['greedy_steps']}",
                b["size_mb"],
                b["decode_tokens_per_second"],
                f"{b['decode_ms_per_token_p50']:.1f} / {b['decode_ms_per_token_p95']:.1f}",
                b["seconds_to_first_token_p50"] * 1e3,
                b["peak_rss_mb"],
                b.get("vs_baseline", {}).get("decode_speedup", float("nan")),
            )
        )
    baseline = next((r["bench"]["baseline"] for r in rows if "baseline" in r["bench"]), None)
    if baseline:
        reference_ppl = rows[0]["validation"]["reference_perplexity"]
        out.append(
            (
                BASELINE,
                "reference",
                reference_ppl,
                1.0,
                "-",
                baseline["size_mb"],
                baseline["decode_tokens_per_second"],
                f"{baseline['decode_ms_per_token_p50']:.1f} / {baseline['decode_ms_per_token_p95']:.1f}",
                baseline["seconds_to_first_token_p50"] * 1e3,
                baseline["peak_rss_mb"],
                1.0,
            )
        )
    return out


def markdown(model: str, rows: list[dict]) -> str:
    header = "| " + " | ".join(name for name, _ in COLUMNS) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    lines = [f"# {model}", "", header, rule]
    for values in table_rows(rows):
        cells = [fmt.format(value) for (_, fmt), value in zip(COLUMNS, values, strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    workload = rows[0]["bench"]["workload"]
    lines += [
        "",
        f"Workload: {workload['prompt_tokens']}-token prompt, {workload['new_tokens']} new tokens, greedy, batch 1, "
        f"{workload['warmup']} warm-up and {workload['repeats']} timed runs x {workload['rounds']} round(s), "
        f"each engine in its own process. Perplexity over {rows[0]['validation'].get('tokens_scored', 'the')} "
        f"tokens of the fixed text.",
    ]
    return "\n".join(lines) + "\n"


def plot(model: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = table_rows(rows)
    labels = [v[0] for v in values]
    panels = (("size on disk (MB)", 5), ("decode tokens/s", 6), ("perplexity", 2))
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for axis, (title, column) in zip(axes, panels, strict=True):
        bars = axis.bar(range(len(labels)), [v[column] for v in values], color=["#3b75af"] * len(rows) + ["#999999"])
        axis.bar_label(bars, fmt="%.1f", fontsize=8)
        axis.set_title(title)
        axis.set_xticks(range(len(labels)), [label.replace(" (", "\n(") for label in labels], fontsize=8)
    figure.suptitle(f"{model}: variants against {BASELINE} (grey)")
    figure.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp, dpi=110)
    plt.close(figure)
    tmp.replace(path)


def run(model: str, variants: list[str], reports_dir: Path, md_path: Path, png_path: Path) -> str:
    rows = collect(reports_dir, variants)
    text = markdown(model, rows)
    atomic_write_text(md_path, text)
    plot(model, rows, png_path)
    log.info("wrote %s and %s", md_path, png_path)
    return text


def main(argv: list[str] | None = None) -> int:
    flags = {"reports": paths.variant_reports, "md": paths.report_md, "png": paths.report_png}

    def body(a):
        run(a.model, list(a.params.quantize), a.paths["reports"], a.paths["md"], a.paths["png"])

    return stage_cli("report", __doc__, flags, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
