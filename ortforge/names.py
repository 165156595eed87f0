"""The names of a KV-cache decoder's graph inputs, outputs and dimensions, declared once.

They follow optimum's text-generation-with-past export and onnxruntime-genai, so an artifact built
here runs in their runtimes too, and theirs in ours.
"""

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
# Input (0: all positions): compute logits for only the last N positions, as
# transformers' logits_to_keep does. Generation keeps 1: a 128-token prefill skips 127 rows of the
# vocabulary projection.
LOGITS_TO_KEEP = "logits_to_keep"

BATCH = "batch_size"
PAST_SEQUENCE = "past_sequence_length"

MODEL_FILE = "model.onnx"
RUNTIME_SUFFIX = ".runtime.json"  # <variant>.runtime.json beside the variant: the bench stage's tuned settings
MANIFEST_FILE = "manifest.json"
VALIDATION_SUFFIX = ".valid.json"
DEPLOYMENT_KEY = "deployment"  # the stamp's record of the runs validate proved (ortforge.decoder.Proven)

# Model metadata (ONNX metadata_props) the quantize stage writes for the runtime.
KV_LAYOUT_KEY = "ortforge.kv_layout"  # "shared": one buffer per layer updated in place; else chained
KV_SHARED = "shared"
HEAD_DIM_KEY = "ortforge.head_dim"  # the KV cache's head size, which genai graphs leave symbolic
CONTEXT_LENGTH_KEY = "ortforge.context_length"  # positions the model takes: prompt + new tokens must fit
# Bits per cached key or value when GroupQueryAttention stores the cache quantized (8: int8, 4: two
# values packed per uint8 along the head); absent: the cache holds floats.
KV_CACHE_BITS_KEY = "ortforge.kv_cache_bits"
# How a graph holds its weights: "checkpoint" when its initializers are the source checkpoint's
# tensors by name and its linears are named after the model's modules (tasks/graphs/decoder_graph.py).
WEIGHTS_SOURCE_KEY = "ortforge.weights_from"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"


def past_key(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key(layer: int) -> str:
    return f"present.{layer}.key"


def present_value(layer: int) -> str:
    return f"present.{layer}.value"


def past_names(num_layers: int) -> list[str]:
    return [name for i in range(num_layers) for name in (past_key(i), past_value(i))]


def present_names(num_layers: int) -> list[str]:
    return [name for i in range(num_layers) for name in (present_key(i), present_value(i))]
