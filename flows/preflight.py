"""What a build checks before DVC starts, and tidies after: the params are valid (one line naming
the key and the fix, where DVC's own templating would fail deep inside), every weight-only
variant's block size divides the model's layer widths where its config.json is already on disk (a
local source, or the last download: quantize would refuse it only after export, optimize and
reference ran), every output can be
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
from ortforge.names import MODEL_CONFIG_FILE
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
    named += [(f"tasks.sets.{name}.file", spec.file) for name, spec in params.tasks.sets.items()]
    return named + [("calibration.text", params.calibration.text), ("bench.text", params.bench.text)]


def check_named_paths(root: Path, params) -> None:
    """StageError naming the first path params.yaml names that does not exist (DVC would say
    `[Errno 2]`, and for a text only after the stages before its reader ran)."""
    for key, path in named_paths(params):
        if not (Path(root) / path).exists():
            raise StageError(
                f"params.yaml {key}: {path} does not exist; fix the path (relative to the repository root)"
            )


def check_task_sets(root: Path, params) -> None:
    """Every task set's rows, read as evaluate reads them: a bad row stops the build before any
    stage, naming its file and line (evaluate would say the same after the model's whole build)."""
    from tasks.evaluation.task_eval import sets_of

    sets_of(params.tasks, root)


def config_before_download(root: Path, name: str, spec) -> Path | None:
    """The folder of a model's config.json before download runs: a local source's own, the last
    download's, or, for a Hub source, its config.json alone at the pinned revision (a few KB, from
    the hub cache when it has it). None when none can be had (download then says why)."""
    for folder in (spec.source.path if spec.source.kind == "local" else None, paths.hf_dir(name)):
        if folder is not None and (Path(root) / folder / MODEL_CONFIG_FILE).is_file():
            return Path(root) / folder
    if spec.source.kind == "hub":
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

        try:
            config = hf_hub_download(spec.source.repo_id, MODEL_CONFIG_FILE, revision=spec.source.revision)
        except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError):
            return None
        return Path(config).parent
    return None


def linear_inputs(config) -> dict[str, int]:
    """The input widths (K) of a decoder's linear layers, by what the config calls them."""
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    widths = {
        "hidden_size": config.hidden_size,
        "num_attention_heads x head_dim": heads * head_dim if heads and head_dim else None,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "moe_intermediate_size": getattr(config, "moe_intermediate_size", None),
        "shared_expert_intermediate_size": getattr(config, "shared_expert_intermediate_size", None),
    }
    return {key: width for key, width in widths.items() if isinstance(width, int) and width > 0}


def check_block_sizes(root: Path, params) -> None:
    """StageError naming the build, the width and the fix when a weight-only variant's blocks
    cannot divide one of its model's layer widths (MatMulNBits stores whole blocks)."""
    from tasks.quantization.codes import MIN_BLOCK, layer_block

    for name, config in text_configs(root, params):
        variants = [v for v in params.variants_of(name) if params.variant(v).method == "weight_only"]
        for key, width in linear_inputs(config).items():
            for variant in variants:
                if layer_block(width, params.variant(variant).block_size) is None:
                    raise StageError(
                        f"params.yaml builds {name}-{variant}: {name}'s {key} is {width}, which no block of "
                        f"{MIN_BLOCK} or more divides (MatMulNBits stores whole blocks); build {name} with method "
                        f"int8_dynamic or fp16 instead of {variant}"
                    )


def text_configs(root: Path, params) -> Iterator[tuple[str, object]]:
    """(name, its text config) of each model whose config.json can be had before download (the
    others are download's to explain)."""
    from transformers import AutoConfig

    for name, spec in params.models.items():
        folder = config_before_download(root, name, spec)
        if folder is None:
            continue
        try:
            yield name, AutoConfig.from_pretrained(folder, trust_remote_code=spec.trust_remote_code).get_text_config()
        except (OSError, ValueError, KeyError):  # download and export say what is wrong with it
            continue


def check_exporters(root: Path, params) -> None:
    """StageError naming the model when no exporter its params allow can take its config (decided
    from config.json alone: tasks/graphs/exporters.py), before DVC downloads or runs anything."""
    from tasks.graphs import exporters

    for name, config in text_configs(root, params):
        refused = exporters.refusal(config, params.models[name].exporter)
        if refused:
            raise StageError(f"params.yaml models.{name}: {refused}")


def check_per_token_opset(root: Path, params) -> None:
    """StageError naming the build when an int8_per_token variant (w8a8) meets a graph its opset
    cannot hold: its blocked QuantizeLinear is opset 21, and optimum's export below 18 cannot be
    raised to it. Quantize would refuse it only after export, optimize and reference ran; the other
    exporters pick their own opset."""
    from tasks.graphs import exporters
    from tasks.quantization.writer import BLOCKED_QUANTIZE_OPSET, RAISABLE_FROM

    if params.export.opset >= RAISABLE_FROM:
        return
    for name, config in text_configs(root, params):
        per_token = [v for v in params.variants_of(name) if params.variant(v).method == "int8_per_token"]
        if not per_token:
            continue
        choice = params.models[name].exporter
        refused = exporters.refusals(config, choice)
        if next((e for e in exporters.candidates(choice) if e not in refused), None) == "optimum":
            raise StageError(
                f"params.yaml builds {name}-{per_token[0]}: int8_per_token writes opset {BLOCKED_QUANTIZE_OPSET} "
                f"nodes, and {name}'s optimum export at export.opset {params.export.opset} cannot be raised to it "
                f"(below {RAISABLE_FROM}); set export.opset to {RAISABLE_FROM} or above"
            )


def before_build(root: Path, say: Callable[[str], object] = _warn) -> None:
    """StageError (one line) when the params are invalid, name a path that does not exist, a model
    no exporter takes, blocks a model's widths cannot hold, a w8a8 its export's opset cannot hold, a
    task set with a bad row, or an output cannot be written; cache objects written in place are
    dropped, saying so."""
    params = load_params(Path(root) / paths.PARAMS)
    check_named_paths(root, params)
    check_exporters(root, params)
    check_block_sizes(root, params)
    check_per_token_opset(root, params)
    check_task_sets(root, params)
    cache_links.remove_damaged(Path(root), say)
    tidy(root)
    for output in output_paths(root):
        check_writable(output)
