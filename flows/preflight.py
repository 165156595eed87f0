"""What a build checks before DVC starts, and tidies after: the params are valid (one line naming
the key and the fix, where DVC's own templating would fail deep inside), every output can be
written (DVC deletes a stage's outputs before running it, so an unwritable one would cost them),
no dead writer's temporary is left beside an output (DVC may restore an output from its run cache
without running the stage that would remove it), no hard-linked cache object was written in place
(flows/cache_links.py), and the measurements kept in git that a failed stage lost come back."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from flows import cache_links
from tasks.core import paths
from tasks.core.errors import StageError
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


KEPT_PREFIX = "ortforge-kept-"  # then the build's PID: a folder whose build died (kill -9) is found by it


def remove_dead_builds_copies(temp: Path | None = None) -> list[Path]:
    """The copies of kept measurements that killed builds left in the temp directory (a kill -9
    runs no cleanup); a live build's stay."""
    removed = []
    for folder in Path(temp or tempfile.gettempdir()).glob(f"{KEPT_PREFIX}*-*"):
        pid = folder.name[len(KEPT_PREFIX) :].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def measurements_kept(root: Path) -> Iterator[None]:
    """On a failed build, put back the git-kept outputs DVC deleted and no stage wrote again."""
    root = Path(root).resolve()
    kept = [path for path in output_paths(root, kept_in_git=True) if path.is_file()]
    remove_dead_builds_copies()
    with tempfile.TemporaryDirectory(prefix=f"{KEPT_PREFIX}{os.getpid()}-") as scratch:
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


def named_paths(params) -> list[tuple[str, Path]]:
    """Every file or folder params.yaml names, with its key: the sources and the texts."""
    named = [(f"models.{name}.source.path", spec.source.path) for name, spec in params.models.items()]
    named += [(f"validate.eval.texts[{index}]", text) for index, text in enumerate(params.validation.eval.texts)]
    return named + [("calibration.text", params.calibration.text), ("bench.text", params.bench.text)]


def check_named_paths(root: Path, params) -> None:
    """StageError naming the first path params.yaml names that does not exist (DVC would say
    `[Errno 2]`, and for a text only after the stages before its reader ran)."""
    for key, path in named_paths(params):
        if not (Path(root) / path).exists():
            raise StageError(
                f"params.yaml {key}: {path} does not exist; fix the path (relative to the repository root)"
            )


def before_build(root: Path, say: Callable[[str], object] = _warn) -> None:
    """StageError (one line) when the params are invalid, name a path that does not exist, or an
    output cannot be written; cache objects written in place are dropped, saying so."""
    check_named_paths(root, load_params(Path(root) / paths.PARAMS))
    cache_links.remove_damaged(Path(root), say)
    tidy(root)
    for output in output_paths(root):
        check_writable(output)
