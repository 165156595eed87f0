"""The serving workload in the report: a table of the figures against concurrency for the
recommended variant, and a plot of throughput and latency against concurrency for the variants on
the Pareto front (bench.json `concurrency`, tasks/measurement/concurrency.py)."""

from __future__ import annotations

from pathlib import Path


def levels(by_streams: dict) -> list[str]:
    """The concurrency levels in numeric order (JSON files keep their keys sorted as text)."""
    return sorted(by_streams, key=int)


def figure_cells(r: dict, one_stream_rate: float | None) -> str:
    """A level's cells: tokens/s, x one stream's, first token and inter-token p50 / p95, peak RSS."""
    ratio = f"{r['aggregate_tokens_per_second'] / one_stream_rate:.2f}" if one_stream_rate else "-"
    return (
        f"{r['aggregate_tokens_per_second']:.1f} | {ratio} | "
        f"{r['seconds_to_first_token_p50'] * 1e3:.0f} / {r['seconds_to_first_token_p95'] * 1e3:.0f} | "
        f"{r['inter_token_ms_p50']:.1f} / {r['inter_token_ms_p95']:.1f} | {r['peak_rss_mb']:.0f}"
    )


def markdown(variant: str, by_streams: dict, workload: dict) -> list[str]:
    """The report's lines for variant's figures ([] when bench measured no concurrency)."""
    if not by_streams:
        return []
    one = by_streams.get("1", {}).get("aggregate_tokens_per_second")
    lines = [
        "",
        f"## Under load: {variant}",
        "",
        "| streams | aggregate tok/s | x 1 stream | first token ms p50 / p95 | inter-token ms p50 / p95 "
        "| peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {streams} | {figure_cells(by_streams[streams], one)} |" for streams in levels(by_streams)]
    load = workload.get("concurrency", {})
    lines += [
        "",
        f"Each stream sends {load.get('requests')} requests in turn ({load.get('prompt_tokens')}-token prompts whose "
        f"first {load.get('shared_prefix', 0):.0%} all share, {load.get('new_tokens')} new tokens, greedy) through "
        f"the continuous-batching scheduler of `ortforge serve`, without HTTP; each level in its own process. "
        f"Plot: reports/<model>/load.png.",
    ]
    return lines


def plot(model: str, loads: dict[str, dict], path: Path) -> None:
    """Aggregate tokens/s and p95 inter-token latency against streams, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, by_streams in loads.items():
        ordered = [by_streams[s] for s in levels(by_streams)]
        streams = [int(s) for s in levels(by_streams)]
        throughput.plot(streams, [r["aggregate_tokens_per_second"] for r in ordered], "o-", label=variant)
        latency.plot(streams, [r["inter_token_ms_p95"] for r in ordered], "o-", label=variant)
    throughput.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="throughput")
    latency.set(xlabel="concurrent streams", ylabel="inter-token latency p95 (ms)", title="latency")
    for axis in (throughput, latency):
        axis.grid(alpha=0.3)
    if loads:
        throughput.legend(fontsize=8)
    figure.suptitle(f"{model}: under load (continuous batching)")
    figure.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp, dpi=110)
    plt.close(figure)
    tmp.replace(path)
