"""ONNX Runtime session settings of an artifact, read from its runtime.json, and session creation.

The bench stage writes the settings it measured best into runtime.json; an application that loads
the artifact gets them by default and can still override any of them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from ortforge import custom_ops, machine
from ortforge.manifest import runtime_config
from ortforge.names import MODEL_FILE

log = logging.getLogger(__name__)

GRAPH_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


_said_untuned: set[Path] = set()  # runtime.json files whose settings this process already declined


def tuned_for(tuned_on: dict, here: dict) -> bool:
    """Settings measured on tuned_on hold here: the same CPU model (a probe may record no name) with
    every feature they were measured with; a feature found only here (a newer probe, a newer
    kernel) changes nothing they chose."""
    same_model = tuned_on.get("cpu") in (None, here["cpu"])
    return same_model and set(tuned_on["features"]) <= set(here["features"])


@dataclass(frozen=True)
class SessionSettings:
    intra_op_threads: int = 0  # 0: ONNX Runtime picks one thread per physical core
    inter_op_threads: int = 0  # above 1 runs independent nodes in parallel (ORT_PARALLEL)
    graph_level: str = "all"
    enable_mem_pattern: bool = True
    enable_cpu_mem_arena: bool = True
    # Not a session option but the decoder's: prompts run in pieces of this many tokens (0: whole).
    # Activation memory grows with the tokens in one run; onnxruntime keeps what a run allocated.
    prefill_chunk: int = 0

    def __post_init__(self) -> None:
        if self.graph_level not in GRAPH_LEVELS:
            raise ValueError(f"graph_level {self.graph_level!r} is not one of {sorted(GRAPH_LEVELS)}")
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            raise ValueError("thread counts must be >= 0 (0 lets ONNX Runtime choose)")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk {self.prefill_chunk} must be >= 0 (0 runs a prompt whole)")

    @classmethod
    def from_dict(cls, values: dict) -> SessionSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown session setting(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)

    @classmethod
    def for_artifact(cls, model_dir: Path) -> SessionSettings:
        """The settings the bench stage measured best for this artifact, or the defaults when they
        were measured on another CPU model or on one missing a feature this one has not (said once
        per process and file)."""
        path = runtime_config(model_dir)
        if not path.is_file():
            return cls()
        recorded = json.loads(path.read_text(encoding="utf-8"))
        tuned_on, here = recorded.get("machine"), machine.describe()
        if tuned_on is not None and not tuned_for(tuned_on, here):
            if path.resolve() not in _said_untuned:
                _said_untuned.add(path.resolve())
                log.warning(
                    "%s was tuned on %s with features %s, this machine is %s with %s; using onnxruntime's default "
                    "settings (ortforge bench measures them here)",
                    path.name,
                    tuned_on.get("cpu", "an unnamed CPU"),
                    "+".join(tuned_on["features"]) or "none",
                    here["cpu"],
                    "+".join(here["features"]) or "none",
                )
            return cls()
        return cls.from_dict(recorded["session"])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def session_options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = self.inter_op_threads
        if self.inter_op_threads > 1:
            options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        options.graph_optimization_level = GRAPH_LEVELS[self.graph_level]
        options.enable_mem_pattern = self.enable_mem_pattern
        options.enable_cpu_mem_arena = self.enable_cpu_mem_arena
        options.log_severity_level = 3  # warnings about unused initializers are noise for users
        return options


def create_session(model_dir: Path, settings: SessionSettings | None = None) -> ort.InferenceSession:
    """A CPU session for the artifact in model_dir, with the custom ops its graph uses; ValueError
    if its weights point outside it or a custom op cannot be had."""
    model_dir = Path(model_dir)
    if not (model_dir / MODEL_FILE).is_file():
        raise ValueError(f"{model_dir} has no {MODEL_FILE}; point at an artifact folder (artifacts/<m>/variants/<v>)")
    settings = settings or SessionSettings.for_artifact(model_dir)
    options = settings.session_options()
    custom_ops.register(options, model_dir / MODEL_FILE)
    try:
        return ort.InferenceSession(str(model_dir / MODEL_FILE), options, providers=["CPUExecutionProvider"])
    except Exception as error:
        # onnxruntime refuses external data outside the model's folder (absolute, "..", or a link
        # leading out); say so in one line instead of its C++ trace.
        if "External data path" in str(error):
            raise ValueError(
                f"{model_dir / MODEL_FILE} points its weights outside {model_dir}; refusing to load it: "
                "rebuild the artifact or fetch it again from the DVC remote"
            ) from None
        raise
