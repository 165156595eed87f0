"""Which constrained-decoding library keeps `response_format` replies to their schema fastest on
the served model's tokenizer: llguidance and outlines-core (both on PyPI, neither needs torch;
xgrammar does). For each library and schema: the one-time cost (the tokenizer's preparation, the
schema's compilation) and a decode step's cost (the mask of allowed tokens, as a numpy array the
sampler can use, then advancing by the chosen token), over the tokens of a reply that meets the
schema, in compact JSON (the layout the server's grammar fixes).

Writes benchmarks/results/structured.json and prints the table. Needs `dvc repro` first (it reads
the variant's tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from ortforge.structured import FIXED_WHITESPACE  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "status", "items", "note"],
    "additionalProperties": False,
}
CASES = {
    "person": (
        PERSON,
        {"name": "Ada Lovelace", "age": 36, "languages": ["English", "French", "the Analytical Engine's"]},
    ),
    "order": (
        ORDER,
        {
            "id": "ABC-1234",
            "status": "shipped",
            "items": [{"sku": "kettle-2l", "quantity": 1}, {"sku": "mug", "quantity": 4}],
            "note": None,
        },
    ),
}


def _timed(work) -> tuple[float, object]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def byte_tokens(tokenizer_json: str) -> tuple[dict[bytes, list[int]], int]:
    """Every non-special token as the bytes it stands for (GPT-2's byte-level alphabet undone),
    and the vocabulary's size: what outlines-core's Vocabulary takes."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    to_byte = {chr(b): b for b in printable}
    to_byte.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in printable)})
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    found: dict[bytes, list[int]] = {}
    for text, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if text in special:
            continue
        raw = bytes(to_byte[c] for c in text) if all(c in to_byte for c in text) else text.encode("utf-8")
        found.setdefault(raw, []).append(token_id)
    return found, tokenizer.get_vocab_size(with_added_tokens=True)


def llguidance_engine(tokenizer_json: str, eos: int):
    import llguidance

    seconds, tokenizer = _timed(lambda: llguidance.LLTokenizer(tokenizer_json, eos_token=[eos]))

    def compile_schema(schema: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=FIXED_WHITESPACE)
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def step(matcher, token: int) -> np.ndarray:
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(mask, bitorder="little").astype(bool)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")
        return allowed

    return seconds, compile_schema, step


def outlines_engine(tokenizer_json: str, eos: int):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tokens, size = byte_tokens(tokenizer_json)
    seconds, vocabulary = _timed(lambda: Vocabulary(eos, tokens))
    words = (size + 31) // 32

    def compile_schema(schema: dict):
        return Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))

    def step(guide, token: int) -> np.ndarray:
        mask = np.zeros(words, dtype=np.int32)
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)
        guide.advance(token)
        return allowed

    return seconds, compile_schema, step


ENGINES = {"llguidance": llguidance_engine, "outlines-core": outlines_engine}


def measure(engine: str, tokenizer_json: str, eos: int, encode, rounds: int) -> dict:
    setup, compile_schema, step = ENGINES[engine](tokenizer_json, eos)
    result = {"tokenizer_setup_s": setup, "cases": {}}
    for name, (schema, value) in CASES.items():
        compiles, steps = [], []
        ids = encode(json.dumps(value, separators=(",", ":")))
        for _ in range(rounds):
            seconds, matcher = _timed(lambda schema=schema: compile_schema(schema))
            compiles.append(seconds)
            for token in ids:
                seconds, allowed = _timed(lambda matcher=matcher, token=token: step(matcher, token))
                if not allowed[token]:
                    raise RuntimeError(f"{engine} did not allow token {token} of a valid {name}")
                steps.append(seconds)
        result["cases"][name] = {
            "compile_ms_median": 1e3 * statistics.median(compiles),
            "step_us_median": 1e6 * statistics.median(steps),
            "step_us_p95": 1e6 * float(np.percentile(steps, 95)),
            "steps": len(steps),
        }
    return result


def table(report: dict) -> str:
    rows = [
        "| library | tokenizer setup ms | schema | compile ms | step µs p50 / p95 |",
        "|---|---|---|---|---|",
    ]
    for engine, found in report["engines"].items():
        for name, case in found["cases"].items():
            rows.append(
                f"| {engine} {found['version']} | {found['tokenizer_setup_s'] * 1e3:.0f} | {name} | "
                f"{case['compile_ms_median']:.1f} | {case['step_us_median']:.0f} / {case['step_us_p95']:.0f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from importlib.metadata import version

    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variant", default="int4")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    folder, measured = provenance.current_variant(args.model, args.variant)
    tokenizer_json = (folder / "tokenizer.json").read_text(encoding="utf-8")
    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    report = {
        "provenance": provenance.record(provenance.command("structured.py", argv), measured, {}),
        "model": args.model,
        "vocabulary": tokenizer.get_vocab_size(with_added_tokens=True),
        "cpus": os.cpu_count(),
        "engines": {},
    }
    for engine in ENGINES:
        found = measure(engine, tokenizer_json, eos, encode, args.rounds)
        found["version"] = version("llguidance" if engine == "llguidance" else "outlines_core")
        report["engines"][engine] = found
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "structured.json", report)
    print(table(report))
    print(f"wrote {RESULTS / 'structured.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
