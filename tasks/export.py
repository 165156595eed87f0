"""Export an HF causal LM to a float32 ONNX graph with a KV cache, through one of two exporters:

- optimum (text-generation-with-past): standard operators; attention as MatMul/Softmax subgraphs and
  a cache that grows by concatenation.
- genai (onnxruntime-genai's model builder, precision fp32): fused GroupQueryAttention with rotary
  embedding and a cache updated in place, packed QKV, SkipSimplifiedLayerNormalization; about 350
  nodes where optimum's graph has 5,000. Its quantizer is not used: ours runs in the quantize stage.

Reads artifacts/<model>/hf; writes artifacts/<model>/onnx holding model.onnx whose inputs are
input_ids, attention_mask, [position_ids,] past_key_values.{i}.key|value and whose outputs are
logits, present.{i}.key|value (the names in ortforge.names), whichever exporter made it.
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
# Causal LMs onnxruntime-genai 0.15's builder converts (its create_model dispatches on these).
GENAI_ARCHITECTURES = frozenset(
    {
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "GraniteForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "NemotronForCausalLM",
        "OlmoForCausalLM",
        "Phi3ForCausalLM",
        "PhiForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "SmolLM3ForCausalLM",
    }
)


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    num_layers: int
    size_mb: float


def check_exportable(hf_dir: Path, exporter: str) -> dict:
    """Fail fast, before torch loads anything, when the folder or its architecture cannot export.

    optimum says which architectures it supports; the genai builder only says so when it tries,
    and export_genai translates its refusal.
    """
    config_path = hf_dir / names.MODEL_CONFIG_FILE
    if not config_path.is_file():
        raise StageError(f"{hf_dir} has no config.json; run the download stage first (dvc repro download@<model>)")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if exporter == "genai":
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        architecture = (config.get("architectures") or ["?"])[0]
        if model_type not in CONFIG_MAPPING_NAMES or architecture not in GENAI_ARCHITECTURES:
            raise StageError(
                f"model_type `{model_type}` ({architecture}) in {config_path} cannot be exported by "
                f"onnxruntime-genai's builder; it takes {', '.join(sorted(GENAI_ARCHITECTURES))}; "
                f"or set export.exporter: optimum"
            )
        return config
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
        raise StageError(f"the exported graph lacks {missing}; the exporter's naming changed: pin it in versions.yaml")


def export_optimum(cfg: ExportConfig, hf_dir: Path, out: Path) -> None:
    from optimum.exporters.onnx import main_export

    main_export(
        str(hf_dir),
        output=str(out),
        task=TASK,
        opset=cfg.opset,
        do_validation=False,  # the validate stage checks every variant against PyTorch
        library_name="transformers",
        local_files_only=True,
    )


def export_genai(hf_dir: Path, out: Path) -> None:
    import tempfile

    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    with tempfile.TemporaryDirectory() as cache:
        try:
            # The builder's own entry point: parse_extra_options also loads the HF config it needs.
            options = parse_extra_options(None, str(hf_dir), str(out), "fp32", "cpu", cache, [])
            create_model(None, str(hf_dir), str(out), "fp32", "cpu", cache, **options)
        except NotImplementedError as error:
            raise StageError(
                f"onnxruntime-genai's builder cannot export this model ({error}); set export.exporter: optimum"
            ) from None


def run(cfg: ExportConfig, hf_dir: Path, out_dir: Path) -> ExportResult:
    config = check_exportable(hf_dir, cfg.exporter)
    with atomic_output_dir(out_dir) as tmp:
        log.info("exporting %s (%s) with %s", hf_dir, config["model_type"], cfg.exporter)
        if cfg.exporter == "genai":
            export_genai(hf_dir, tmp)
        else:
            export_optimum(cfg, hf_dir, tmp)
        check_kv_names(onnx_io.load(tmp, with_weights=False), config["num_hidden_layers"])
    size = folder_bytes(out_dir)
    log.info("wrote %s (%.1f MB)", out_dir, size / 1e6)
    return ExportResult(out_dir, config["num_hidden_layers"], megabytes(size))


def main(argv: list[str] | None = None) -> int:
    flags = {"hf": paths.hf_dir, "out": paths.export_dir}
    return stage_cli("export", __doc__, flags, lambda a: run(a.params.export, a.paths["hf"], a.paths["out"]), argv)


if __name__ == "__main__":
    raise SystemExit(main())
