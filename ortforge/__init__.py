"""ortforge runtime: load a built artifact and generate with its KV cache.

Depends on onnxruntime, numpy and tokenizers only, so a service that ships an artifact needs
neither torch nor the build tools.
"""

from ortforge.decoder import Decoder, KVCache
from ortforge.generate import IncrementalDetokenizer, TextGenerator, greedy_tokens
from ortforge.manifest import check_validated
from ortforge.session import SessionSettings, create_session

__all__ = [
    "Decoder",
    "IncrementalDetokenizer",
    "KVCache",
    "SessionSettings",
    "TextGenerator",
    "check_validated",
    "create_session",
    "greedy_tokens",
]
