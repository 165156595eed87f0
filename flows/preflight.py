"""What a build checks before DVC starts, and tidies after: the params are valid (one line naming
the key and the fix, where DVC's own templating would fail deep inside), every output can be
written (DVC deletes a stage's outputs before running it, so an unwritable one would cost them),
no dead writer's temporary is left beside an output (DVC may restore an output from its run cache
without running the stage that would remove it), no hard-linked cache object was written in place
(flows/cache_links.py), and the measurements kept in git that a failed stage lost come back."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from flows import cache_links
from tasks.core import paths
from tasks.core.files import remove_abandoned_under
from tasks.core.params import load_params
from tasks.core.resources import check_writable


def _warn(line: str) -> None:
    print(line, file=sys.stderr)


def output_paths(root: Path, kept_in_git: bool = False) -> list[Path]:
    """Every stage's outputs (or only those DVC does not cache: the measurements kept in git)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        outs = [out for stage in repo.index.stages for out in stage.outs if not (kept_in_git and out.use_cache)]
        return sorted({Path(str(out.fs_path)) for out in outs})


@contextlib.contextmanager
def measurements_kept(root: Path) -> Iterator[None]:
    """On a failed build, put back the git-kept outputs DVC deleted and no stage wrote again."""
    root = Path(root).resolve()
    kept = [path for path in output_paths(root, kept_in_git=True) if path.is_file()]
    with tempfile.TemporaryDirectory(prefix="ortforge-kept-") as scratch:
        for index, path in enumerate(kept):
            shutil.copy2(path, Path(scratch) / str(index))
        try:
            yield
        except BaseException:
            for index, path in enumerate(kept):
                if not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(Path(scratch) / str(index), path)
            raise


def tidy(root: Path) -> list[Path]:
    root = Path(root)
    return [found for folder in (paths.ARTIFACTS, paths.REPORTS) for found in remove_abandoned_under(root / folder)]


def before_build(root: Path, say: Callable[[str], object] = _warn) -> None:
    """StageError (one line) when the params are invalid or an output cannot be written; cache
    objects written in place are dropped, saying so."""
    load_params(Path(root) / paths.PARAMS)
    cache_links.remove_damaged(Path(root), say)
    tidy(root)
    for output in output_paths(root):
        check_writable(output)
