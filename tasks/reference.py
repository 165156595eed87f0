"""Measure the original PyTorch model once per model, so each variant is validated against the same
figures without loading torch again: on each evaluation text, the perplexity and every scored
position's most likely tokens and their logits, and greedy tokens from a prompt in the text.

PyTorch runs the family's own (eager) attention: the definition of the model, not a fast path. A
model larger than torch_decoder.RESIDENT_BYTES in float32 runs with its decoder layers read from
the checkpoint as they run: the same figures in the memory of one layer.

Reads artifacts/<model>/hf and params.yaml `validate.eval`; writes artifacts/<model>/reference
(reference.npz with the exact inputs and outputs, reference.json with the scalar figures).
"""

from __future__ import annotations

import logging
from pathlib import Path

from tasks.core import paths, resources
from tasks.core.files import atomic_output_dir
from tasks.core.params import EvalConfig
from tasks.core.stage import StageError, stage_cli
from tasks.evaluation.metrics import (
    Reference,
    TextReference,
    check_fits_context,
    greedy,
    score_reference,
    sequence_length,
    text_ids,
)
from tasks.evaluation.torch_decoder import torch_needs
from tasks.graphs import architecture

log = logging.getLogger(__name__)


def run(cfg: EvalConfig, hf_dir: Path, out_dir: Path) -> Reference:
    from tasks.evaluation.torch_decoder import TorchDecoder

    tokenizer_json = hf_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise StageError(f"{hf_dir} has no tokenizer.json; run the download stage first (dvc repro download@<model>)")
    arch = architecture.read(hf_dir)
    check_fits_context(cfg, arch.context_length)
    inputs = {Path(text).name: text_ids(cfg, text, tokenizer_json) for text in cfg.texts}
    sequence = sequence_length(cfg, arch.context_length)
    decoder = TorchDecoder(hf_dir, attention="eager")
    texts, perplexity = {}, {}
    for name, (ids, prompt) in inputs.items():
        log.info("scoring %d tokens of %s with PyTorch (sequences of %d)", len(ids) - 1, name, sequence)
        scores, perplexity[name] = score_reference(decoder, ids, cfg, sequence)
        texts[name] = TextReference(
            ids=ids, greedy_prompt=prompt, greedy_tokens=greedy(decoder, prompt, cfg.greedy_steps), **scores
        )
    reference = Reference(texts, perplexity, sequence)
    with atomic_output_dir(out_dir) as tmp:
        reference.save(tmp, {"text_paths": [Path(text).as_posix() for text in cfg.texts]})
    log.info("reference perplexity %s; wrote %s", {k: round(v, 3) for k, v in perplexity.items()}, out_dir)
    return reference


def needs(a) -> resources.Needs:
    return torch_needs(resources.ModelSize.of(a.paths["hf"]), a.params.validation.eval.window)


def main(argv: list[str] | None = None) -> int:
    flags = {"hf": paths.hf_dir, "out": paths.reference_dir}
    return stage_cli(
        "reference",
        __doc__,
        flags,
        lambda a: run(a.params.validation.eval, a.paths["hf"], a.paths["out"]),
        argv,
        needs=needs,
    )


if __name__ == "__main__":
    raise SystemExit(main())
