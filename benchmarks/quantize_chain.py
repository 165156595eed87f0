"""What w8a8's per-token activation quantization costs a decode step, measured without the profiler.

Before each integer matmul, w8a8 quantizes its input per token in six ONNX nodes (Abs, ReduceMax,
Max, Div, QuantizeLinear for the zero points, QuantizeLinear for the codes): half of the graph's
nodes, and under onnxruntime's profiler a third of a 1-row step (step_profile.json). Would one
fused node per matmul pay for a kernel of our own? This builds a timing stand-in of the variant
in a scratch folder where each chain is one DynamicQuantizeLinear (one vectorized pass, one node:
the shape of a fused per-row op; per-tensor, so its logits differ and it is never served), and
times both graphs' 128-token prefill and batched steps with 1, 4 and 8 rows, each in its own
fresh process with the settings bench chose for the variant, interleaved over rounds.

    python benchmarks/quantize_chain.py [--model smollm2-135m] [--variant w8a8] [--rounds 3]

Writes benchmarks/results/quantize_chain.json; scripts/readme_figures.py summarizes it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402
from ortforge.names import MODEL_FILE  # noqa: E402
from tasks.bench import prompt_ids  # noqa: E402
from tasks.core import paths  # noqa: E402
from tasks.core.files import atomic_write_json  # noqa: E402
from tasks.measurement.timing import in_fresh_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ROWS = (1, 4, 8)
PROMPT_TOKENS = 128
CODES = "/per_token/codes"  # the suffix of a chain's last output (tasks/quantization/per_token.py)
CHAIN = ("abs", "peak", "range", "scale", "zeros")  # the chain's other outputs, in order
GRAPHS = ("six nodes (built)", "one node (stand-in)")


def one_node_graph(folder: Path, out: Path) -> int:
    """Write folder's model with each per-token chain replaced by one DynamicQuantizeLinear into
    out (its other files linked); how many chains were replaced. The matmul takes the new zero
    point and the scaling Mul the new scale (a scalar, which broadcasts like the per-row one)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    made_by = {output: node for node in model.graph.node for output in node.output}
    chains = {node.input[0] for node in model.graph.node if node.output and node.output[0].endswith(CODES)}
    dropped = {id(made_by[f"{x}/per_token/{name}"]) for x in chains for name in CHAIN}
    nodes = []
    for node in model.graph.node:
        if node.output and node.output[0].endswith(CODES):
            x = node.input[0]
            codes, scale, zero = node.output[0], f"{x}/per_token/scale", f"{x}/per_token/zero"
            nodes.append(helper.make_node("DynamicQuantizeLinear", [x], [codes, scale, zero]))
        elif id(node) not in dropped:
            if node.op_type == "MatMulIntegerToFloat" and node.input[0].endswith(CODES):
                node.input[4] = node.input[0][: -len(CODES)] + "/per_token/zero"
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != MODEL_FILE:
            _link_or_copy(item, out / item.name)
    onnx.save(model, str(out / MODEL_FILE))
    return len(chains)


