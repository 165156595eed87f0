"""One table and one plot across a model's variants: quality against size and decode speed, the
Pareto front, and the variant a rule in params.yaml recommends.

Reads reports/<model>/variants/<variant>/{validate,bench,tasks}.json for the variants in params.yaml
`quantize` and params.yaml `report` and `tasks`; writes reports/<model>/report.md, report.png and report.json
(the recommendation, the front and every validation gate, for scripts) and report.html (tables and
plots in one offline page). Every gate of every variant is shown with its limit and margin, failed
variants included (tasks/reporting/gates.py); only passing variants reach the results table. The
task A/B sets each passing variant's answers beside the reference's, with the task gate
(tasks/reporting/task_ab.py); with `report.require_task_gate` only a variant that passes it is
recommended.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.core import paths
from tasks.core.files import atomic_write_json, atomic_write_text, read_json
from tasks.core.params import ReportConfig, TasksConfig
from tasks.core.stage import StageError, stage_cli
from tasks.reporting import gates, html, load, task_ab

log = logging.getLogger(__name__)

BASELINE = "pytorch fp32 (KV cache)"


@dataclass(frozen=True)
class Row:
    variant: str
    perplexity: float
    ppl_ratio: float  # the worst over the evaluation texts, as are the next two
    kl_divergence: float
    top1_agreement: float
    greedy: str
    size_mb: float
    decode_tokens_per_second: float
    decode_ms_per_token_p50: float
    decode_ms_per_token_p95: float
    seconds_to_first_token_p50: float
    peak_rss_mb: float
    decode_speedup: float
    kv_bytes_per_token: float  # what a token of context costs in the KV cache


def _row(variant: str, validation: dict, bench: dict, speedup: float) -> Row:
    return Row(
        variant=variant,
        perplexity=validation["perplexity"],
        ppl_ratio=validation["ppl_ratio"],
        kl_divergence=validation["kl_divergence"],
        top1_agreement=validation["top1_agreement"],
        greedy=f"{validation['greedy_tokens_matched']}/{validation['greedy_steps']}",
        size_mb=bench["size_mb"],
        decode_tokens_per_second=bench["decode_tokens_per_second"],
        decode_ms_per_token_p50=bench["decode_ms_per_token_p50"],
        decode_ms_per_token_p95=bench["decode_ms_per_token_p95"],
        seconds_to_first_token_p50=bench["seconds_to_first_token_p50"],
        peak_rss_mb=bench["peak_rss_mb"],
        decode_speedup=speedup,
        kv_bytes_per_token=bench.get("kv_bytes_per_token", float("nan")),
    )


def read_validation(folder: Path, variant: str) -> dict:
    validation = read_json(folder / "validate.json")
    if "role" not in validation:
        raise StageError(
            f"{folder / 'validate.json'} predates the gate records the report shows; run `dvc repro` to validate "
            f"{variant} again"
        )
    return validation


@dataclass(frozen=True)
class Collected:
    """What the report reads, each file once: the passing variants' rows and bench figures, the
    PyTorch baseline's row, the workload, every variant's validation, and the failed variants."""

    rows: list[Row]
    baseline: Row | None
    workload: dict
    failed: list[str]
    validations: dict[str, dict]  # every variant's, failed ones included (their gates are shown)
    benches: dict[str, dict]  # each passing variant's bench.json


def collect(reports_dir: Path, variants: list[str]) -> Collected:
    """Every variant's validation, and the bench of each that passed (a failed variant is never
    published, never reported); the baseline's row comes from the first bench that has one."""
    rows, baseline, workload, failed, validations, benches = [], None, {}, [], {}, {}
    for variant in variants:
        folder = reports_dir / variant
        try:
            validation = validations[variant] = read_validation(folder, variant)
            if not validation["passed"]:
                failed.append(variant)
                continue
            bench = benches[variant] = read_json(folder / "bench.json")
        except FileNotFoundError as error:
            raise StageError(f"{error.filename} is missing; run `dvc repro` to validate and bench {variant}") from None
        rows.append(_row(variant, validation, bench, bench.get("vs_baseline", {}).get("decode_speedup", float("nan"))))
        workload = workload or {**bench["workload"], "tokens_scored": validation.get("tokens_scored")}
        if baseline is None and "baseline" in bench:
            reference = {
                **validation,
                "perplexity": validation["reference_perplexity"],
                "ppl_ratio": 1.0,
                "kl_divergence": 0.0,
                "top1_agreement": 1.0,
            }
            baseline = _row(
                BASELINE, {**reference, "greedy_tokens_matched": "-", "greedy_steps": "-"}, bench["baseline"], 1.0
            )
    if not rows:
        raise StageError(
            f"no variant of {reports_dir.parent.name} passed validation ({', '.join(failed)}); nothing to report"
        )
    return Collected(rows, baseline, workload, failed, validations, benches)


