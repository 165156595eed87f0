"""A PyTorch model whose decoder layers are read from the checkpoint as they run, in float32
(or bfloat16, for calibration on a CPU that multiplies it natively).

transformers builds the model's modules without weights (on the meta device); the embedding, final
norm and output layer are read at once, and each decoder layer's weights are read (and bfloat16
upcast) just before the layer runs and dropped right after. The model's own forward, attention and
cache code run unchanged, so it computes exactly what `from_pretrained(dtype=float32)` computes,
with one layer in memory instead of all of them. The price is reading the layers again on every
forward pass; callers batch their work into few passes (windows of tokens, calibration samples
stacked in one batch).

`layers` keeps only some decoder layers (renumbered from 0): a smaller model of the same
architecture, for checking an exported graph of the same layers against it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tasks.core.errors import StageError
from tasks.sources.checkpoint import Checkpoint

log = logging.getLogger(__name__)


def decoder_layers(model, count: int) -> tuple[str, object]:
    """(name, ModuleList) of the model's decoder layers: the module list of `count` blocks."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and name:
            return name, module
    raise StageError(f"{type(model).__name__} has no list of {count} decoder layers to stream")


def subset_config(config, layers: list[int]):
    """The config of a model made of the given layers only (per-layer settings kept per layer)."""
    import copy

    config = copy.deepcopy(config)
    text = config.get_text_config()
    for key in ("layer_types",):
        values = getattr(text, key, None)
        if isinstance(values, (list, tuple)) and len(values) == text.num_hidden_layers:
            setattr(text, key, [values[i] for i in layers])
    text.num_hidden_layers = len(layers)
    return config


class LayerStreamer:
    """Loads each decoder layer's parameters before it runs and releases them after."""

    def __init__(self, checkpoint: Checkpoint, prefix: str, sources: list[int], dtype):
        self.checkpoint, self.prefix, self.sources, self.dtype = checkpoint, prefix, sources, dtype

    def source_name(self, index: int, name: str) -> str:
        return f"{self.prefix}.{self.sources[index]}.{name}"

    def attach(self, layers) -> None:
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda module, args, index=index: self.load(index, module))
            layer.register_forward_hook(lambda module, args, output: release(module))

    def load(self, index: int, layer) -> None:
        for name, _ in list(layer.named_parameters()):
            set_parameter(layer, name, read_tensor(self.checkpoint, self.source_name(index, name), self.dtype))


def read_tensor(checkpoint: Checkpoint, name: str, dtype):
    """The checkpoint's tensor as a torch tensor of dtype (float32 or bfloat16); a stored bfloat16
    read as bfloat16 is not copied again."""
    import torch

    if dtype == torch.bfloat16 and checkpoint.stored(name).dtype == "BF16":
        return torch.from_numpy(checkpoint.raw(name).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(checkpoint.read(name)).to(dtype)


def set_parameter(root, dotted: str, tensor, shape: tuple[int, ...] | None = None) -> None:
    """Replace the parameter `dotted` under root with tensor, or with an empty meta tensor of the
    given shape when tensor is None."""
    import torch

    owner_name, _, leaf = dotted.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    tensor = tensor if tensor is not None else torch.empty(shape, device="meta")
    owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


def release(layer) -> None:
    for name, parameter in list(layer.named_parameters()):
        set_parameter(layer, name, None, tuple(parameter.shape))


def streamed_model(
    hf_dir: Path,
    attention: str | None,
    layers: list[int] | None = None,
    trust_remote_code: bool = False,
    dtype: str = "float32",
):
    """The model in hf_dir with its decoder layers read from the checkpoint as they run."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, dtype)

    checkpoint = Checkpoint(hf_dir)
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
    total = config.get_text_config().num_hidden_layers
    chosen = list(range(total)) if layers is None else list(layers)
    if layers is not None:
        config = subset_config(config, chosen)
    options = {"attn_implementation": attention} if attention else {}
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code, **options)
    prefix, blocks = decoder_layers(model, len(chosen))
    streamer = LayerStreamer(checkpoint, prefix, chosen, dtype)
    # A tied output layer is absent from the checkpoint; tie_weights() points it at the embedding.
    tied = (
        set(getattr(model, "_tied_weights_keys", None) or []) if config.get_text_config().tie_word_embeddings else set()
    )
    missing = []
    for name, _ in model.named_parameters():
        if name.startswith(prefix + "."):
            continue
        if name in checkpoint:
            set_parameter(model, name, read_tensor(checkpoint, name, dtype))
        elif name not in tied:
            missing.append(name)
    if missing:
        raise StageError(f"{hf_dir}: the checkpoint lacks {missing[:3]}; it does not match its config.json")
    model.tie_weights()
    streamer.attach(blocks)
    log.info("PyTorch model with %d decoder layers read from %s as they run", len(chosen), hf_dir)
    return model.eval()
