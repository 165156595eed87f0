"""Export an HF causal LM to a float32 ONNX graph with a KV cache, through one of three exporters:

- ortforge (tasks/graphs/decoder_graph.py, LLaMA-style families): the graph genai's builder writes,
  made from the config alone, whose weights are the checkpoint's own tensors (linked, not
  copied, and converted to float32 by the graph): the same memory for any model size, and no
  float copy on disk.
- genai (onnxruntime-genai's model builder, precision fp32): fused GroupQueryAttention with rotary
  embedding and a cache updated in place, packed QKV, SkipSimplifiedLayerNormalization; about 350
  nodes where optimum's graph has 5,000. Its quantizer is not used: ours runs in the quantize stage.
- optimum (text-generation-with-past): standard operators; attention as MatMul/Softmax subgraphs and
  a cache that grows by concatenation. The model is traced with eager attention, the family's own
  definition (the SDPA path drops Gemma 2's attention softcapping).

`exporter: auto` (per model) tries ortforge, then genai, then optimum, and keeps the first graph
that matches PyTorch: the builders refuse some families and get others subtly wrong (genai's
hard-codes which Gemma 2 and 3 layers attend locally), so every exported graph is compared with
PyTorch before it is kept, on a sequence longer than the model's sliding window where it has one.
A model too large to run whole in float32 (tasks/evaluation/torch_decoder.RESIDENT_BYTES) is
compared on a graph of a few of its layers (the first, and one of each attention window the
config declares) against PyTorch with the same layers. Tied weights are stored once whichever
exporter wrote them (tasks/graphs/shared_weights.py).

Reads artifacts/<model>/hf; writes artifacts/<model>/onnx holding model.onnx whose inputs are
input_ids, attention_mask, [position_ids,] past_key_values.{i}.key|value and whose outputs are
logits, present.{i}.key|value (the names in ortforge.names), and export.json saying which
exporter wrote it, why, and how closely it matches PyTorch.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortforge import names
from tasks.core import paths, resources
from tasks.core.files import atomic_output_dir, atomic_write_json, folder_bytes, link_or_copy, megabytes
from tasks.core.params import ExportConfig
from tasks.core.stage import StageError, stage_cli
from tasks.graphs import architecture, decoder_graph, exporters, onnx_io, shared_weights
from tasks.graphs.architecture import Architecture, expected_windows

log = logging.getLogger(__name__)

RECORD_FILE = "export.json"
# Largest |ORT logit - PyTorch logit| allowed, relative to the largest |PyTorch logit|: float32
# rounding stays near 1e-5; a wrong attention window or a dropped softcap is 1e-2 and more.
PARITY_TOLERANCE = 1e-3
PARITY_TOKENS = 16
PARITY_STEPS = 3  # cached one-token steps after the prefill
LONGEST_PARITY_PREFILL = 1024  # a window longer than this is checked by the graph's structure alone


class ExportRefused(Exception):
    """One exporter could not produce a faithful graph; auto tries the next."""


def first_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (a torch tracing error
    carries a page of context after it; the stage's log keeps the whole traceback)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def refused_on_error(what: str, call, *args):
    """call(*args); any exception but a refusal becomes one: `what failed (Type: first line)`."""
    try:
        return call(*args)
    except ExportRefused:
        raise
    except Exception as error:
        log.info("%s failed; the traceback, for a report:", what, exc_info=True)
        raise ExportRefused(f"{what} failed ({first_line(error)})") from None


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    exporter: str
    num_layers: int
    size_mb: float


def export_ortforge(hf_dir: Path, out: Path, trust_remote_code: bool, layers: list[int] | None = None) -> None:
    """The graph of decoder_graph.py beside links to the checkpoint's files (its external data)."""
    from transformers import AutoConfig

    from tasks.sources.checkpoint import Checkpoint

    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code).get_text_config()
    try:
        decoder_graph.check_supported(config)
    except decoder_graph.Unsupported as why:
        raise ExportRefused(f"ortforge's exporter does not write it: {why}") from None
    checkpoint = Checkpoint(hf_dir)
    graph = refused_on_error("ortforge's exporter", decoder_graph.build, config, checkpoint, layers)
    for file in checkpoint.files:
        link_or_copy(hf_dir / file, out / file)
    onnx_io.save_graph_only(graph, out)


