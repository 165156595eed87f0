"""Mixture-of-experts decode against the dense model of the same active parameter count, at int4.

A token of a MoE model reads its router's choice of experts, not all of them: Qwen3-30B-A3B holds
30.5B parameters and reads 3.3B per token. On a CPU, where decode is bound by the bytes read per
token, its decode should then cost about what a dense model of 3.3B costs, while its disk and memory
are those of 30B. This measures that on the published Qwen3-30B-A3B shape cut to a few layers (the
per-layer cost is what differs; 48 layers would not fit a 16 GB runner at int4 with its float
export), with random weights (benchmarks/random_models.py), beside its dense twin: the same
attention, and one SwiGLU MLP as wide as the routed experts together (8 x 768 = 6,144), so both
read the same weights per token but for the router's 262K.

Both go through ortforge's own exporter and a weight-only int4 recipe (symmetric round to nearest,
block 32, as QMoE's experts are; MoE layers become onnxruntime's QMoE), and each is timed in a
fresh process by the bench stage's measurement code (tasks/measurement/timing.py): greedy decode
after a short prompt, warm-up first.

    python benchmarks/moe_decode.py     # writes benchmarks/results/moe_decode.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance, random_models  # noqa: E402  (the repository on the path first)
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MOE = "qwen3-30b-a3b"
TOKENIZER = REPO / "artifacts" / "smollm2-135m" / "hf"
WORKLOAD = {"threads": 2, "new_tokens": 48, "warmup": 1, "repeats": 3}
PROMPT_TOKENS = 32
VARIANT = "int4 (weight_only, symmetric rtn, block 32)"


def moe_config(layers: int) -> dict:
    return random_models.CONFIGS[MOE] | {"num_hidden_layers": layers}


def dense_twin(config: dict) -> dict:
    """The same model with one dense MLP per layer as wide as the experts a token is routed to."""
    dense = {k: v for k, v in config.items() if not k.startswith(("moe_", "num_experts", "norm_topk", "decoder_sp"))}
    dense.pop("mlp_only_layers", None)
    width = config["num_experts_per_tok"] * config["moe_intermediate_size"]
    return dense | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "intermediate_size": width}


def build_int4(config: dict, folder: Path) -> Path:
    """HF folder -> ortforge's exporter -> weight-only int4 (round to nearest); the variant's folder.

    The graph is written without the export stage's parity run, which holds the float model in
    PyTorch and in onnxruntime at once (14 GB for one layer of this shape): random weights have
    no answer to check, and tests/test_architectures.py shows the MoE graphs equal PyTorch."""
    from tasks import export, quantize
    from tasks.quantization.configs import quantize_config

    hf = random_models.write_model(config, TOKENIZER, folder / "hf")
    atomic_write_json(hf / paths.SOURCE_FILE, {"kind": "random", "model_type": config["model_type"], "seed": 0})
    (folder / "onnx").mkdir(parents=True)
    export.export_ortforge(hf, folder / "onnx", trust_remote_code=False)
    # Symmetric codes everywhere, as QMoE's experts have: the dense MLP is quantized alike.
    cfg = quantize_config(
        method="weight_only", bits=4, block_size=32, algorithm="rtn", zero_point="none", output_algorithm="rtn"
    )
    quantize.run(cfg, folder / "onnx", hf, folder / "int4", {"model": config["model_type"], "variant": "int4"})
    shutil.rmtree(hf)  # gigabytes of random bfloat16 the timing does not read
    shutil.rmtree(folder / "onnx")
    return folder / "int4"


def measure(variant_dir: Path) -> dict:
    from tasks.measurement import timing

    prompt = list(range(100, 100 + PROMPT_TOKENS))
    runs = [timing.in_fresh_process(timing.measure_engine, "onnxruntime", str(variant_dir), prompt, WORKLOAD)]
    size = sum(path.stat().st_size for path in variant_dir.glob("model.onnx*"))
    return timing.summarize(runs, PROMPT_TOKENS, size)


def table(result: dict) -> str:
    """The README's rows: each model's size, weights read per token, and decode figures."""
    lines = [
        "| int4 model | parameters | read per token | size MB | decode tok/s | decode ms p50 / p95 | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {"moe": f"{result['config']} shape, {result['layers']} layers", "dense": "its dense twin"}
    for key in ("moe", "dense"):
        row = result["rows"][key]
        lines.append(
            f"| {names[key]} | {row['parameters'] / 1e9:.2f}B | {row['active_parameters'] / 1e9:.2f}B | "
            f"{row['size_mb']:.0f} | {row['decode_tokens_per_second']:.1f} | "
            f"{row['decode_ms_per_token_p50']:.1f} / {row['decode_ms_per_token_p95']:.1f} | {row['peak_rss_mb']:.0f} |"
        )
    speed, size = result["moe_decode_vs_dense"], result["moe_size_vs_dense"]
    lines += ["", f"MoE decode: x{speed:.2f} of its dense twin's tokens/s, at x{size:.1f} its size."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3, help="decoder layers of each model (default 3)")
    args = parser.parse_args(argv)
    if not (TOKENIZER / "tokenizer.json").is_file():
        parser.error(f"{TOKENIZER} has no tokenizer; build the default model first (bash scripts/build.sh)")
    models = {"moe": moe_config(args.layers)}
    models["dense"] = dense_twin(models["moe"])
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ortforge-moe-decode-") as scratch:
        for name, config in models.items():
            print(f"{name}: building int4 ({random_models.parameter_count(config) / 1e9:.2f}B parameters)", flush=True)
            figures = measure(build_int4(config, Path(scratch) / name))
            rows[name] = {
                "parameters": random_models.parameter_count(config),
                "active_parameters": random_models.active_parameter_count(config),
                **figures,
            }
            print(f"{name}: {figures['decode_tokens_per_second']:.1f} tok/s, {figures['size_mb']:.0f} MB", flush=True)
    found = {
        "provenance": provenance.record(provenance.command("moe_decode.py", argv)),
        "config": MOE,
        "layers": args.layers,
        "workload": WORKLOAD | {"prompt_tokens": PROMPT_TOKENS, "variant": VARIANT},
        "rows": rows,
        "moe_decode_vs_dense": rows["moe"]["decode_tokens_per_second"] / rows["dense"]["decode_tokens_per_second"],
        "moe_size_vs_dense": rows["moe"]["size_mb"] / rows["dense"]["size_mb"],
    }
    atomic_write_json(RESULTS / "moe_decode.json", found)
    speed, size = found["moe_decode_vs_dense"], found["moe_size_vs_dense"]
    print(f"MoE decode x{speed:.2f} of its dense twin's, at x{size:.1f} its size")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
