"""Which onnxruntime matmul kernel shares its weight reads across rows: a decode step of R rows
multiplies an R-row activation by every weight matrix, and a prompt piece of T tokens a T-row one.
A step that reads the weights once costs little more at 8 rows than at 1 (decode is memory-bound);
a kernel that walks the weights again per row costs up to 8x.

For the FFN up projection (hidden x intermediate) of real model shapes, each candidate kernel is
timed at 1, 2, 4, 8, 16 and 128 rows, in a graph of as many distinct copies of the matrix as it
takes to outgrow the CPU's last-level cache (so the weights stream from memory, as a whole model's
do; one small matrix run again and again would sit in cache). Candidates: float32 MatMul,
MatMulNBits (4 and 8 bits, accuracy level 0: float activations, 4: int8 activations per block),
DynamicQuantizeLinear + MatMulInteger (int8 weights, int8 activations with one scale per run), and
the per-token int8 matmul the int8_per_token method writes (tasks/quantization/per_token.py: its
own nodes, activations quantized per row in the graph). The activation's quantization runs once,
shared by the copies, as one quantization serves every matmul reading an input in a model.
Random weights: speed does not depend on their values.

    python benchmarks/kernels.py [--models smollm2-135m,llama-3.2-1b,llama-3.1-8b] [--rows 1,2,4,8,16,128]

Writes benchmarks/results/kernels.json and prints the table. Needs no build.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from ortforge.machine import describe  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
# (hidden_size, intermediate_size) from each model's config.json.
SHAPES = {
    "smollm2-135m": (576, 1536),
    "qwen2.5-0.5b": (896, 4864),
    "llama-3.2-1b": (2048, 8192),
    "llama-3.1-8b": (4096, 14336),
}
PER_TOKEN = "MatMulIntegerToFloat int8 (per token)"
STREAMED_BYTES = 128 << 20  # each kernel's weights in all: 4x this machine's 32 MB last-level cache
KERNELS = (
    "MatMul fp32",
    "MatMulNBits 4-bit blk32 acc0",
    "MatMulNBits 4-bit blk32 acc4",
    "MatMulNBits 4-bit blk128 acc4",
    "MatMulNBits 8-bit blk32 acc4",
    "MatMulInteger int8 (dynamic)",
    PER_TOKEN,
)


def weight_bytes(kernel: str) -> float:
    """Bytes a kernel's weights take per element (block scales aside)."""
    return 4.0 if kernel == "MatMul fp32" else 0.5 if "4-bit" in kernel else 1.0


def copies_for(kernel: str, k: int, n: int) -> int:
    """Distinct copies of a k x n matrix whose weights outgrow the cache (an 8B layer is 235 MB in
    float32 by itself: one copy)."""
    return max(1, math.ceil(STREAMED_BYTES / (k * n * weight_bytes(kernel))))