def export_optimum(cfg: ExportConfig, hf_dir: Path, out: Path, trust_remote_code: bool) -> None:
    import torch
    from optimum.exporters.onnx import onnx_export_from_model
    from transformers import AutoModelForCausalLM

    model = refused_on_error(
        "transformers' loader",
        lambda: AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager", trust_remote_code=trust_remote_code
        ),
    )
    # do_validation off: this stage compares the graph with PyTorch itself (parity below).
    refused_on_error(
        "optimum-onnx's export",
        lambda: onnx_export_from_model(model, str(out), opset=cfg.opset, task=exporters.TASK, do_validation=False),
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
            raise ExportRefused(f"onnxruntime-genai's builder does not take it ({error})") from None
        except Exception as error:  # the builder fails on configs it half supports (KeyError, ...)
            log.info("onnxruntime-genai's builder failed; the traceback, for a report:", exc_info=True)
            raise ExportRefused(f"onnxruntime-genai's builder failed ({first_line(error)})") from None


def check_kv_names(model, num_layers: int) -> None:
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    want_in = {names.INPUT_IDS, names.ATTENTION_MASK, *names.past_names(num_layers)}
    want_out = {names.LOGITS, *names.present_names(num_layers)}
    missing = sorted((want_in - inputs) | (want_out - outputs))
    if missing:
        raise ExportRefused(f"its graph lacks {missing[:4]}: the exporter's naming changed (pin it in versions.yaml)")


def check_attention_windows(model, arch: Architecture) -> None:
    """A fused graph's per-layer attention windows equal the config's (GroupQueryAttention's
    local_window_size); a graph of standard ops computes its masks from the traced model."""
    windows = [
        onnx_io.attribute(node, "local_window_size", -1)
        for node in model.graph.node
        if node.op_type == "GroupQueryAttention"
    ]
    if windows and windows != expected_windows(arch):
        raise ExportRefused(
            f"its attention windows per layer are {windows}, the model's config says {expected_windows(arch)}"
        )


def parity_layers(arch: Architecture) -> list[int]:
    """The layers a large model is checked on: the first two, and the first of each attention
    window the config declares (Gemma 3: a sliding and a global layer)."""
    windows = expected_windows(arch)
    return sorted({0, min(1, arch.num_layers - 1)} | {windows.index(window) for window in windows})


def too_large_to_run_whole(hf_dir: Path) -> bool:
    from tasks.evaluation.torch_decoder import RESIDENT_BYTES
    from tasks.sources.checkpoint import Checkpoint

    return Checkpoint(hf_dir).float32_bytes() > RESIDENT_BYTES


def parity(graph_dir: Path, hf_dir: Path, arch: Architecture, graph, layers: list[int] | None = None) -> dict:
    """Prefill then cached steps through onnxruntime against one PyTorch pass over the same tokens
    (of only the given layers, when graph_dir holds a graph of those)."""
    window = arch.sliding_window or 0
    prefill = PARITY_TOKENS if window >= LONGEST_PARITY_PREFILL else max(PARITY_TOKENS, window + 8)
    prefill = min(prefill, arch.context_length - PARITY_STEPS)
    ids = np.random.default_rng(0).integers(0, arch.vocab_size, prefill + PARITY_STEPS, dtype=np.int64)
    layout = names.KV_SHARED if any(n.op_type == "GroupQueryAttention" for n in graph.graph.node) else "chained"
    # onnxruntime refusing the graph (GroupQueryAttention wants head sizes of 16k), or PyTorch
    # refusing the comparison run: each named as what failed. The session is gone after.
    stepped = refused_on_error(
        "onnxruntime running its graph", _onnxruntime_logits, graph_dir, arch.head_dim, layout, ids, prefill
    )
    reference = refused_on_error(
        f"PyTorch (transformers {architecture.installed_transformers()}) running the model to compare",
        _pytorch_logits,
        hf_dir,
        ids,
        layers,
    )
    gap = float(np.abs(stepped - reference).max() / np.abs(reference).max())
    figures = {"tokens": int(len(ids)), "cached_steps": PARITY_STEPS, "max_relative_logit_diff": gap}
    return figures | ({"layers": layers} if layers is not None else {})


def _onnxruntime_logits(graph_dir: Path, head_dim: int, layout: str, ids: np.ndarray, prefill: int) -> np.ndarray:
    import onnxruntime as ort

    from ortforge.decoder import Decoder
    from ortforge.session import SessionSettings

    options = SessionSettings().session_options()
    # Prepacked copies of the weights speed up many runs; this is four, and a vocabulary matrix
    # packed again is as large as the model's float32 table (1 GB for Llama 3.2 1B).
    options.add_session_config_entry("session.disable_prepacking", "1")
    session = ort.InferenceSession(str(graph_dir / names.MODEL_FILE), options, providers=["CPUExecutionProvider"])
    decoder = Decoder(session, head_dim=head_dim, layout=layout)
    logits, cache = decoder.forward(ids[:prefill], decoder.empty_cache())
    stepped = [logits]
    for token in ids[prefill:]:
        logits, cache = decoder.forward([int(token)], cache)
        stepped.append(logits)
    return np.concatenate(stepped)


def _pytorch_logits(hf_dir: Path, ids: np.ndarray, layers: list[int] | None) -> np.ndarray:
    from tasks.evaluation.torch_decoder import TorchDecoder

    torch_decoder = TorchDecoder(hf_dir, attention="eager", layers=layers)
    return torch_decoder.forward(ids, torch_decoder.empty_cache())[0]


def checked(graph_dir: Path, hf_dir: Path, arch: Architecture, graph, exporter: str, trust_code: bool) -> dict:
    """parity(), on a graph of a few layers when the model is too large to run whole (ortforge's
    exporter writes one in seconds; the others' graphs are checked whole)."""
    if exporter != "ortforge" or not too_large_to_run_whole(hf_dir):
        return parity(graph_dir, hf_dir, arch, graph)
    layers = parity_layers(arch)
    part = graph_dir / "parity"
    part.mkdir()
    try:
        export_ortforge(hf_dir, part, trust_code, layers)
        return parity(part, hf_dir, arch, onnx_io.load(part, with_weights=False), layers)
    finally:
        shutil.rmtree(part)


def attempt(exporter: str, cfg: ExportConfig, hf_dir: Path, out: Path, arch: Architecture, trust_code: bool) -> dict:
    """Export into out and check it; ExportRefused when the graph cannot be trusted."""
    if exporter == "ortforge":
        export_ortforge(hf_dir, out, trust_code)
    elif exporter == "genai":
        export_genai(hf_dir, out)
    else:
        export_optimum(cfg, hf_dir, out, trust_code)
    graph = onnx_io.load(out, with_weights=False)
    check_kv_names(graph, arch.num_layers)
    check_attention_windows(graph, arch)
    figures = checked(out, hf_dir, arch, graph, exporter, trust_code)
    if not figures["max_relative_logit_diff"] <= PARITY_TOLERANCE:  # NaN fails too
        raise ExportRefused(
            f"its logits differ from PyTorch's by {figures['max_relative_logit_diff']:.2g} of their range over "
            f"{figures['tokens']} tokens (tolerance {PARITY_TOLERANCE:g})"
        )
    return figures


def check_memory_for_builder(hf_dir: Path) -> None:
    """ExportRefused when genai's builder or optimum would need more memory than there is (the
    stage's own preflight counted on ortforge's exporter, which a model may still refuse)."""
    needed, free = builder_needs(resources.ModelSize.of(hf_dir)), resources.available_memory()
    if free < needed.memory and os.environ.get(resources.SKIP_ENV) != "1":
        raise ExportRefused(
            f"it would need about {resources.amount(needed.memory)} of memory ({needed.basis}); "
            f"{resources.amount(free)} are available"
        )


def export_first_faithful(
    cfg: ExportConfig, choice: str, hf_dir: Path, tmp: Path, arch: Architecture, trust_code: bool
) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_code).get_text_config()
    refusals = exporters.refusals(config, choice)  # those its config.json alone rules out
    for exporter in exporters.candidates(choice):
        if exporter in refusals:
            log.warning("%s: %s", exporter, refusals[exporter])
            continue
        out = tmp / exporter
        out.mkdir()
        log.info("exporting %s (%s) with %s", hf_dir, arch.architecture, exporter)
        try:
            if exporter != "ortforge":
                check_memory_for_builder(hf_dir)
            figures = refused_on_error(exporter, attempt, exporter, cfg, hf_dir, out, arch, trust_code)
        except ExportRefused as refusal:
            log.warning("%s: %s", exporter, refusal)
            refusals[exporter] = str(refusal)
            shutil.rmtree(out)
            continue
        return {"exporter": exporter, "parity": figures, "refused": refusals}
    tried = "; ".join(f"{name}: {refusals[name]}" for name in exporters.candidates(choice))
    fix = "set models.<name>.exporter: optimum" if choice == "genai" else "use a supported causal LM"
    raise StageError(f"no exporter produced a faithful graph of {arch.architecture} ({tried}); {fix}")


