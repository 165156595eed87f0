"""Measure the original PyTorch model once per model, so each variant is validated against the same
figures without loading torch again: perplexity on the fixed text, logits on seeded random tokens,
and greedy tokens.

Reads artifacts/<model>/hf and params.yaml `validate.eval`; writes artifacts/<model>/reference
(reference.npz with the exact inputs and outputs, reference.json with the scalar figures).
"""

from __future__ import annotations

import logging
from pathlib import Path

from tasks import paths
from tasks.evaluation import Reference, eval_inputs, full_pass_logits, greedy, perplexity
from tasks.files import atomic_output_dir
from tasks.params import EvalConfig
from tasks.stage import StageError, stage_cli

log = logging.getLogger(__name__)


def run(cfg: EvalConfig, hf_dir: Path, out_dir: Path) -> Reference:
    from tasks.torch_decoder import TorchDecoder

    if not (hf_dir / "tokenizer.json").is_file():
        raise StageError(f"{hf_dir} has no tokenizer.json; run the download stage first (dvc repro download@<model>)")
    decoder = TorchDecoder(hf_dir)
    inputs = eval_inputs(cfg, hf_dir / "tokenizer.json", decoder.vocab_size)
    log.info("scoring %d tokens of %s with PyTorch", len(inputs.text_ids) - 1, cfg.text)
    reference = Reference(
        text_ids=inputs.text_ids,
        random_ids=inputs.random_ids,
        random_logits=full_pass_logits(decoder, inputs.random_ids),
        greedy_prompt=inputs.greedy_prompt,
        greedy_tokens=greedy(decoder, inputs.greedy_prompt, cfg.greedy_steps),
        perplexity=perplexity(decoder, inputs.text_ids, cfg.window),
    )
    with atomic_output_dir(out_dir) as tmp:
        reference.save(tmp, {"text": cfg.text.as_posix()})
    log.info("reference perplexity %.3f; wrote %s", reference.perplexity, out_dir)
    return reference


def main(argv: list[str] | None = None) -> int:
    flags = {"hf": paths.hf_dir, "out": paths.reference_dir}
    return stage_cli(
        "reference", __doc__, flags, lambda a: run(a.params.validation.eval, a.paths["hf"], a.paths["out"]), argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
