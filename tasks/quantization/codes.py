"""Block codes of a weight matrix, in numpy: W [K, N] as codes q [N, K] with a scale and a zero
point per block of K (w = s * (q - z)), from round-to-nearest, an importance-weighted range search
(imatrix), onnxruntime's HQQ solver or onnxruntime's GPTQ; and the byte layouts MatMulNBits and
GatherBlockQuantized read.

Scales are kept as float16 (the graph stores them so), and codes are computed against the
rounded scales. A float zero point z becomes the integer round(z) plus a per-block remainder
R = s * (round(z) - z) carried as extra rows of codes (offset_rows): x.W = x.W_int + blocksum(x).R.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_BLOCK = 16  # MatMulNBits' smallest block


@dataclass(frozen=True)
class BlockCodes:
    """W [K, N] as codes q [N, K], scales s and zero points z [N, K // block]: w = s * (q - z)."""

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    block: int

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        q = self.codes.reshape(n, k // self.block, self.block).astype(np.float64)
        w = (q - self.zeros[..., None]) * self.scales[..., None].astype(np.float64)
        return w.reshape(n, k).T.astype(np.float32)

    @property
    def mid(self) -> int:
        return 2 ** (self.bits - 1)


def _blocks(weights: np.ndarray, block: int) -> np.ndarray:
    """[K, N] -> [N, K // block, block] in float64."""
    k, n = weights.shape
    return weights.T.reshape(n, k // block, block).astype(np.float64)


def _codes(blocks: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int) -> np.ndarray:
    q = np.round(blocks / scales[..., None] + zeros[..., None])
    return np.clip(q, 0, 2**bits - 1).astype(np.uint8).reshape(blocks.shape[0], -1)


def _grid_fit(lo: np.ndarray, hi: np.ndarray, bits: int, zero_point: str) -> tuple[np.ndarray, np.ndarray]:
    """Scales and zero points that put [lo, hi] on the grid.

    none: onnxruntime's symmetric convention, the largest magnitude maps to -mid exactly;
    integer: the range widened to hold zero, zero point rounded; float: the range exactly.
    """
    levels = 2**bits - 1
    if zero_point == "none":
        signed_max = np.where(-lo > hi, lo, hi)
        scales = np.where(signed_max != 0, signed_max / -(2 ** (bits - 1)), 1.0)
        return scales, np.full_like(scales, 2 ** (bits - 1))
    if zero_point == "integer":
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)  # zero must be representable
        scales = np.where(hi > lo, (hi - lo) / levels, 1.0)
        return scales, np.clip(np.round(-lo / scales), 0, levels)
    scales = np.where(hi > lo, (hi - lo) / levels, 1.0)
    return scales, -lo / scales


COLUMNS = 4096  # weight columns processed at a time: float64 copies of a vocabulary matrix are GBs


def _by_columns(weights: np.ndarray, quantize) -> BlockCodes:
    """quantize(columns) over slices of COLUMNS columns, joined: the same codes, bounded memory."""
    parts = [quantize(weights[:, start : start + COLUMNS]) for start in range(0, weights.shape[1], COLUMNS)]
    if len(parts) == 1:
        return parts[0]
    return BlockCodes(
        np.concatenate([p.codes for p in parts]),
        np.concatenate([p.scales for p in parts]),
        np.concatenate([p.zeros for p in parts]),
        parts[0].bits,
        parts[0].block,
    )


def round_to_nearest(weights: np.ndarray, bits: int, block: int, zero_point: str) -> BlockCodes:
    """Min/max round-to-nearest. zero_point: none (symmetric), integer, or float (exact range)."""

    def columns(part: np.ndarray) -> BlockCodes:
        blocks = _blocks(part, block)
        scales, zeros = _grid_fit(blocks.min(-1), blocks.max(-1), bits, zero_point)
        scales = scales.astype(np.float16).astype(np.float64)  # stored as float16; quantize against that
        return BlockCodes(_codes(blocks, scales, zeros, bits), scales.astype(np.float32), zeros, bits, block)

    return _by_columns(weights, columns)


SEARCH_COLUMNS = 256  # columns per slice of the range search: its 21 passes stay in the CPU's cache


def importance_search(
    weights: np.ndarray, importance: np.ndarray, bits: int, block: int, zero_point: str, steps: int = 20
) -> BlockCodes:
    """Per block, shrink the quantization range to minimize sum(importance_k * (w_k - q_k)^2).

    importance is the mean squared activation of each input channel on calibration text (llama.cpp's
    "importance matrix"): errors on channels that carry large activations cost more. Errors are
    computed in float32 over slices of columns small enough to stay in cache, two slices at a time
    (numpy releases the GIL inside its loops): 9x faster than whole-matrix float64 passes, with the
    same choice on all but about one block in 10^5 (a near tie)."""
    from concurrent.futures import ThreadPoolExecutor

    k, n = weights.shape
    shrinks = np.linspace(1.0, 0.7, steps + 1)
    h = np.asarray(importance, dtype=np.float32).reshape(1, k // block, block)
    starts = range(0, n, SEARCH_COLUMNS)
    with ThreadPoolExecutor(max_workers=2) as pool:
        parts = list(
            pool.map(
                lambda start: _search(weights[:, start : start + SEARCH_COLUMNS], h, bits, block, zero_point, shrinks),
                starts,
            )
        )
    return BlockCodes(
        np.concatenate([p.codes for p in parts]),
        np.concatenate([p.scales for p in parts]),
        np.concatenate([p.zeros for p in parts]),
        bits,
        block,
    )


def _search(weights: np.ndarray, h: np.ndarray, bits: int, block: int, zero_point: str, shrinks) -> BlockCodes:
    """importance_search on a slice of columns: the best range per block, then its codes."""
    k, n = weights.shape
    blocks = np.ascontiguousarray(weights.T, dtype=np.float32).reshape(n, k // block, block)
    lo0, hi0 = blocks.min(-1).astype(np.float64), blocks.max(-1).astype(np.float64)
    best = np.full(lo0.shape, np.inf)
    best_scales, best_zeros = np.ones(lo0.shape), np.zeros(lo0.shape)
    for shrink in shrinks:
        scales, zeros = _grid_fit(lo0 * shrink, hi0 * shrink, bits, zero_point)
        scales = scales.astype(np.float16).astype(np.float64)  # stored as float16; quantize against that
        s, z = scales.astype(np.float32)[..., None], zeros.astype(np.float32)[..., None]
        q = np.clip(np.round(blocks / s + z), 0, 2**bits - 1)
        error = q - z
        error *= s
        error -= blocks
        error = (h * error * error).sum(-1)
        better = error < best
        best = np.where(better, error, best)
        best_scales, best_zeros = np.where(better, scales, best_scales), np.where(better, zeros, best_zeros)
    s, z = best_scales.astype(np.float32)[..., None], best_zeros.astype(np.float32)[..., None]
    codes = np.clip(np.round(blocks / s + z), 0, 2**bits - 1).astype(np.uint8).reshape(n, k)
    return BlockCodes(codes, best_scales.astype(np.float32), best_zeros, bits, block)


def half_quadratic(weights: np.ndarray, bits: int, block: int) -> BlockCodes:
    """onnxruntime's HQQ solver (float zero points)."""
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    solver = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=block, bits=bits))
    codes, scales, zeros = solver.quantize_internal(
        torch.from_numpy(np.ascontiguousarray(weights.T)), bits=bits, group_size=block, round_zero=False
    )
    return BlockCodes(
        codes.numpy().astype(np.uint8), scales.numpy().astype(np.float32), zeros.numpy().astype(np.float64), bits, block
    )


def gptq(weights: np.ndarray, hessian: np.ndarray, bits: int, block: int, zero_point: str) -> BlockCodes:
    """onnxruntime's GPTQ; its fake-quantized result is re-expressed as codes on the same kind of grid."""
    from onnxruntime.quantization.neural_compressor.weight_only import gptq as ort_gptq

    scheme = "sym" if zero_point == "none" else "asym"
    adjusted = ort_gptq(weights.copy(), hessian.copy(), num_bits=bits, group_size=block, scheme=scheme)
    return round_to_nearest(np.asarray(adjusted, dtype=np.float32), bits, block, zero_point)


def quantize_codes(
    algorithm: str, weights: np.ndarray, bits: int, block: int, zero_point: str, hessian: np.ndarray | None
) -> BlockCodes:
    if algorithm == "hqq":
        return half_quadratic(weights, bits, block)
    if algorithm == "gptq":
        return gptq(weights, hessian, bits, block, zero_point)
    if algorithm == "imatrix":  # statistics of the diagonal only, or a full H
        importance = hessian if hessian.ndim == 1 else np.diag(hessian)
        return importance_search(weights, importance, bits, block, zero_point)
    return round_to_nearest(weights, bits, block, zero_point)


def layer_block(k: int, block: int) -> int | None:
    """The block a layer with K inputs uses: the asked size, or the largest smaller power of two
    (at least 16) that divides K; None when none does."""
    size = block
    while size >= MIN_BLOCK and k % size:
        size //= 2
    return size if size >= MIN_BLOCK else None


def pack(codes: np.ndarray, bits: int, block: int) -> np.ndarray:
    """[N, K] codes -> MatMulNBits' B layout [N, K // block, block * bits // 8] (two 4-bit codes a byte)."""
    n, k = codes.shape
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.reshape(n, k // block, block * bits // 8).astype(np.uint8)


def pack_zero_points(zeros: np.ndarray, bits: int) -> np.ndarray:
    z = np.round(zeros).astype(np.uint8)
    if bits == 4:
        if z.shape[1] % 2:
            z = np.pad(z, ((0, 0), (0, 1)), constant_values=8)
        z = z[:, 0::2] | (z[:, 1::2] << 4)
    return z


def is_integer_grid(codes: BlockCodes) -> bool:
    """Zero points MatMulNBits can store as unsigned integers of `bits` bits."""
    zeros = codes.zeros
    return bool(np.all(zeros == np.round(zeros)) and np.all((zeros >= 0) & (zeros < 2**codes.bits)))


def offset_rows(codes: BlockCodes) -> BlockCodes:
    """Float zero points as integer ones plus K rows that MatMulNBits multiplies with block sums.

    w = s*(q - round(z)) + s*(round(z) - z): the second term is one value per block and column,
    R[b, n], so x.W = x.W_int + blocksum(x).R. Appending the block sums to x and R's codes to the
    weight's lets one MatMulNBits compute both. R has its own grid per column (bits wide); as
    |R| <= s/2 where z lies within the grid, its rounding costs about a fifteenth of what rounding
    z would (a block whose values all share one sign has z outside the grid, a larger R, and
    coarsens its column's R grid; trained weights rarely have such blocks, SmolLM2 none).
    """
    n, k = codes.codes.shape
    levels = 2**codes.bits - 1
    zeros = np.clip(np.round(codes.zeros), 0, levels)
    blocks = k // codes.block
    rows = np.zeros((-(-blocks // codes.block) * codes.block, n))
    rows[:blocks] = (codes.scales * (zeros - codes.zeros)).T
    extra = round_to_nearest(rows, codes.bits, codes.block, "integer")
    return BlockCodes(
        np.concatenate([codes.codes, extra.codes], axis=1),
        np.concatenate([codes.scales, extra.scales], axis=1),
        np.concatenate([zeros, extra.zeros], axis=1),
        codes.bits,
        codes.block,
    )
