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


def save_graph_only(model, folder: Path) -> Path:
    """Write model.onnx as it is: a graph whose large initializers already point at files in folder
    (written or linked there) is serialized without reading or moving any weight."""
    import onnx

    path = Path(folder) / MODEL_FILE
    inline = sum(len(t.raw_data) for t in model.graph.initializer)
    if inline > EXTERNAL_DATA_ABOVE_BYTES:
        raise StageError(f"{path}: {inline} bytes of weights are inline; write them as external data")
    _declare_contrib_opset(model)
    onnx.save_model(model, str(path))
    return path


def save_runnable(model, weights_dir: Path | None, folder: Path) -> Path:
    """Save model into folder for onnxruntime to run: a graph whose weights are external data in
    weights_dir gets links to those files (no copy); one holding its weights gets them written."""
    import copy

    from tasks.core.files import link_or_copy
    from tasks.graphs.weights import external_files

    files = external_files(model)
    if not files:
        return save(copy.deepcopy(model), folder, external_data=True)  # saving moves a model's weights out
    for file in files:
        link_or_copy(Path(weights_dir) / file, Path(folder) / file)
    return save_graph_only(model, folder)


def _declare_contrib_opset(model) -> None:
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.add(domain="com.microsoft", version=1)


def load(folder: Path, with_weights: bool = True):
    """The graph in folder/model.onnx, with its external data read in when with_weights;
    StageError if that data lies outside folder.

    The weights are read by tasks/graphs/weights.py, which refuses paths that resolve outside the
    folder (absolute, "..", symbolic links) as onnx's own loader does, but takes hard links: the
    stages link a checkpoint's files instead of copying them, and DVC's hardlink cache links every
    output; onnx refuses any file with a second link."""
    import onnx

    from tasks.graphs.weights import WeightStore

    model = onnx.load(str(Path(folder) / MODEL_FILE), load_external_data=False)
    if with_weights:
        store = WeightStore(model, folder)
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                tensor.raw_data = store.raw(tensor.name).tobytes()
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.DEFAULT
    return model


def attributes(node) -> dict:
    """A node's attributes by name, as Python values (onnx.helper's reading)."""
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def attribute(node, name: str, default=None):
    """One attribute of a node, or default when the node does not set it (pass the op's own
    default where the spec gives one)."""
    return attributes(node).get(name, default)


def op_counts(model) -> dict[str, int]:
    """How many nodes of each op type the graph holds (sorted by op name, for stable JSON)."""
    return dict(sorted(Counter(node.op_type for node in model.graph.node).items()))


# What may stand between the output layer's matmul and the logits: a bias, a scale, a cast, and
# final-logit softcapping (Gemma 2: 30 * tanh(x / 30)).
TOWARD_LOGITS = frozenset({"Add", "Mul", "Div", "Tanh", "Cast", "Reshape", "Identity"})
OUTPUT_MATMULS = frozenset(
    {"MatMul", "MatMulNBits", "Gemm", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}
)


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
