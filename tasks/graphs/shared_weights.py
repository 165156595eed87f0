"""Store a tied matrix once: some exporters write the token embedding [vocab, hidden] and, for the
output layer, its transpose [hidden, vocab] as two initializers (optimum's Gemma 3 export: 1.74 GB
of ONNX from 1.07 GB of weights). The copy's readers get Transpose(table) instead, the layout
optimum writes for other tied models and the one the quantize stage shares codes through.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def share_transposed_copies(model) -> list[dict]:
    """Rewrite model in place so no initializer is the transpose of an embedding table (a 2-D
    initializer a Gather reads); return what was shared."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    tables = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in initializers}
    shared = []
    for table in (initializers[name] for name in sorted(tables)):
        if len(table.dims) != 2:
            continue
        values = numpy_helper.to_array(table)
        for copy in list(graph.initializer):
            if tuple(copy.dims) != tuple(reversed(table.dims)) or not _is_transpose(
                values, numpy_helper.to_array(copy)
            ):
                continue
            transposed = f"{table.name}/transposed"
            graph.node.insert(0, helper.make_node("Transpose", [table.name], [transposed], name=transposed))
            for node in graph.node:
                node.input[:] = [transposed if name == copy.name else name for name in node.input]
            graph.initializer.remove(copy)
            shared.append({"kept": table.name, "removed": copy.name, "bytes": _bytes(copy)})
            log.info("stored %s once: %s was its transpose (%.0f MB saved)", table.name, copy.name, _bytes(copy) / 1e6)
    return shared


def _bytes(tensor) -> int:
    return int(np.prod(tensor.dims)) * {1: 4, 10: 2, 11: 8, 16: 2}.get(tensor.data_type, 4)


def _is_transpose(table: np.ndarray, copy: np.ndarray) -> bool:
    # A cheap sample first: unrelated matrices of matching shapes differ in their first row.
    return bool(np.array_equal(table[0], copy[:, 0]) and np.array_equal(table.T, copy))
