"""Why a batched decode step's attention does not amortize as its matmuls do: onnxruntime's
GroupQueryAttention alone, at real models' attention shapes, as the variants run it (rotary inside,
one KV buffer per layer shared by past and present, each row attending to its own length).

A matmul reads its weights once for every row of a step (benchmarks/kernels.py: x1.1-1.2 at 8
rows), but each row of a step has a KV cache of its own, so attention's work grows with the rows
whatever the kernel. What is left to win is the cost per row: this times a decode step of 1, 4 and
8 rows at several context lengths, and a one-row prompt's prefill, with the float cache the variants
keep by default and the int8 cache `kv_cache: int8` stores (static per-channel scales, onnxruntime
1.32's quantized GroupQueryAttention), so the choice of cache is a measured trade; and the same node
on ortforge's kernel (ortforge/csrc, `attention: ortforge`), in a session on the same threads, so
the choice of kernel is one too.

Each configuration cycles through as many distinct KV buffers as the model has layers, so the runs
read what a whole step reads (each layer its own cache; one small buffer run again and again would
sit in the CPU's cache, and a long context's would not). In a real step the weights stream between
the layers too, so this is a kernel's view, not a step's. Keys and values are drawn
at the scale of real ones (unit normal; int8 codes over their range, at a scale of 0.05): keys a
hundred times larger made softmax underflow into denormal floats, and a float step ran x2.3 slower.

    python benchmarks/attention.py [--models smollm2-135m,gemma3-270m,llama-3.2-1b] [--rows 1,4,8]
                                   [--contexts 128,1024] [--prompts 128,1024] [--rounds 3]
                                   [--kernels onnxruntime,ortforge]

Writes benchmarks/results/attention.json and prints the table. Needs no build; ortforge's kernel
needs a C compiler (--kernels onnxruntime without one).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from benchmarks.kernels import ratio  # noqa: E402  (a step's time at some rows over one row's)
from ortforge import custom_ops  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.quantization import kv_cache  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
# (num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers) from each model's config.json.
SHAPES = {
    "smollm2-135m": (9, 3, 64, 30),
    "gemma3-270m": (4, 1, 256, 18),
    "qwen2.5-0.5b": (14, 2, 64, 24),
    "llama-3.2-1b": (32, 8, 64, 16),
    "llama-3.1-8b": (32, 8, 128, 32),
}
CACHES = {"float": None, "int8": 8}  # kv_cache as params.yaml names it: its stored bits
KERNELS = {"onnxruntime": "com.microsoft", "ortforge": custom_ops.DOMAIN}  # attention: as params.yaml names it
TIMED_SECONDS = 1.0


def attention_model(
    heads: int, kv_heads: int, head_dim: int, bits: int | None, kernel: str = "onnxruntime", **attributes
) -> bytes:
    """One GroupQueryAttention node as the variants' graphs hold it, its past and present one buffer,
    in the domain of the kernel that runs it (KERNELS); attributes beyond the default ones
    (local_window_size, softcap, scale) as given."""
    from onnx import TensorProto, helper

    stored = TensorProto.INT8 if bits else TensorProto.FLOAT
    info = helper.make_tensor_value_info
    inputs = [
        info("query", TensorProto.FLOAT, ["B", "S", heads * head_dim]),
        info("key", TensorProto.FLOAT, ["B", "S", kv_heads * head_dim]),
        info("value", TensorProto.FLOAT, ["B", "S", kv_heads * head_dim]),
        info("past_key", stored, ["B", kv_heads, "L", head_dim]),
        info("past_value", stored, ["B", kv_heads, "L", head_dim]),
        info("seqlens_k", TensorProto.INT32, ["B", 1]),
        info("total_sequence_length", TensorProto.INT32, []),
        info("cos_cache", TensorProto.FLOAT, ["P", "R"]),  # R: half the rotated channels
        info("sin_cache", TensorProto.FLOAT, ["P", "R"]),
    ]
    outputs = [
        info("output", TensorProto.FLOAT, ["B", "S", heads * head_dim]),
        info("present_key", stored, ["B", kv_heads, "L", head_dim]),
        info("present_value", stored, ["B", kv_heads, "L", head_dim]),
    ]
    names = [i.name for i in inputs]
    attributes = {"num_heads": heads, "kv_num_heads": kv_heads, "do_rotary": 1, "scale": head_dim**-0.5} | attributes
    initializers = []
    if bits:  # the quantized cache's per-channel scales, where tasks/quantization/kv_cache.py puts them
        names += [""] * (kv_cache.V_SCALE_INPUT + 1 - len(names))
        names[kv_cache.K_SCALE_INPUT], names[kv_cache.V_SCALE_INPUT] = "k_scale", "v_scale"
        scale = np.full(kv_heads * head_dim, 0.05, dtype=np.float32)
        dims = [1, kv_heads, 1, head_dim]
        initializers = [helper.make_tensor(n, TensorProto.FLOAT, dims, scale) for n in ("k_scale", "v_scale")]
        attributes |= {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": bits}
    outputs_named = [o.name for o in outputs]
    node = helper.make_node("GroupQueryAttention", names, outputs_named, domain=KERNELS[kernel], **attributes)
    graph = helper.make_graph([node], "attention", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(KERNELS[kernel], 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def bindings(session, shape: tuple[int, int, int], rows: int, new: int, held: int, bits: int | None, count: int):
    """count I/O bindings of a run of `new` tokens in each of `rows` rows holding `held` tokens
    already, each over KV buffers of its own (shared by past and present, as BatchDecoder binds
    them), and those buffers (the bindings view their memory)."""
    import onnxruntime as ort

    heads, kv_heads, head_dim = shape
    rng = np.random.default_rng(rows * 1000 + held)
    room = held + new
    angles = np.outer(np.arange(room), 1e-4 ** (np.arange(head_dim // 2) / (head_dim // 2))).astype(np.float32)
    feeds = {
        "query": rng.standard_normal((rows, new, heads * head_dim), dtype=np.float32),
        "key": rng.standard_normal((rows, new, kv_heads * head_dim), dtype=np.float32),
        "value": rng.standard_normal((rows, new, kv_heads * head_dim), dtype=np.float32),
        "seqlens_k": np.full((rows, 1), room - 1, dtype=np.int32),
        "total_sequence_length": np.array(room, dtype=np.int32),
        "cos_cache": np.cos(angles),
        "sin_cache": np.sin(angles),
    }
    runs, buffers = [], []
    for _ in range(count):
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for kind in ("key", "value"):
            dims = (rows, kv_heads, room, head_dim)
            if bits:
                cache = rng.integers(-127, 128, dims, dtype=np.int8)
            else:
                cache = rng.standard_normal(dims, dtype=np.float32)
            buffer = ort.OrtValue.ortvalue_from_numpy(cache)  # a view of cache's memory: keep cache alive
            binding.bind_ortvalue_input(f"past_{kind}", buffer)
            binding.bind_ortvalue_output(f"present_{kind}", buffer)
            buffers.append(cache)
        binding.bind_output("output")
        runs.append(binding)
    return runs, buffers


def time_runs(session, runs: list) -> float:
    """Median seconds of one run of session, cycling through the runs' bindings (time_calls)."""
    return time_calls([lambda binding=binding: session.run_with_iobinding(binding) for binding in runs])


