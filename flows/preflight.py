"""What a build checks before DVC starts, and tidies after: the params are valid (one line naming
the key and the fix, where DVC's own templating would fail deep inside), every output can be
written (DVC deletes a stage's outputs before running it, so an unwritable one would cost them),
and no dead writer's temporary is left beside an output (DVC may restore an output from its run
cache without running the stage that would remove it)."""

from __future__ import annotations

from pathlib import Path

from tasks import paths
from tasks.files import remove_abandoned_under
from tasks.params import load_params
from tasks.resources import check_writable


def output_paths(root: Path) -> list[Path]:
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return sorted({Path(str(out.fs_path)) for stage in repo.index.stages for out in stage.outs})


def tidy(root: Path) -> list[Path]:
    root = Path(root)
    return [found for folder in (paths.ARTIFACTS, paths.REPORTS) for found in remove_abandoned_under(root / folder)]


def before_build(root: Path) -> None:
    """StageError (one line) when the params are invalid or an output cannot be written."""
    load_params(Path(root) / paths.PARAMS)
    tidy(root)
    for output in output_paths(root):
        check_writable(output)
