"""The report as one self-contained HTML page: the results table and every plot embedded as data
URIs, inline CSS, no script and no link, so it opens offline, from a mail attachment or a CI
artifact, exactly as it was written."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 0.9rem; margin: 1rem 0; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.6rem; text-align: right; }
th { background: #f2f2f2; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1.5rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9rem; }
"""


def latency_png(rows, baseline) -> bytes:
    """Decode ms/token (p50 bar, p95 whisker) and time to first token for each variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = rows + ([baseline] if baseline else [])
    names = [row.variant for row in shown]
    figure, (decode, first) = plt.subplots(1, 2, figsize=(12, 4.2))
    p50 = [row.decode_ms_per_token_p50 for row in shown]
    spread = [max(row.decode_ms_per_token_p95 - row.decode_ms_per_token_p50, 0.0) for row in shown]
    decode.bar(names, p50, yerr=[[0] * len(shown), spread], color="#3b75af", capsize=3)
    decode.set_ylabel("decode ms/token (bar p50, whisker p95)")
    first.bar(names, [row.seconds_to_first_token_p50 * 1e3 for row in shown], color="#e08a3c")
    first.set_ylabel("time to first token, ms (p50)")
    for axis in (decode, first):
        axis.tick_params(axis="x", labelrotation=60, labelsize=8)
        axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def render(title: str, table_markdown: str, figures: list[tuple[str, bytes]]) -> str:
    """The page: the markdown table as HTML, then each (caption, PNG bytes) as an embedded figure."""
    import markdown

    body = markdown.markdown(table_markdown, extensions=["tables"], output_format="html")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        body,
    ]
    for caption, png in figures:
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def figures_for(rows, baseline, tradeoff_png: Path, load_png: Path) -> list[tuple[str, bytes]]:
    return [
        ("Quality against size and decode speed; blue: Pareto front, star: recommended", tradeoff_png.read_bytes()),
        ("Decode latency per token and time to first token", latency_png(rows, baseline)),
        ("Throughput and inter-token latency against concurrent streams (Pareto front)", load_png.read_bytes()),
    ]
