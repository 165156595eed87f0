"""Would a hand-written attention kernel, the custom op issue 23 names, beat onnxruntime's?
ortforge/csrc/gqa.c (ortforge/custom_ops.py's library, built for this machine), against onnxruntime 1.32's
GroupQueryAttention, one thread each, at real models' attention shapes; each configuration first
checks that both give the same output and cache.

The configurations are benchmarks/attention.py's: decode steps of some rows at some contexts, and
one-row prefills, the runs cycling through one KV buffer per layer of the model (float cache). One
thread each, because ctypes runs the kernel on the calling thread: this compares the work per
thread. A custom op would hand its (row, kv head) tasks to onnxruntime's pool, as onnxruntime's
kernel hands out its (row, head) ones.

    python benchmarks/attention_kernel.py [--models smollm2-135m,gemma3-270m,llama-3.2-1b]
                                          [--rows 1,8] [--contexts 128,1024] [--prompts 128,1024]
                                          [--rounds 3]

Writes benchmarks/results/attention_kernel.json and prints the table. Needs a C compiler (cc, or
$CC), no build.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import attention, provenance  # noqa: E402
from ortforge import custom_ops  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
QUERY_BLOCK = 32  # a task's queries in a prompt (ort_op.c's QUERY_BLOCK too); a step has one
ENGINES = ("onnxruntime", "hand_written")


def compiler() -> str:
    try:
        return custom_ops.compiler()
    except custom_ops.KernelUnavailable as error:
        raise SystemExit(f"error: {error}") from None


class GqaShape(ctypes.Structure):
    """ortforge/csrc/gqa.h's GqaShape, field for field."""

    _fields_ = [
        *[(name, ctypes.c_int64) for name in ("batch", "seq", "heads", "kv_heads", "head")],
        *[(name, ctypes.c_int64) for name in ("past_len", "present_len", "rotary_half", "window", "query_block")],
        ("first_prompt", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("seqlens_k", ctypes.c_void_p),
        *[(name, ctypes.c_void_p) for name in ("query", "key", "value", "past_key", "past_value")],
        *[(name, ctypes.c_void_p) for name in ("cos_cache", "sin_cache", "output", "present_key", "present_value")],
        *[(name, ctypes.c_void_p) for name in ("k_scale", "v_scale")],
    ]


def load(library: Path) -> ctypes.CDLL:
    kernel = ctypes.CDLL(str(library))
    kernel.gqa_serial.argtypes = [ctypes.POINTER(GqaShape)]
    kernel.gqa_serial.restype = ctypes.c_int
    kernel.gqa_scratch_floats.argtypes = [ctypes.POINTER(GqaShape)]
    kernel.gqa_scratch_floats.restype = ctypes.c_size_t
    return kernel


def inputs(shape: tuple[int, int, int], lengths: list[int], new: int, room: int, rng, rotary_half: int = 0) -> dict:
    """One call's arrays: rows whose total lengths (new tokens included) are `lengths`, in KV
    buffers of `room` tokens holding unit-normal keys and values (attention.py says why that scale)."""
    heads, kv_heads, head_dim = shape
    rows, half = len(lengths), rotary_half or head_dim // 2
    angles = np.outer(np.arange(room), 1e-4 ** (np.arange(half) / half)).astype(np.float32)
    normal = rng.standard_normal
    return {
        "query": normal((rows, new, heads * head_dim), dtype=np.float32),
        "key": normal((rows, new, kv_heads * head_dim), dtype=np.float32),
        "value": normal((rows, new, kv_heads * head_dim), dtype=np.float32),
        "past_key": normal((rows, kv_heads, room, head_dim), dtype=np.float32),
        "past_value": normal((rows, kv_heads, room, head_dim), dtype=np.float32),
        "seqlens_k": np.array([[n - 1] for n in lengths], dtype=np.int32),
        "total_sequence_length": np.array(max(lengths), dtype=np.int32),
        "cos_cache": np.cos(angles),
        "sin_cache": np.sin(angles),
    }


def onnxruntime_call(session, arrays: dict):
    """A run of session over arrays, past and present one buffer (as BatchDecoder binds them); the
    output array it fills."""
    import onnxruntime as ort

    binding = session.io_binding()
    binding.bind_output("output")  # first: get_outputs()[0]
    for name in ("query", "key", "value", "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"):
        binding.bind_cpu_input(name, arrays[name])
    for kind in ("key", "value"):
        buffer = ort.OrtValue.ortvalue_from_numpy(arrays[f"past_{kind}"])
        binding.bind_ortvalue_input(f"past_{kind}", buffer)
        binding.bind_ortvalue_output(f"present_{kind}", buffer)

    def run():
        session.run_with_iobinding(binding)
        return arrays  # referenced here, so the bound memory lives as long as the call

    return run, lambda: binding.get_outputs()[0].numpy()


def kernel_call(
    kernel: ctypes.CDLL, arrays: dict, heads: int, window: int = -1, softcap: float = 0.0, scale: float = 0.0
):
    """A call of the hand-written kernel over arrays, in place as onnxruntime's; the output array."""
    rows, new, width = arrays["query"].shape
    _, kv_heads, room, head_dim = arrays["past_key"].shape
    output = np.zeros((rows, new, width), dtype=np.float32)
    pointer = {name: array.ctypes.data for name, array in arrays.items()}
    shape = GqaShape(
        rows, new, heads, kv_heads, head_dim, room, room, arrays["cos_cache"].shape[1], window, QUERY_BLOCK,
        int(new == int(arrays["total_sequence_length"])), scale, softcap, pointer["seqlens_k"],
        pointer["query"], pointer["key"], pointer["value"], pointer["past_key"], pointer["past_value"],
        pointer["cos_cache"], pointer["sin_cache"], output.ctypes.data, pointer["past_key"], pointer["past_value"],
    )  # fmt: skip

    def call():
        status = kernel.gqa_serial(ctypes.byref(shape))
        if status != 0:
            raise RuntimeError(
                f"gqa_serial failed with {status} (1: out of memory; 2: head {head_dim} no multiple of 16)"
            )
        return output, arrays  # referenced here: shape holds only their addresses

    return call, lambda: output


def results_of(call, output, arrays: dict) -> list[np.ndarray]:
    """One call's output and the caches it wrote in place: [output, past_key, past_value]."""
    call()
    return [output(), arrays["past_key"], arrays["past_value"]]


def onnxruntime_results(session, arrays: dict) -> list[np.ndarray]:
    """A run of session over a copy of arrays, past and present one buffer: results_of it."""
    copies = {name: array.copy() for name, array in arrays.items()}
    return results_of(*onnxruntime_call(session, copies), copies)


def largest_difference(theirs: list[np.ndarray], ours: list[np.ndarray]) -> float:
    """In float64: an int8 cache's codes subtracted as int8 would wrap (127 - -1 is -128)."""
    return max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(theirs, ours, strict=True))


