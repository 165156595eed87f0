"""One forward step of a KV-cache decoder graph: feed new tokens plus the cache, get logits and the
grown cache. Knows the graph only by the names in ortforge.names."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ortforge import names

ORT_TO_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@dataclass(frozen=True)
class KVCache:
    """past_key_values.{i}.key|value in layer order, each (batch, kv_heads, length, head_dim)."""

    tensors: tuple[np.ndarray, ...]

    @property
    def length(self) -> int:
        return int(self.tensors[0].shape[2])


class Decoder:
    def __init__(self, session: ort.InferenceSession):
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        self.num_layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
        if self.num_layers == 0 or names.INPUT_IDS not in inputs:
            raise ValueError(
                f"graph inputs {sorted(inputs)} are not a KV-cache decoder: expected "
                f"{names.INPUT_IDS} and {names.past_key(0)}; export with task text-generation-with-past"
            )
        key = inputs[names.past_key(0)]
        self.kv_heads, self.head_dim = int(key.shape[1]), int(key.shape[3])
        self.kv_dtype = ORT_TO_NUMPY[key.type]
        self.uses_position_ids = names.POSITION_IDS in inputs
        self.uses_attention_mask = names.ATTENTION_MASK in inputs
        self._past_names = names.past_names(self.num_layers)
        self._output_names = [names.LOGITS, *names.present_names(self.num_layers)]

    def empty_cache(self) -> KVCache:
        shape = (1, self.kv_heads, 0, self.head_dim)
        return KVCache(tuple(np.zeros(shape, dtype=self.kv_dtype) for _ in self._past_names))

    def forward(self, token_ids: np.ndarray | list[int], cache: KVCache) -> tuple[np.ndarray, KVCache]:
        """Logits (sequence, vocab) for the new tokens, and the cache extended by them."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, -1)
        start, count = cache.length, ids.shape[1]
        feed = {names.INPUT_IDS: ids, **dict(zip(self._past_names, cache.tensors, strict=True))}
        if self.uses_attention_mask:
            feed[names.ATTENTION_MASK] = np.ones((1, start + count), dtype=np.int64)
        if self.uses_position_ids:
            feed[names.POSITION_IDS] = np.arange(start, start + count, dtype=np.int64).reshape(1, -1)
        logits, *present = self.session.run(self._output_names, feed)
        return logits[0].astype(np.float32, copy=False), KVCache(tuple(present))
