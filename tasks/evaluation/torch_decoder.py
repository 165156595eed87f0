"""The original PyTorch model behind the same forward(token_ids, cache) interface as
ortforge.Decoder, so reference figures and the bench baseline run the same loops as the variants."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class TorchDecoder:
    """attention: "eager" is the family's own definition (the reference: SDPA drops Gemma 2's
    softcapping); None keeps transformers' default, the fast path a PyTorch user gets (the bench
    baseline)."""

    def __init__(self, hf_dir: Path, threads: int = 0, attention: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        options = {"attn_implementation": attention} if attention else {}
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **options).eval()
        self.vocab_size = self.model.config.vocab_size

    def empty_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    def forward(self, token_ids, cache, last_only: bool = False):
        ids = self.torch.as_tensor(np.asarray(token_ids, dtype=np.int64).reshape(1, -1))
        with self.torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=int(last_only))
        return out.logits[0].float().numpy(), out.past_key_values
