"""A graph's weights, one tensor at a time: read where they lie, written as they are made.

A graph loaded without its weights keeps, for each initializer, where its bytes are (external data:
file, offset, length). WeightStore reads one initializer on demand; ExternalData appends each new
tensor to the output's data file the moment it exists, leaving only a reference in the graph. A
stage that quantizes, copies or folds weights through these holds one tensor at a time, whatever
the model's size.

Weights may be read through a chain of Cast and Transpose nodes: the graphs tasks/graphs/
decoder_graph.py writes keep each tensor as the checkpoint stores it (bfloat16 [out, in]) and
convert it in the graph. `chain` finds such a chain behind a tensor; `fold_chains` replaces every
chain by the float32 tensor it computes, as onnxruntime would at load, so a published variant
loads without that work.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.core.errors import StageError
from tasks.graphs.onnx_io import attribute
from tasks.sources.checkpoint import as_float32

# ONNX data types -> numpy storage; bfloat16 (16) as its bit pattern.
STORAGE = {1: np.float32, 10: np.float16, 16: np.uint16, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64, 9: np.bool_}
FLOAT_TYPES = {1: "F32", 10: "F16", 16: "BF16"}
CHAIN_OPS = ("Cast", "Transpose")
DATA_SUFFIX = ".data"
ALIGNMENT = 64  # each tensor starts on a 64-byte boundary of the data file, as onnx's own writer aligns


@dataclass(frozen=True)
class Chain:
    """A constant read through Cast (to float32) and Transpose ([N, K] -> [K, N]) nodes."""

    initializer: str
    output: str  # the tensor its consumers read
    transposed: bool
    nodes: tuple  # the Cast and Transpose nodes, initializer side first


class GraphIndex:
    """Producers, consumers and initializers of a graph, by tensor name."""

    def __init__(self, model):
        self.model = model
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.producers = {out: node for node in model.graph.node for out in node.output}
        self.consumers: dict[str, list] = defaultdict(list)
        for node in model.graph.node:
            for name in node.input:
                self.consumers[name].append(node)

    def chain(self, name: str) -> Chain | None:
        """The chain that makes tensor `name` from an initializer, or None (a plain initializer is
        a chain of no nodes)."""
        nodes, transposed = [], False
        while name not in self.initializers:
            node = self.producers.get(name)
            if node is None or node.op_type not in CHAIN_OPS or len(node.input) != 1:
                return None
            if node.op_type == "Cast" and attribute(node, "to") != 1:
                return None
            if node.op_type == "Transpose":
                if list(attribute(node, "perm") or [1, 0]) != [1, 0] or transposed:
                    return None
                transposed = True
            nodes.append(node)
            name = node.input[0]
        return Chain(name, nodes[0].output[0] if nodes else name, transposed, tuple(reversed(nodes)))


class WeightStore:
    """Reads a graph's initializers on demand: inline ones from the graph, external ones from the
    files in folder (None: the graph holds its weights), as float32 when they are floats
    (bfloat16 too)."""

    def __init__(self, model, folder: Path | None):
        self.model = model
        self.folder = Path(folder) if folder is not None else None
        self._initializers: dict[str, object] = {}

    def tensor(self, name: str):
        if name not in self._initializers:  # the graph may have gained initializers since
            self._initializers = {t.name: t for t in self.model.graph.initializer}
        return self._initializers[name]

    def raw(self, name: str) -> np.ndarray:
        tensor = self.tensor(name)
        dtype = STORAGE.get(tensor.data_type)
        if dtype is None:
            raise StageError(f"initializer {name} has ONNX data type {tensor.data_type}, which is not read here")
        if tensor.data_location == 1:  # external
            info = {entry.key: entry.value for entry in tensor.external_data}
            buffer = self._read(info["location"], int(info.get("offset", 0)), int(info["length"]))
            return np.frombuffer(buffer, dtype=dtype).reshape(tuple(tensor.dims))
        if tensor.data_type == 16:
            return np.frombuffer(tensor.raw_data, dtype=np.uint16).reshape(tuple(tensor.dims))
        from onnx import numpy_helper

        return numpy_helper.to_array(tensor)

    def _read(self, location: str, offset: int, length: int) -> bytearray:
        if self.folder is None:
            raise StageError(f"external data {location} was read from a graph given without its folder")
        path = (self.folder / location).resolve()
        if not path.is_relative_to(self.folder.resolve()):  # a graph must not read outside its folder
            raise StageError(
                f"{self.folder / 'model.onnx'}: refusing its external data {location}: it lies outside the model's "
                f"folder; rebuild it"
            )
        buffer = bytearray(length)
        with open(path, "rb") as handle:
            if os.preadv(handle.fileno(), [buffer], offset) != length:
                raise StageError(f"{path} is truncated; rebuild {self.folder}")
        return buffer

    def array(self, name: str) -> np.ndarray:
        """An initializer's values; floats as float32."""
        tensor = self.tensor(name)
        values = self.raw(name)
        return as_float32(values, FLOAT_TYPES[tensor.data_type]) if tensor.data_type in FLOAT_TYPES else values

    def value(self, chain: Chain) -> np.ndarray:
        """What the chain computes, float32 (a transposed view when it transposes)."""
        values = self.array(chain.initializer).astype(np.float32, copy=False)
        return values.T if chain.transposed else values


