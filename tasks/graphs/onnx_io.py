"""Loading and saving ONNX graphs the same way in every stage: weights go to external data once the
graph nears protobuf's 2 GB limit (or always, when asked), and the result always lands as model.onnx
in its folder."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ortforge.names import LOGITS, MODEL_FILE
from tasks.core.errors import StageError

# protobuf cannot serialize 2 GiB; leave room for the graph itself.
EXTERNAL_DATA_ABOVE_BYTES = 1_800_000_000


def initializer_bytes(model) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer) + sum(
        4 * len(t.float_data) for t in model.graph.initializer
    )


def save(model, folder: Path, external_data: bool = False) -> Path:
    """Write model.onnx (plus model.onnx.data when large or external_data) into folder.

    With external data onnxruntime reads each weight straight into its buffer; a single-file model
    is first read and parsed whole, which raises the peak memory of loading it by about its size."""
    # onnxruntime's saver also declares the com.microsoft opset that fused nodes need.
    from onnxruntime.transformers.onnx_model import OnnxModel

    path = Path(folder) / MODEL_FILE
    external = external_data or initializer_bytes(model) > EXTERNAL_DATA_ABOVE_BYTES
    OnnxModel.save(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True)
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.chmod(path.stat().st_mode & 0o777)  # onnx creates it owner-only; readable like the graph
    return path


def load(folder: Path, with_weights: bool = True):
    """The graph in folder/model.onnx; StageError if its external data lies outside folder."""
    import onnx

    try:
        return onnx.load(str(Path(folder) / MODEL_FILE), load_external_data=with_weights)
    except onnx.checker.ValidationError as error:
        # onnx refuses absolute, "..", and symlinked external data paths: an untrusted model must
        # not read files outside its folder.
        raise StageError(f"{Path(folder) / MODEL_FILE}: refusing its external data ({error}); rebuild it") from None


def op_counts(model) -> dict[str, int]:
    """How many nodes of each op type the graph holds (sorted by op name, for stable JSON)."""
    return dict(sorted(Counter(node.op_type for node in model.graph.node).items()))


# What may stand between the output layer's matmul and the logits: a bias, a scale, a cast, and
# final-logit softcapping (Gemma 2: 30 * tanh(x / 30)).
TOWARD_LOGITS = frozenset({"Add", "Mul", "Div", "Tanh", "Cast", "Reshape", "Identity"})
OUTPUT_MATMULS = frozenset({"MatMul", "MatMulNBits", "Gemm", "MatMulInteger", "DynamicQuantizeMatMul"})


def output_matmul(model):
    """The matmul whose product becomes the logits (through TOWARD_LOGITS ops only), or None."""
    producers = {out: node for node in model.graph.node for out in node.output}
    frontier = [LOGITS]
    for _ in range(8):
        nodes = [producers[name] for name in frontier if name in producers]
        matmul = next((node for node in nodes if node.op_type in OUTPUT_MATMULS), None)
        if matmul is not None:
            return matmul
        frontier = [name for node in nodes if node.op_type in TOWARD_LOGITS for name in node.input]
    return None