def _link_or_copy(source: Path, dest: Path) -> None:
    """A hard link (onnxruntime refuses external data reached through a symlink out of the model's
    folder); a copy across file systems."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def time_graph(folder: str, settings_from: str, prompts: list[list[int]], steps: int) -> dict:
    """Run in a fresh process: the 128-token prefill's and each row count's step time, medians (ms)."""
    from ortforge.batch import BatchDecoder
    from ortforge.session import SessionSettings, create_session

    # the runtime's own session: it registers ortforge's kernel, which w8a8_attn's graph names
    session = create_session(Path(folder), SessionSettings.for_artifact(Path(settings_from)))
    batch = BatchDecoder(session, max(ROWS), row_tokens=max(map(len, prompts)) + steps)
    prefills = []
    for _ in range(4):  # the first is warm-up
        started = time.perf_counter()
        batch.prefill(0, prompts[0])
        prefills.append(time.perf_counter() - started)
        batch.release(0)
    found = {"prefill_ms": float(np.median(prefills[1:])) * 1e3}
    for rows in ROWS:
        for row in range(rows):
            batch.prefill(row, prompts[row])
        tokens, times = {row: prompts[row][-1] for row in range(rows)}, []
        for _ in range(steps):
            started = time.perf_counter()
            logits = batch.step(tokens)
            times.append(time.perf_counter() - started)
            tokens = {row: int(values.argmax()) for row, values in logits.items()}
        for row in range(rows):
            batch.release(row)
        found[f"step_{rows}_ms"] = float(np.median(times[2:])) * 1e3  # the first steps warm up
    return found


def medians(rounds: list[dict]) -> dict:
    return {key: float(np.median([figures[key] for figures in rounds])) for key in rounds[0]}


def table(report: dict) -> str:
    keys = ["prefill_ms", *(f"step_{rows}_ms" for rows in ROWS)]
    lines = [
        "| per-token quantization | nodes in the graph | 128-token prefill ms | "
        + " | ".join(f"step, {rows} row{'s' if rows > 1 else ''} ms" for rows in ROWS)
        + " |",
        "|---|---|---|" + "---|" * len(ROWS),
    ]
    for graph in GRAPHS:
        figures = report["graphs"][graph]
        cells = " | ".join(f"{figures['median'][key]:.2f}" for key in keys)
        lines.append(f"| {graph} | {figures['nodes']} | {cells} |")
    return "\n".join(lines)


def summary(report: dict) -> str:
    built, fused = (report["graphs"][graph]["median"] for graph in GRAPHS)
    parts = ", ".join(
        f"{rows} row{'s' if rows > 1 else ''} x{built[f'step_{rows}_ms'] / fused[f'step_{rows}_ms']:.2f}"
        for rows in ROWS
    )
    return (
        f"- one node per chain instead of six ({report['chains']} chains): a step runs {parts} as fast, "
        f"a 128-token prefill x{built['prefill_ms'] / fused['prefill_ms']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variant", default="w8a8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per number of rows")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    measured = provenance.model_outputs(args.model, [args.variant])
    provenance.require_current(measured)
    built = paths.variant_dir(args.model, args.variant)
    ids = prompt_ids(paths.hf_dir(args.model), REPO / "data" / "eval" / "GPL-3.txt", PROMPT_TOKENS * max(ROWS))
    prompts = [ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(max(ROWS))]  # no shared prefix
    # A fresh process imports the function's module by name: this script's, not __main__.
    from benchmarks import quantize_chain as here

    with tempfile.TemporaryDirectory(prefix="ortforge-chain-") as scratch:
        stand_in = Path(scratch) / args.variant
        chains = one_node_graph(built, stand_in)
        folders = dict(zip(GRAPHS, (built, stand_in), strict=True))
        rounds: dict[str, list[dict]] = {graph: [] for graph in GRAPHS}
        for number in range(args.rounds):
            for graph, folder in folders.items():
                print(f"round {number + 1}/{args.rounds}: {graph}", flush=True)
                rounds[graph].append(in_fresh_process(here.time_graph, str(folder), str(built), prompts, args.steps))
        nodes = {graph: _node_count(folder) for graph, folder in folders.items()}
    report = {
        "provenance": provenance.record(provenance.command("quantize_chain.py", argv), measured),
        "model": args.model,
        "variant": args.variant,
        "cpus": os.cpu_count(),
        "prompt_tokens": PROMPT_TOKENS,
        "chains": chains,
        "graphs": {
            graph: {"nodes": nodes[graph], "median": medians(rounds[graph]), "rounds": rounds[graph]}
            for graph in GRAPHS
        },
    }
    print(table(report))
    print(summary(report))
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "quantize_chain.json", report)
    print(f"wrote {RESULTS / 'quantize_chain.json'}")
    return 0


def _node_count(folder: Path) -> int:
    import onnx

    return len(onnx.load(str(folder / MODEL_FILE), load_external_data=False).graph.node)


if __name__ == "__main__":
    raise SystemExit(main())
