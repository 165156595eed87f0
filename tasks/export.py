"""Export an HF causal LM to ONNX with a KV cache through optimum (text-generation-with-past).

Reads artifacts/<model>/hf; writes artifacts/<model>/onnx holding model.onnx whose inputs are
input_ids, attention_mask, position_ids, past_key_values.{i}.key|value and whose outputs are
logits, present.{i}.key|value (the names in ortforge.names).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ortforge import names
from tasks import onnx_io, paths
from tasks.files import atomic_output_dir, folder_bytes, megabytes
from tasks.params import ExportConfig
from tasks.stage import StageError, stage_cli

log = logging.getLogger(__name__)

TASK = "text-generation-with-past"


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    num_layers: int
    size_mb: float


def check_exportable(hf_dir: Path) -> dict:
    """Fail fast, before torch loads anything, when the folder or its architecture cannot export."""
    config_path = hf_dir / names.MODEL_CONFIG_FILE
    if not config_path.is_file():
        raise StageError(f"{hf_dir} has no config.json; run the download stage first (dvc repro download@<model>)")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    from optimum.exporters.onnx import model_configs  # noqa: F401  (registers the ONNX configs)
    from optimum.exporters.tasks import TasksManager

    try:
        tasks = TasksManager.get_supported_tasks_for_model_type(model_type, "onnx", library_name="transformers")
    except KeyError:
        tasks = {}
    if TASK not in tasks:
        raise StageError(
            f"model_type `{model_type}` in {config_path} cannot be exported with a KV cache by optimum-onnx; "
            f"use a supported causal LM (llama, mistral, qwen2, gpt2, phi3, ...)"
        )
    return config


def check_kv_names(model, num_layers: int) -> None:
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    want_in = {names.INPUT_IDS, names.ATTENTION_MASK, *names.past_names(num_layers)}
    want_out = {names.LOGITS, *names.present_names(num_layers)}
    missing = sorted((want_in - inputs) | (want_out - outputs))
    if missing:
        raise StageError(f"the exported graph lacks {missing}; the exporter's naming changed, pin optimum-onnx")


def run(cfg: ExportConfig, hf_dir: Path, out_dir: Path) -> ExportResult:
    config = check_exportable(hf_dir)
    from optimum.exporters.onnx import main_export

    with atomic_output_dir(out_dir) as tmp:
        log.info("exporting %s (%s) with opset %d", hf_dir, config["model_type"], cfg.opset)
        main_export(
            str(hf_dir),
            output=str(tmp),
            task=TASK,
            opset=cfg.opset,
            do_validation=False,  # the validate stage checks every variant against PyTorch
            library_name="transformers",
            local_files_only=True,
        )
        check_kv_names(onnx_io.load(tmp, with_weights=False), config["num_hidden_layers"])
    size = folder_bytes(out_dir)
    log.info("wrote %s (%.1f MB)", out_dir, size / 1e6)
    return ExportResult(out_dir, config["num_hidden_layers"], megabytes(size))


def main(argv: list[str] | None = None) -> int:
    flags = {"hf": paths.hf_dir, "out": paths.export_dir}
    return stage_cli("export", __doc__, flags, lambda a: run(a.params.export, a.paths["hf"], a.paths["out"]), argv)


if __name__ == "__main__":
    raise SystemExit(main())