def bench_machines(benches: dict[str, dict]) -> dict[str, list[str]]:
    """Each machine the variants' bench figures were measured on (its CPU and the features that
    pick onnxruntime's kernels), with the variants measured there. A bench reruns only when its
    artifact changes, so after a change rebuilt on another machine one table can hold two."""
    found: dict[str, list[str]] = {}
    for variant, bench in benches.items():
        measured = bench.get("machine", {})
        name = f"{measured.get('cpu', 'an unrecorded CPU')} ({'+'.join(measured.get('features', [])) or '-'})"
        found.setdefault(name, []).append(variant)
    return found


def machines_note(machines: dict[str, list[str]], model: str) -> list[str]:
    """A warning when the speeds of one table come from more than one machine: the Pareto front and
    the recommendation then compare figures no one run measured."""
    if len(machines) < 2:
        return []
    each = "; ".join(f"{', '.join(variants)} on {name}" for name, variants in machines.items())
    return [
        f"Speeds in this table come from {len(machines)} machines ({each}): compare them within one machine "
        f"only, or measure every variant here with "
        f"`dvc repro --force --single-item --glob 'bench@{model}-*'` (--single-item: not their upstream stages)."
    ]


def dominates(a: Row, b: Row) -> bool:
    """a is no worse than b in perplexity, size and decode speed, and better in at least one."""
    no_worse = (
        a.ppl_ratio <= b.ppl_ratio
        and a.size_mb <= b.size_mb
        and a.decode_tokens_per_second >= b.decode_tokens_per_second
    )
    better = (
        a.ppl_ratio < b.ppl_ratio or a.size_mb < b.size_mb or a.decode_tokens_per_second > b.decode_tokens_per_second
    )
    return no_worse and better


def pareto_front(rows: list[Row]) -> list[str]:
    return [row.variant for row in rows if not any(dominates(other, row) for other in rows)]


def recommend(rows: list[Row], cfg: ReportConfig, passed_tasks: set[str]) -> Row | None:
    """The best variant by cfg.recommend_by among those within cfg.max_ppl_ratio and, with
    cfg.require_task_gate, among passed_tasks (the variants that pass the task gate)."""
    eligible = [row for row in rows if row.ppl_ratio <= cfg.max_ppl_ratio]
    if cfg.require_task_gate:
        eligible = [row for row in eligible if row.variant in passed_tasks]
    if not eligible:
        return None
    higher_is_better = cfg.recommend_by == "decode_tokens_per_second"
    pick = max if higher_is_better else min
    return pick(eligible, key=lambda row: getattr(row, cfg.recommend_by))


def _count(value: float) -> str:
    return f"{value:,.0f}" if value == value else "-"  # NaN: not measured (the PyTorch baseline)


def markdown(
    model: str,
    rows: list[Row],
    baseline: Row | None,
    front: list[str],
    best: Row | None,
    cfg,
    workload,
    failed,
    machines: dict[str, list[str]],
) -> str:
    header = (
        "| variant | Pareto | perplexity | ppl ratio | KL | top-1 | greedy match | size MB | decode tok/s | "
        "decode ms p50 / p95 | first token ms p50 | peak RSS MB | decode x baseline | KV bytes/token |"
    )
    lines = [f"# {model}", ""]
    rule = f"perplexity x{cfg.max_ppl_ratio}" + (" and passing the task gate" if cfg.require_task_gate else "")
    if best is not None:
        lines += [f"**Recommended: {best.variant}**: best {cfg.recommend_by} within {rule}.", ""]
    else:
        lines += [f"No variant is within {rule}; none is recommended.", ""]
    if warning := machines_note(machines, model):
        lines += [*warning, ""]
    lines += [header, "|" + "---|" * 14]
    for row in rows + ([baseline] if baseline else []):
        mark = "yes" if row.variant in front else ("-" if row is baseline else "")
        lines.append(
            f"| {row.variant} | {mark} | {row.perplexity:.2f} | {row.ppl_ratio:.3f} | {row.kl_divergence:.4f} | "
            f"{row.top1_agreement:.3f} | {row.greedy} | "
            f"{row.size_mb:.1f} | {row.decode_tokens_per_second:.1f} | {row.decode_ms_per_token_p50:.1f} / "
            f"{row.decode_ms_per_token_p95:.1f} | {row.seconds_to_first_token_p50 * 1e3:.0f} | "
            f"{row.peak_rss_mb:.0f} | {row.decode_speedup:.2f} | {_count(row.kv_bytes_per_token)} |"
        )
    lines += [
        "",
        f"Workload: {workload.get('prompt_tokens')}-token prompt, {workload.get('new_tokens')} new tokens, greedy, "
        f"batch 1, {workload.get('warmup')} warm-up and {workload.get('repeats')} timed runs x "
        f"{workload.get('rounds')} round(s), each engine in its own process. Perplexity over "
        f"{workload.get('tokens_scored')} tokens of the first evaluation text; ppl ratio, KL (mean KL divergence "
        f"from the reference, nats per token) and top-1 (share of positions whose most likely token is the "
        f"reference's) are the worst over every evaluation text; greedy match counts greedy tokens equal to "
        f"PyTorch's before the first difference. Pareto: no other variant is at least as good in perplexity, "
        f"size and decode speed and better in one.",
    ]
    if failed:
        lines += [
            "",
            f"Not shown: {', '.join(failed)} failed validation (reports/{model}/variants/<variant>/validate.json).",
        ]
    return "\n".join(lines) + "\n"


