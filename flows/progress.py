"""A progress bar over `dvc repro`: the stages DVC plans to run are the total, each stage DVC starts
advances it, and DVC's own output scrolls above the bar."""

from __future__ import annotations

from pathlib import Path


def reproduce_with_progress(root: Path, targets: list[str] | None = None, *options: str) -> list[str]:
    """Run `dvc repro [options] [targets]` under a progress bar; return the stages executed."""
    from tqdm import tqdm

    from flows.dvc import STAGE_STARTED, DvcFailed, planned_stages, reproduce

    try:
        total = len(planned_stages(root, targets, *options))
    except DvcFailed:
        total = None  # a dry run cannot plan stages whose inputs do not exist yet: count without a total
    if total == 0:
        return []
    with tqdm(total=total, unit="stage", dynamic_ncols=True) as bar:
        started: list[str] = []

        def show(line: str) -> None:
            match = STAGE_STARTED.search(line)
            if match:
                if started:
                    bar.update(1)
                started.append(match.group(1))
                bar.set_description(match.group(1))
            bar.write(line)

        ran = reproduce(root, targets, *options, echo=show)
        bar.update(len(ran) - bar.n)
    return ran