def run(cfg: ExportConfig, exporter: str, hf_dir: Path, out_dir: Path, trust_code: bool = False) -> ExportResult:
    """exporter: auto, ortforge, genai or optimum (models.<name>.exporter); trust_code: the model's opt-in to
    its repository's own Python (models.<name>.trust_remote_code)."""
    arch = architecture.read(hf_dir, trust_code)
    with atomic_output_dir(out_dir) as tmp:
        record = export_first_faithful(cfg, exporter, hf_dir, tmp, arch, trust_code)
        graph_dir = tmp / record["exporter"]
        if record["exporter"] == "ortforge":  # written final: tied weights shared, data external
            for path in graph_dir.iterdir():
                path.rename(tmp / path.name)
        else:
            graph = onnx_io.load(graph_dir)
            record["shared_weights"] = shared_weights.share_transposed_copies(graph)
            onnx_io.save(graph, tmp, external_data=True)  # weights read straight into place at load
        shutil.rmtree(graph_dir)
        atomic_write_json(tmp / RECORD_FILE, record)
    size = folder_bytes(out_dir)
    linked = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file() and p.stat().st_nlink > 1)
    shown = f"{(size - linked) / 1e6:.1f} MB" + (f", and {linked / 1e6:.0f} MB of linked weights" if linked else "")
    log.info("wrote %s with %s (%s)", out_dir, record["exporter"], shown)
    return ExportResult(out_dir, record["exporter"], arch.num_layers, megabytes(size))