def difference(session, kernel, arrays: dict, heads: int, **attributes) -> float:
    """Largest absolute difference between onnxruntime's and the kernel's output and caches after
    one call each, from identical copies of arrays."""
    ours = {name: array.copy() for name, array in arrays.items()}
    return largest_difference(
        onnxruntime_results(session, arrays), results_of(*kernel_call(kernel, ours, heads, **attributes), ours)
    )


def call_overheads_us(session_options, kernel) -> dict:
    """What calling costs each side beyond its kernel: a bound run of a one-Identity graph (Python
    to onnxruntime's executor and back), and a ctypes call of a function that returns at once.
    measure() takes them off, so the two columns compare kernels, not ways of calling them."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "call",
        [value("x", TensorProto.FLOAT, [1])],
        [value("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    session = ort.InferenceSession(model, session_options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_output("y")
    binding.bind_cpu_input("x", np.zeros(1, dtype=np.float32))
    shape = GqaShape(heads=1, kv_heads=1)
    return {
        "onnxruntime": attention.time_calls([lambda: session.run_with_iobinding(binding)]) * 1e6,
        "hand_written": attention.time_calls([lambda: kernel.gqa_scratch_floats(ctypes.byref(shape))]) * 1e6,
    }


def configurations(rows: list[int], contexts: list[int], prompts: list[int]) -> dict:
    """(figure, length, rows) -> (rows, new tokens, tokens held before), as attention.py times them."""
    found = {("decode_us_per_layer", c, r): (r, 1, c) for c in contexts for r in rows}
    return found | {("prefill_us_per_layer", t, 1): (1, t, 0) for t in prompts}


def measure(model: str, kernel, rows: list[int], contexts: list[int], prompts: list[int], rounds: int) -> dict:
    """Microseconds per layer of both kernels, one thread, per configuration (medians over rounds,
    each round timing every configuration once, less each side's cost of a call), and their largest
    difference."""
    import onnxruntime as ort

    heads, kv_heads, head_dim, layers = attention.SHAPES[model]
    shape = (heads, kv_heads, head_dim)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    model_bytes = attention.attention_model(*shape, None, scale=0.0)  # 0: 1/sqrt(head_dim), both kernels
    session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    calls, worst = {}, 0.0
    for key, (r, new, held) in configurations(rows, contexts, prompts).items():
        per_layer = [inputs(shape, [held + new] * r, new, held + new, rng) for _ in range(layers)]
        worst = max(worst, difference(session, kernel, per_layer[0], heads))
        calls[key] = {
            "onnxruntime": [
                onnxruntime_call(session, {n: a.copy() for n, a in arrays.items()})[0] for arrays in per_layer
            ],
            "hand_written": [kernel_call(kernel, arrays, heads)[0] for arrays in per_layer],
        }
    overheads = call_overheads_us(options, kernel)
    times = {(key, engine): [] for key in calls for engine in ENGINES}
    for _ in range(rounds):
        for key, engines in calls.items():
            for engine in ENGINES:
                times[(key, engine)].append(attention.time_calls(engines[engine]) * 1e6 - overheads[engine])
    found = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": layers}
    found |= {
        "max_abs_difference": worst,
        "call_overhead_us": overheads,
        "decode_us_per_layer": {},
        "prefill_us_per_layer": {},
    }
    for ((figure, length, r), engine), measured in times.items():
        cell = found[figure].setdefault(str(length), {})
        if figure == "decode_us_per_layer":
            cell = cell.setdefault(str(r), {})
        cell[engine] = float(np.median(measured))
    print(f"  {model}: {found}", flush=True)
    return found


def table(report: dict) -> str:
    lines = [
        "| model (heads / kv heads x dim) | run | onnxruntime us | hand-written us | onnxruntime / hand-written |",
        "|---|---|---|---|---|",
    ]

    def row(label: str, what: str, cell: dict) -> str:
        ours, theirs = cell["hand_written"], cell["onnxruntime"]
        return f"| {label} | {what} | {theirs:,.0f} | {ours:,.0f} | x{theirs / ours:.2f} |"

    def size(item):
        return item[1]["heads"] * item[1]["head_dim"] * item[1]["layers"]

    for model, found in sorted(report["models"].items(), key=size):  # the smallest first, as attention.py's
        label = f"{model} ({found['heads']} / {found['kv_heads']} x {found['head_dim']})"
        for context in sorted(found["decode_us_per_layer"], key=int):
            by_rows = found["decode_us_per_layer"][context]
            for r in sorted(by_rows, key=int):
                lines.append(row(label, f"step, {r} row{'s' * (r != '1')}, context {int(context):,}", by_rows[r]))
        for tokens in sorted(found["prefill_us_per_layer"], key=int):
            lines.append(row(label, f"prefill {int(tokens):,} tokens", found["prefill_us_per_layer"][tokens]))
    return "\n".join(lines)


def compiler_version() -> str:
    shown = subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=True)
    return shown.stdout.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m,llama-3.2-1b")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--contexts", default="128,1024", help="tokens each row holds before the step")
    parser.add_argument("--prompts", default="128,1024", help="one-row prompts to prefill")
    parser.add_argument("--rounds", type=int, default=3, help="every configuration timed once per round")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in attention.SHAPES]
    if unknown:
        raise SystemExit(f"error: unknown model {unknown[0]}; pick from {', '.join(attention.SHAPES)}")
    numbers = {key: [int(n) for n in getattr(args, key).split(",")] for key in ("rows", "contexts", "prompts")}
    try:
        kernel = load(custom_ops.library())
    except custom_ops.KernelUnavailable as error:
        raise SystemExit(f"error: {error}") from None
    measured = {
        m: measure(m, kernel, numbers["rows"], numbers["contexts"], numbers["prompts"], args.rounds) for m in models
    }
    report = {
        "provenance": provenance.record(provenance.command("attention_kernel.py", argv)),
        "onnxruntime": attention.onnxruntime_version(),
        "compiler": compiler_version(),
        "flags": list(custom_ops.FLAGS),
        "threads": 1,
        "rounds": args.rounds,
        **numbers,
        "models": measured,
    }
    print(table(report))
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "attention_kernel.json", report)
    print(f"wrote {RESULTS / 'attention_kernel.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