def time_calls(calls: list) -> float:
    """Median seconds of one call over about TIMED_SECONDS (at least 5 calls), cycling through
    calls, after warm-up calls."""
    for call in calls[:3]:
        call()
    times, deadline = [], time.perf_counter() + TIMED_SECONDS
    while len(times) < 5 or time.perf_counter() < deadline:
        call = calls[len(times) % len(calls)]
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def measure(
    model: str, rows: list[int], contexts: list[int], prompts: list[int], threads: int, rounds: int,
    kernels: tuple[str, ...] = ("onnxruntime",),
) -> dict:  # fmt: skip
    """Microseconds per layer of each kernel's decode steps over each cache (by context, then rows)
    and prefills (by prompt tokens), as a model's one attention layer runs them: the median over
    rounds, each round timing every configuration once (so a slow spell of the machine touches them
    all alike)."""
    import onnxruntime as ort

    heads, kv_heads, head_dim, layers = SHAPES[model]
    shape = (heads, kv_heads, head_dim)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if "ortforge" in kernels:
        options.register_custom_ops_library(str(custom_ops.library()))
    configurations, kept = {}, []  # (kernel, cache, figure, length, rows) -> (session, bindings); their buffers
    for kernel in kernels:
        for cache, bits in CACHES.items():
            graph = attention_model(*shape, bits, kernel)
            session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
            wanted = [("decode_us_per_layer", context, r, 1, context) for context in contexts for r in rows]
            wanted += [("prefill_us_per_layer", tokens, 1, tokens, 0) for tokens in prompts]
            for figure, length, r, new, held in wanted:
                runs, buffers = bindings(session, shape, r, new, held, bits, layers)
                configurations[(kernel, cache, figure, str(length), str(r))] = (session, runs)
                kept.append(buffers)
    times = {key: [] for key in configurations}
    for _ in range(rounds):
        for key, (session, runs) in configurations.items():
            times[key].append(time_runs(session, runs) * 1e6)
    found = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": layers, "kernels": {}}
    for (kernel, cache, figure, length, r), measured in times.items():
        empty = {"decode_us_per_layer": {}, "prefill_us_per_layer": {}}
        figures = found["kernels"].setdefault(kernel, {}).setdefault(cache, empty)
        if figure == "decode_us_per_layer":
            figures[figure].setdefault(length, {})[r] = float(np.median(measured))
        else:
            figures[figure][length] = float(np.median(measured))
    print(f"  {model}: {found['kernels']}", flush=True)
    return found


