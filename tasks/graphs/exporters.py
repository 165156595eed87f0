"""Which exporter may take a model, decided from its config.json alone, so a model no exporter
takes is refused in one line before any work (the build's preflight, before DVC starts) instead of
after download and PyTorch's reference run, and export skips the exporters its config rules out.

An exporter this clears may still refuse a model when it runs (a graph that does not match
PyTorch, a builder that fails on a config it half supports): the export stage says so in one line.
"""

from __future__ import annotations

import functools
import re

TASK = "text-generation-with-past"  # optimum's task for a decoder with a KV cache
EXPORTERS = ("ortforge", "genai", "optimum")  # the order auto tries them in
# Configs optimum lists with a KV cache whose export fails all the same, by model_type: the config
# flag that fails and why (tests/test_export.py exports each, so a new optimum that mends one
# fails that test instead of refusing a model it could export).
OPTIMUM_FAILS = {
    "falcon": (
        "new_decoder_architecture",
        "its trace of Falcon's new decoder architecture fails (Sizes of tensors must match)",
    ),
}


def candidates(choice: str) -> tuple[str, ...]:
    return EXPORTERS if choice == "auto" else (choice,)


@functools.cache
def genai_architectures() -> frozenset[str] | None:
    """The architectures onnxruntime-genai's builder dispatches on, read from its create_model (the
    pinned release keeps no list of them); None when its source names none (then it is tried)."""
    import inspect

    from onnxruntime_genai.models import builder

    found = frozenset(re.findall(r"architectures\[0\] == \"(\w+)\"", inspect.getsource(builder.create_model)))
    return found or None


def optimum_takes(model_type: str) -> bool:
    from optimum.exporters.onnx import model_configs  # noqa: F401  (registers the ONNX configs)
    from optimum.exporters.tasks import TasksManager

    try:
        tasks = TasksManager.get_supported_tasks_for_model_type(model_type, "onnx", library_name="transformers")
    except KeyError:
        return False
    return TASK in tasks


def refusals(config, choice: str) -> dict[str, str]:
    """Why each exporter `choice` tries cannot take the (text) config; one absent may take it."""
    from tasks.graphs import decoder_graph

    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    found = {}
    for exporter in candidates(choice):
        if exporter == "ortforge":
            try:
                decoder_graph.check_supported(config)
            except decoder_graph.Unsupported as why:
                found[exporter] = f"ortforge's exporter does not write it: {why}"
        elif exporter == "genai":
            names = genai_architectures()
            if names is not None and architecture not in names:
                found[exporter] = f"onnxruntime-genai's builder does not take {architecture}"
        elif not optimum_takes(config.model_type):
            found[exporter] = f"optimum-onnx cannot export model_type `{config.model_type}` with a KV cache"
        elif (fails := optimum_fails(config)) is not None:
            found[exporter] = f"optimum-onnx's export fails: {fails}"
    return found


def optimum_fails(config) -> str | None:
    """Why optimum's export of a config it lists fails, where OPTIMUM_FAILS knows."""
    flag, why = OPTIMUM_FAILS.get(config.model_type, (None, None))
    return why if flag is not None and getattr(config, flag, False) else None


def refusal(config, choice: str) -> str | None:
    """One line when no exporter `choice` tries can take the config, else None."""
    found = refusals(config, choice)
    if len(found) < len(candidates(choice)):
        return None
    architecture = (getattr(config, "architectures", None) or [config.model_type])[0]
    tried = "; ".join(f"{name}: {why}" for name, why in found.items())
    fix = "set models.<name>.exporter: auto" if choice != "auto" else "use a supported causal LM"
    return f"no exporter can take {architecture} ({tried}); {fix}"