class ExternalData:
    """Appends tensors to one data file and returns initializers that point at them."""

    def __init__(self, folder: Path, location: str):
        self.location = location
        self.path = Path(folder) / location
        self.path.touch()
        self.size = self.path.stat().st_size
        self.written: set[str] = set()  # initializers whose bytes this wrote

    def tensor(self, array: np.ndarray, name: str, data_type: int | None = None):
        """An initializer holding array, its bytes already written. data_type overrides the
        numpy type (16: uint16 bit patterns that are bfloat16)."""
        from onnx import TensorProto, helper

        array = np.ascontiguousarray(array)
        if data_type is None:
            data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        offset = self.size + (-self.size % ALIGNMENT)
        with open(self.path, "r+b") as handle:
            handle.seek(offset)
            handle.write(array.tobytes())
        self.size = offset + array.nbytes
        self.written.add(name)
        tensor = TensorProto(name=name, data_type=data_type, dims=array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(array.nbytes))):
            tensor.external_data.add(key=key, value=value)
        return tensor


def fold_chains(model, store: WeightStore, data: ExternalData | None, among: set[str] | None = None) -> int:
    """Replace the Cast (to float32) and Transpose nodes that read initializers by the float32
    tensors they compute, written to data (inline when data is None), as onnxruntime would fold
    them at load; returns how many tensors were written. `among` limits it to those initializers
    (a quantizer's float16 scales, cast at load, stay so).

    A matrix read both as itself and transposed (a tied vocabulary matrix: the lookup and the
    output layer) is stored once, as the output layer's [hidden, vocab] weight, with the lookup
    reading a Transpose of it: the layout of onnxruntime-genai's builder, whose output layer
    onnxruntime's quantizers can quantize (a Transpose in front of a MatMul hides its weight)."""
    from onnx import helper, numpy_helper

    index = GraphIndex(model)
    written = 0

    def write(values: np.ndarray, name: str) -> None:
        tensor = data.tensor(values, name) if data is not None else numpy_helper.from_array(values, name)
        model.graph.initializer.append(tensor)

    for name, tensor in list(index.initializers.items()):
        if (among is not None and name not in among) or tensor.data_type not in FLOAT_TYPES:
            continue
        readers = index.consumers.get(name, [])
        cast = readers[0] if len(readers) == 1 and index.chain(readers[0].output[0]) is not None else None
        cast = cast if cast is not None and cast.op_type == "Cast" else None
        value = cast.output[0] if cast is not None else name
        consumers = index.consumers.get(value, [])
        transpose = next(
            (n for n in consumers if index.chain(n.output[0]) is not None and n.op_type == "Transpose"), None
        )
        if cast is None and transpose is None:
            continue  # a plain float32 initializer already
        values = store.array(name)
        if transpose is None:
            write(values, value)
        else:
            write(np.ascontiguousarray(values.T), transpose.output[0])
            model.graph.node.remove(transpose)
            if len(consumers) > 1:  # the other readers get the matrix back through a Transpose
                if cast is None:
                    model.graph.initializer.remove(tensor)
                node = helper.make_node(
                    "Transpose", [transpose.output[0]], [value], name=f"{value}/Transpose", perm=[1, 0]
                )
                model.graph.node.insert(0, node)
        if cast is not None:
            model.graph.node.remove(cast)
        written += 1
    prune(model)
    return written


def prune(model) -> None:
    """Drop nodes nothing reads and initializers no node reads (until none is left)."""
    outputs = {o.name for o in model.graph.output}
    while True:
        read = {name for node in model.graph.node for name in node.input} | outputs
        dead = [node for node in model.graph.node if not any(out in read for out in node.output if out)]
        for node in dead:
            model.graph.node.remove(node)
        if not dead:
            break
    read = {name for node in model.graph.node for name in node.input} | outputs
    for tensor in [t for t in model.graph.initializer if t.name not in read]:
        model.graph.initializer.remove(tensor)


def copy_into(model, store: WeightStore, data: ExternalData, min_bytes: int = 1024) -> None:
    """Make the graph independent of store's folder: every initializer read from there, and every
    inline one of min_bytes or more, is written to data."""
    for position, tensor in enumerate(list(model.graph.initializer)):
        if tensor.name in data.written or (tensor.data_location != 1 and len(tensor.raw_data) < min_bytes):
            continue
        values = store.raw(tensor.name)
        model.graph.initializer[position].CopyFrom(data.tensor(values, tensor.name, tensor.data_type))


def _location(tensor) -> str | None:
    return next((entry.value for entry in tensor.external_data if entry.key == "location"), None)


def external_files(model) -> set[str]:
    """The files the graph's external data lives in (relative to its folder)."""
    return {location for t in model.graph.initializer if t.data_location == 1 and (location := _location(t))}