def onnxruntime_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def table(report: dict) -> str:
    """One row per model, context, kernel and cache: decode microseconds per layer at each row count, the
    growth to the most rows, and the prefill times (one-row prompts) beside it."""
    rows, prompts, most = report["rows"], report["prompts"], max(report["rows"])
    head = "| model (heads / kv heads x dim) | kernel | cache | context | " + " | ".join(
        f"step us, {r} row{'s' * (r > 1)}" for r in rows
    )
    head += f" | x at {most} rows | " + " | ".join(f"prefill {t} tokens, us" for t in prompts) + " |"
    lines = [head, "|---|---|---|---|" + "---|" * (len(rows) + 1 + len(prompts))]

    def size(item):
        return item[1]["heads"] * item[1]["head_dim"] * item[1]["layers"]

    for model, found in sorted(report["models"].items(), key=size):  # the smallest first; the rest as asked
        label = f"{model} ({found['heads']} / {found['kv_heads']} x {found['head_dim']})"
        for context in map(str, report["contexts"]):
            for kernel, caches in found["kernels"].items():
                for cache in [c for c in CACHES if c in caches]:
                    figures = caches[cache]
                    times = figures["decode_us_per_layer"][context]
                    cells = " | ".join(f"{times[str(r)]:,.0f}" for r in rows)
                    grown = ratio(times, most)
                    prefill = " | ".join(f"{figures['prefill_us_per_layer'][str(t)]:,.0f}" for t in prompts)
                    lines.append(
                        f"| {label} | {kernel} | {cache} | {int(context):,} | {cells} | "
                        f"{'-' if grown is None else f'x{grown:.2f}'} | {prefill} |"
                    )
    return "\n".join(lines)


def compiler_version() -> str:
    from benchmarks import attention_kernel  # it imports this module

    return attention_kernel.compiler_version()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m,llama-3.2-1b")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--contexts", default="128,1024", help="tokens each row holds before the step")
    parser.add_argument("--prompts", default="128,1024", help="one-row prompts to prefill")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3, help="every configuration timed once per round")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="whose GroupQueryAttention runs the node")
    args = parser.parse_args(argv)
    models, kernels = args.models.split(","), tuple(args.kernels.split(","))
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        raise SystemExit(f"error: unknown model {unknown[0]}; pick from {', '.join(SHAPES)}")
    if set(kernels) - set(KERNELS):
        raise SystemExit(f"error: unknown kernel in --kernels {args.kernels}; pick from {', '.join(KERNELS)}")
    if "ortforge" in kernels:
        try:
            custom_ops.library()
        except custom_ops.KernelUnavailable as error:
            raise SystemExit(f"error: {error} (or pass --kernels onnxruntime)") from None
    numbers = {key: [int(n) for n in getattr(args, key).split(",")] for key in ("rows", "contexts", "prompts")}
    if 1 not in numbers["rows"]:
        raise SystemExit("error: --rows must include 1 (each step's growth is against one row)")
    report = {
        "provenance": provenance.record(provenance.command("attention.py", argv)),
        "onnxruntime": onnxruntime_version(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "rounds": args.rounds,
        "compiler": compiler_version() if "ortforge" in kernels else None,
        **numbers,
        "models": {
            m: measure(m, numbers["rows"], numbers["contexts"], numbers["prompts"], args.threads, args.rounds, kernels)
            for m in models
        },
    }
    print(table(report))
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "attention.json", report)
    print(f"wrote {RESULTS / 'attention.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
