"""The original PyTorch model behind the same forward(token_ids, cache) interface as
ortforge.Decoder, so reference figures and the bench baseline run the same loops as the variants."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np

from tasks.core import paths, resources

# Float32 weights a PyTorch model may keep loaded whole. A larger model runs with its decoder
# layers read from the checkpoint as they run (tasks/evaluation/layer_streaming.py): the same
# figures, in the memory of one layer plus the embedding and output layer.
RESIDENT_BYTES = 1_500_000_000


def load_causal_lm(
    hf_dir: Path,
    attention: str | None = None,
    layers: list[int] | None = None,
    resident_bytes: int = RESIDENT_BYTES,
    trust_remote_code: bool | None = None,
    dtype: str = "float32",
):
    """The model in float32 (or dtype): loaded whole when it fits resident_bytes (and all layers
    are asked for), else with its decoder layers streamed from the checkpoint. trust_remote_code:
    None takes what download recorded (paths.remote_code_allowed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.evaluation.layer_streaming import streamed_model
    from tasks.sources.checkpoint import Checkpoint

    if trust_remote_code is None:
        trust_remote_code = paths.remote_code_allowed(hf_dir)
    if layers is None and Checkpoint(hf_dir).float32_bytes() <= resident_bytes:
        options = {"attn_implementation": attention} if attention else {}
        return AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code, **options
        ).eval()
    return streamed_model(hf_dir, attention, layers, trust_remote_code, dtype)


def torch_needs(size: resources.ModelSize, logits_rows: int) -> resources.Needs:
    """PyTorch in float32 (tasks/evaluation/torch_decoder.py): the whole model when it fits the
    resident budget, else the vocabulary matrices and one decoder layer at a time; and a window's
    logits, about eight times over (the model's output, log-sum-exp's temporaries, the top-k
    search's negated copy and its int64 indices: the reference stage of Qwen2.5 0.5B, with its
    151,936-token vocabulary, peaked at 3.83 GB, where seven copies estimated 3.64)."""
    logits = 8 * size.logits(logits_rows)
    if size.total <= RESIDENT_BYTES:
        basis = f"PyTorch holding the {resources.amount(size.total)} float32 model"
        return resources.Needs(resources.BASE_MEMORY + size.total + logits, 1e6, basis)
    basis = (
        f"PyTorch reading one {resources.amount(size.layer)} layer at a time beside "
        f"{resources.amount(size.vocabulary)} of vocabulary matrices"
    )
    return resources.Needs(resources.BASE_MEMORY + size.vocabulary + 2 * size.layer + logits, 1e6, basis)


class TorchDecoder:
    """attention: "eager" is the family's own definition (the reference: SDPA drops Gemma 2's
    softcapping); None keeps transformers' default, the fast path a PyTorch user gets (the bench
    baseline). layers: only those decoder layers (see load_causal_lm)."""

    def __init__(
        self,
        hf_dir: Path,
        threads: int = 0,
        attention: str | None = None,
        layers: list[int] | None = None,
        resident_bytes: int = RESIDENT_BYTES,
    ):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = load_causal_lm(hf_dir, attention, layers, resident_bytes)
        self.vocab_size = self.model.config.get_text_config().vocab_size
        # Most forwards can skip the logits of positions nobody reads; some (Bloom's) take no such argument.
        self.keeps_last = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def empty_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    def forward(self, token_ids, cache, last_only: bool = False):
        ids = self.torch.as_tensor(np.asarray(token_ids, dtype=np.int64).reshape(1, -1))
        with self.torch.inference_mode():
            keep = {"logits_to_keep": int(last_only)} if self.keeps_last else {}
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, **keep)
        logits = out.logits[0, -1:] if last_only else out.logits[0]
        return logits.float().numpy(), out.past_key_values