def writes_itself(hf_dir: Path, choice: str, trust_code: bool) -> bool:
    """Whether ortforge's exporter is tried first and takes the config."""
    from transformers import AutoConfig

    if choice not in ("auto", "ortforge"):
        return False
    try:
        config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_code).get_text_config()
        decoder_graph.check_supported(config)
    except (decoder_graph.Unsupported, OSError, ValueError, KeyError):
        return False
    return True


def builder_needs(size: resources.ModelSize) -> resources.Needs:
    """genai's builder and optimum load the whole model and write the float graph (14.7 GB peak
    for a 4.9 GB float32 Llama 3.2 1B shape: about 3x)."""
    return resources.Needs(
        resources.BASE_MEMORY + 3.5 * size.total,
        2.2 * size.total,
        f"the whole {resources.amount(size.total)} float32 model loaded and written by the exporter",
    )


def needs(a) -> resources.Needs:
    hf_dir, spec = a.paths["hf"], a.params.model(a.model)
    size = resources.ModelSize.of(hf_dir)
    if not writes_itself(hf_dir, spec.exporter, spec.trust_remote_code):
        return builder_needs(size)
    if not too_large_to_run_whole(hf_dir):
        basis = f"the graph compared with PyTorch whole: {resources.amount(size.total)} of float32 weights"
        return resources.Needs(resources.BASE_MEMORY + 2.5 * size.total, 1e6, basis)
    basis = (
        f"the graph of {len(parity_layers(architecture.read(hf_dir, spec.trust_remote_code)))} layers compared "
        f"with PyTorch: {resources.amount(size.vocabulary)} of float32 vocabulary matrices, "
        f"{resources.amount(size.layer)} per layer"
    )
    return resources.Needs(resources.BASE_MEMORY + 2 * size.vocabulary + 4 * size.layer, 1e6, basis)


def main(argv: list[str] | None = None) -> int:
    flags = {"hf": paths.hf_dir, "out": paths.export_dir}

    def body(a):
        spec = a.params.model(a.model)
        run(a.params.export, spec.exporter, a.paths["hf"], a.paths["out"], spec.trust_remote_code)

    return stage_cli("export", __doc__, flags, body, argv, needs=needs)


if __name__ == "__main__":
    raise SystemExit(main())