def plot(model: str, rows: list[Row], baseline: Row | None, front: list[str], best: Row | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for axis, attribute, label, larger_is_better in (
        (axes[0], "size_mb", "size on disk (MB, log scale)", False),
        (axes[1], "decode_tokens_per_second", "decode tokens/s", True),
    ):
        for row in rows:
            on_front = row.variant in front
            axis.scatter(getattr(row, attribute), row.ppl_ratio, s=60, color="#3b75af" if on_front else "#bbbbbb")
            axis.annotate(
                row.variant,
                (getattr(row, attribute), row.ppl_ratio),
                fontsize=8,
                xytext=(4, 3),
                textcoords="offset points",
            )
        # The line is this panel's own two-measure front; the blue dots are the three-measure front.
        trade = sorted(rows, key=lambda r: -getattr(r, attribute) if larger_is_better else getattr(r, attribute))
        line, best_ratio = [], float("inf")
        for row in trade:
            if row.ppl_ratio < best_ratio:
                line.append(row)
                best_ratio = row.ppl_ratio
        axis.step(
            [getattr(r, attribute) for r in line], [r.ppl_ratio for r in line], where="post", color="#3b75af", lw=1
        )
        if best is not None:
            axis.scatter(getattr(best, attribute), best.ppl_ratio, s=260, marker="*", color="#d62728", zorder=3)
        if baseline is not None:
            axis.scatter(getattr(baseline, attribute), 1.0, s=60, marker="s", color="#555555")
            axis.annotate(
                BASELINE, (getattr(baseline, attribute), 1.0), fontsize=8, xytext=(4, -10), textcoords="offset points"
            )
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_xscale("log")
    axes[0].set_ylabel("perplexity / fp32 perplexity (lower is better)")
    title = f"{model}: blue = Pareto front (ppl, size, speed); line = this panel's trade-off"
    title += f"; star = recommended ({best.variant})" if best else ""
    figure.suptitle(title)
    figure.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp, dpi=110)
    plt.close(figure)
    tmp.replace(path)


def run(
    model: str, variants: list[str], cfg: ReportConfig, tasks: TasksConfig, reports_dir: Path, out: dict[str, Path]
) -> dict:
    found = collect(reports_dir, variants)
    rows, validations = found.rows, found.validations
    answers = task_ab.read_answers(reports_dir, [row.variant for row in rows])
    comparison = task_ab.compare(answers, validations, tasks)
    passed_tasks = {row.variant for row in rows if task_ab.passes(comparison, row.variant)}
    front, best = pareto_front(rows), recommend(rows, cfg, passed_tasks)
    loads = {variant: bench.get("concurrency", {}) for variant, bench in found.benches.items()}
    shown = best or rows[0]
    machines = bench_machines(found.benches)
    text = markdown(model, rows, found.baseline, front, best, cfg, found.workload, found.failed, machines)
    text += "\n".join(task_ab.markdown(comparison)) + "\n"
    text += "\n".join(load.markdown(shown.variant, loads[shown.variant], found.workload)) + "\n"
    text += "\n".join(gates.markdown(model, validations)) + "\n"
    atomic_write_text(out["md"], text)
    plot(model, rows, found.baseline, front, best, out["png"])
    load.plot(model, {v: loads[v] for v in front if loads[v]}, out["load-png"])
    figures = html.figures_for(rows, found.baseline, out["png"], out["load-png"])
    atomic_write_text(out["html"], html.render(f"ortforge: {model}", text, figures))
    summary = {
        "recommended": best.variant if best else None,
        "rule": cfg.model_dump(),
        "pareto_front": front,
        "variants": {row.variant: asdict(row) for row in rows},
        "failed_validation": found.failed,
        "validation": gates.summary(validations),
        "tasks": comparison,
        "under_load": {shown.variant: loads[shown.variant]},
        "bench_machines": machines,
    }
    atomic_write_json(out["json"], summary)
    written = ", ".join(str(out[key]) for key in ("md", "png", "load-png", "html", "json"))
    log.info("wrote %s; recommended %s", written, summary["recommended"])
    return summary


def main(argv: list[str] | None = None) -> int:
    flags = {
        "reports": paths.variant_reports,
        "md": paths.report_md,
        "png": paths.report_png,
        "load-png": paths.report_load_png,
        "html": paths.report_html,
        "json": paths.report_json,
    }

    def body(a):
        run(a.model, a.params.variants_of(a.model), a.params.report, a.params.tasks, a.paths["reports"], a.paths)

    return stage_cli("report", __doc__, flags, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