def _weights(kernel: str, k: int, n: int, index: int, rng: np.random.Generator):
    """The initializers and the node computing Y<index> = A x W<index> for one kernel."""
    from onnx import helper, numpy_helper

    out, w = f"Y{index}", f"W{index}"
    if kernel == "MatMul fp32":
        weight = rng.standard_normal((k, n), dtype=np.float32) * 0.02
        return [numpy_helper.from_array(weight, w)], [helper.make_node("MatMul", ["A", w], [out])]
    if kernel.startswith("MatMulNBits"):
        _, width, block, level = kernel.split()
        bits, block_size, accuracy = int(width[0]), int(block[3:]), int(level[3:])
        blocks = math.ceil(k / block_size)
        codes = rng.integers(0, 256, (n, blocks, block_size * bits // 8), dtype=np.uint8)
        scales = (rng.random(n * blocks, dtype=np.float32) * 0.01).astype(np.float32)
        node = helper.make_node(
            "MatMulNBits", ["A", w, f"S{index}"], [out], domain="com.microsoft",
            K=k, N=n, bits=bits, block_size=block_size, accuracy_level=accuracy,
        )  # fmt: skip
        return [numpy_helper.from_array(codes, w), numpy_helper.from_array(scales, f"S{index}")], [node]
    codes = rng.integers(-127, 128, (k, n), dtype=np.int8)
    nodes = [
        helper.make_node("MatMulInteger", ["Aq", w, "Az", "Wz"], [f"I{index}"]),
        helper.make_node("Cast", [f"I{index}"], [f"F{index}"], to=1),
        helper.make_node("Mul", [f"F{index}", "As"], [out]),
    ]
    return [numpy_helper.from_array(codes, w)], nodes


def per_token_graph(k: int, n: int, copies: int, rng: np.random.Generator) -> tuple[list, list]:
    """The initializers and nodes int8_per_token writes for Y<i> = A x W<i>, through its own writer."""
    from onnx import helper

    from tasks.quantization import per_token
    from tasks.quantization.writer import GraphWriter

    model = helper.make_model(helper.make_graph([], "kernel", [], []))
    writer = GraphWriter(model)
    tokens = per_token.TokenQuantizer(writer)
    for index in range(copies):
        weights = rng.standard_normal((k, n), dtype=np.float32) * 0.02
        per_token.write_integer_matmul(writer, tokens, "A", f"Y{index}", f"W{index}", weights)
    return list(model.graph.initializer), list(model.graph.node)


def session(kernel: str, k: int, n: int, copies: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    initializers, nodes = per_token_graph(k, n, copies, rng) if kernel == PER_TOKEN else ([], [])
    if kernel == "MatMulInteger int8 (dynamic)":  # the activation's quantization runs once, shared by the copies
        nodes.append(helper.make_node("DynamicQuantizeLinear", ["A"], ["Aq", "As", "Az"]))
        initializers.append(numpy_helper.from_array(np.array(0, np.int8), "Wz"))
    for index in range(copies if kernel != PER_TOKEN else 0):
        weights, made = _weights(kernel, k, n, index, rng)
        initializers += weights
        nodes += made
    outputs = [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", n]) for i in range(copies)]
    graph = helper.make_graph(
        nodes, "kernel", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])], outputs, initializers
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def time_rows(run, k: int, rows: int, budget_seconds: float = 1.5) -> float:
    """Median seconds of a run with `rows` activation rows, after warm-up, over about budget_seconds."""
    activation = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)
    feed = {"A": activation}
    for _ in range(3):
        run(None, feed)
    times = []
    deadline = time.perf_counter() + budget_seconds
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        started = time.perf_counter()
        run(None, feed)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def measure(model: str, rows: list[int], threads: int) -> dict:
    k, n = SHAPES[model]
    found = {"k": k, "n": n, "kernels": {}}
    for kernel in KERNELS:
        copies = copies_for(kernel, k, n)
        run = session(kernel, k, n, copies, threads).run
        by_rows = {str(r): time_rows(run, k, r) / copies * 1e6 for r in rows}  # microseconds per matrix
        found["kernels"][kernel] = {"copies": copies, "microseconds_per_matrix": by_rows}
        cells = " ".join(f"{by_rows[str(r)]:9.1f}" for r in rows)
        print(f"  {model} {kernel:30s} {cells}", flush=True)
    return found


def ratio(times: dict, rows: int) -> float | None:
    return times[str(rows)] / times["1"] if str(rows) in times and "1" in times else None


def table(report: dict) -> str:
    rows = report["rows"]
    head = "| model (K x N) | kernel | " + " | ".join(f"us at {r} row{'s' * (r > 1)}" for r in rows)
    lines = [head + " | x at 8 rows | per row at 128 |", "|---|---|" + "---|" * (len(rows) + 2)]
    for model, found in sorted(report["models"].items(), key=lambda item: item[1]["k"] * item[1]["n"]):
        for kernel in [k for k in KERNELS if k in found["kernels"]]:
            times = found["kernels"][kernel]["microseconds_per_matrix"]
            eight, wide = ratio(times, 8), times.get("128")
            cells = " | ".join(f"{times[str(r)]:,.0f}" for r in rows)
            lines.append(
                f"| {model} ({found['k']} x {found['n']}) | {kernel} | {cells} | "
                f"{'-' if eight is None else f'{eight:.2f}'} | {'-' if wide is None else f'{wide / 128:,.1f}'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--rows", default="1,2,4,8,16,128")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        raise SystemExit(f"error: unknown model {unknown[0]}; pick from {', '.join(SHAPES)}")
    rows = [int(r) for r in args.rows.split(",")]
    if 1 not in rows:
        raise SystemExit("error: --rows must include 1 (every ratio is against one row)")
    import onnxruntime

    report = {
        "provenance": provenance.record(provenance.command("kernels.py", argv)),
        "onnxruntime": onnxruntime.__version__,
        "machine": describe(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "rows": rows,
        "models": {},
    }
    print(f"microseconds per matrix at {', '.join(map(str, rows))} rows", flush=True)
    for model in models:
        report["models"][model] = measure(model, rows, args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "kernels.json", report)
    print(table(report))
    print(f"wrote {RESULTS / 'kernels.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
