"""A safetensors checkpoint read one tensor at a time (single file or sharded with an index).

Each tensor is read with one positioned read into a buffer of its own and converted to float32 only
then, so a stage holds the tensor it works on and nothing else: a bfloat16 checkpoint is never
upcast whole (4.9 GB for a 1.2B model). Reads go through the page cache rather than a memory map,
whose touched pages would count against the process until it unmaps the whole file.

Also says where each tensor's bytes lie in its file (offset, length, dtype), so an ONNX graph can
name those bytes as its external data instead of copying them (tasks/graphs/decoder_graph.py).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.core.errors import StageError
from tasks.sources.weight_files import check_safetensors

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> (numpy storage dtype, ONNX TensorProto data type). bfloat16 is stored as its
# 16-bit pattern; numpy has no bfloat16.
DTYPES = {
    "F32": (np.float32, 1),
    "F16": (np.float16, 10),
    "BF16": (np.uint16, 16),
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie: file (relative to the checkpoint folder), absolute offset, length."""

    name: str
    file: str
    offset: int
    length: int
    dtype: str  # safetensors' name: F32, F16, BF16
    shape: tuple[int, ...]

    @property
    def onnx_type(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return 8 + length, json.loads(handle.read(length))


class Checkpoint:
    """The tensors of the safetensors files in folder, by name, read on demand."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        files = self._files()
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            check_safetensors(self.folder / file)
            start, header = _header(self.folder / file)
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in DTYPES:
                    raise StageError(
                        f"{self.folder / file}: tensor {name} is {entry['dtype']}; only F32, F16 and BF16 weights "
                        f"are read (a quantized checkpoint must be dequantized first)"
                    )
                begin, end = entry["data_offsets"]
                self.tensors[name] = StoredTensor(
                    name, file, start + begin, end - begin, entry["dtype"], tuple(entry["shape"])
                )

    def _files(self) -> list[str]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            return sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        files = sorted(path.name for path in self.folder.glob("*.safetensors"))
        if not files:
            raise StageError(f"{self.folder} has no .safetensors weights; run the download stage first")
        return files

    @property
    def files(self) -> list[str]:
        return sorted({tensor.file for tensor in self.tensors.values()})

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def stored(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise StageError(f"{self.folder} has no tensor {name}; is it the checkpoint of this config?") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (bfloat16 as uint16 bit patterns)."""
        tensor = self.stored(name)
        buffer = bytearray(tensor.length)
        with open(self.folder / tensor.file, "rb") as handle:
            if os.preadv(handle.fileno(), [buffer], tensor.offset) != tensor.length:
                raise StageError(f"{self.folder / tensor.file} is truncated at tensor {name}; re-download it")
        return np.frombuffer(buffer, dtype=DTYPES[tensor.dtype][0]).reshape(tensor.shape)

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32."""
        return as_float32(self.raw(name), self.stored(name).dtype)

    def float32_bytes(self) -> int:
        """What the whole model would take upcast to float32: the unit of the stages' memory estimates."""
        return 4 * sum(tensor.elements for tensor in self.tensors.values())

    def largest_float32_bytes(self) -> int:
        return 4 * max(tensor.elements for tensor in self.tensors.values())


def as_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # a bfloat16 is the top half of the float32 it stands for; one pass
        return np.left_shift(values, 16, dtype=np.uint32).view(np.float32)
    return values.astype(np.float32, copy=False)
