"""ortforge runtime: load a built artifact and generate with its KV cache.

Depends on onnxruntime, numpy, tokenizers and (for chat templates) Jinja2 only, so a service that
ships an artifact needs neither torch nor the build tools. Names load on first use, so `ortforge --help` stays instant.
"""

import importlib

_EXPORTS = {
    "Decoder": "ortforge.decoder",
    "KVCache": "ortforge.decoder",
    "IncrementalDetokenizer": "ortforge.generate",
    "TextGenerator": "ortforge.generate",
    "greedy_tokens": "ortforge.greedy",
    "Sampling": "ortforge.sampling",
    "BatchDecoder": "ortforge.batch",
    "Scheduler": "ortforge.scheduler",
    "check_validated": "ortforge.manifest",
    "SessionSettings": "ortforge.session",
    "create_session": "ortforge.session",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ortforge' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
