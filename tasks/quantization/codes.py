"""Block codes of a weight matrix: W [K, N] as codes q [N, K] with a scale and a zero
point per block of K (w = s * (q - z)), from round-to-nearest, an importance-weighted range search
(imatrix), onnxruntime's HQQ solver or onnxruntime's GPTQ; and the byte layouts MatMulNBits and
GatherBlockQuantized read.

Scales are kept as float16 (the graph stores them so), and codes are computed against the
rounded scales. A float zero point z becomes the integer round(z) plus a per-block remainder
R = s * (round(z) - z) carried as extra rows of codes (offset_rows): x.W = x.W_int + blocksum(x).R.

Round-to-nearest and the range search are one compiled kernel (numba), a single pass over each
block whatever the number of ranges it tries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
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


MODES = {"none": 0, "integer": 1, "float": 2}  # zero-point conventions, as the kernel takes them
SEARCH_STEPS = 20  # shrinks of the range tried per block, from 1.0 down to 0.7


@numba.njit(inline="always")
def _half(x: float) -> float:
    """x rounded to the nearest float16 (ties to even), as numpy's float64 -> float16 does it."""
    magnitude = abs(x)
    if magnitude >= 65520.0:
        return math.copysign(math.inf, x)
    if magnitude < 2.0**-14:  # float16's subnormals: multiples of 2^-24
        return math.copysign(np.rint(magnitude * 2.0**24) * 2.0**-24, x)
    mantissa, exponent = math.frexp(magnitude)  # magnitude = mantissa * 2^exponent, mantissa in [0.5, 1)
    return math.copysign(math.ldexp(np.rint(math.ldexp(mantissa, 11)), exponent - 11), x)


@numba.njit(inline="always")
def _grid_fit(lo: float, hi: float, bits: int, mode: int) -> tuple[float, float]:
    """The scale and zero point that put [lo, hi] on the grid (the scale before float16 rounding).

    none: onnxruntime's symmetric convention, the largest magnitude maps to -mid exactly;
    integer: the range widened to hold zero, zero point rounded; float: the range exactly.
    """
    levels = 2**bits - 1
    if mode == 0:
        signed_max = lo if -lo > hi else hi
        return (signed_max / -(2 ** (bits - 1)) if signed_max != 0 else 1.0), float(2 ** (bits - 1))
    if mode == 1:
        lo, hi = min(lo, 0.0), max(hi, 0.0)  # zero must be representable
        scale = (hi - lo) / levels if hi > lo else 1.0
        return scale, min(max(np.rint(-lo / scale), 0.0), float(levels))
    scale = (hi - lo) / levels if hi > lo else 1.0
    return scale, -lo / scale


@numba.njit(inline="always")  # inlined: a call per block and range would cost more than its work
def _weighted_error(block, importance, scale: float, zero: float, top: float) -> float:
    """sum(importance_k * (w_k - dequantized q_k)^2) over one block, in float32."""
    s, z, q_max = np.float32(scale), np.float32(zero), np.float32(top)
    total = np.float32(0.0)
    for k in range(block.shape[0]):
        q = min(max(np.rint(block[k] / s + z), np.float32(0.0)), q_max)
        error = (q - z) * s - block[k]
        total += importance[k] * error * error
    return total


TILE = 16  # columns read together: one 64-byte line of float32 per weight row


# reassoc lets the error sums vectorize; nothing else in the kernel has an order to change.
@numba.njit(cache=True, parallel=True, fastmath={"reassoc"})
def _fit(weights, importance, shrinks, bits: int, mode: int, size: int):
    """Per block of `size` rows of each column of W [K, N]: of the ranges [lo, hi] * shrink, the one
    whose codes have the least importance-weighted error (the only one when shrinks has one), its
    float16-rounded scale, its zero point, and the codes against them (in float64)."""
    k, n = weights.shape
    count, top = k // size, float(2**bits - 1)
    codes = np.empty((n, k), np.uint8)
    scales = np.empty((n, count), np.float32)
    zeros = np.empty((n, count), np.float64)
    for tile in numba.prange((n + TILE - 1) // TILE):
        first = tile * TILE
        width = min(TILE, n - first)
        blocks = np.empty((TILE, size), weights.dtype)  # a tile's blocks, each contiguous
        for j in range(count):
            for r in range(size):
                for c in range(width):
                    blocks[c, r] = weights[j * size + r, first + c]
            for c in range(width):
                block = blocks[c]
                lo, hi = float(block.min()), float(block.max())
                best, best_scale, best_zero = np.inf, 1.0, 0.0
                for shrink in shrinks:
                    scale, zero = _grid_fit(lo * shrink, hi * shrink, bits, mode)
                    scale = _half(scale)  # stored as float16: quantize against that
                    error = 0.0
                    if len(shrinks) > 1:
                        error = _weighted_error(block, importance[j * size : (j + 1) * size], scale, zero, top)
                    if error < best:
                        best, best_scale, best_zero = error, scale, zero
                for r in range(size):
                    q = np.rint(float(block[r]) / best_scale + best_zero)
                    codes[first + c, j * size + r] = np.uint8(min(max(q, 0.0), top))
                scales[first + c, j], zeros[first + c, j] = best_scale, best_zero
    return codes, scales, zeros


def _fitted(weights: np.ndarray, importance: np.ndarray | None, bits: int, block: int, zero_point: str, steps: int):
    k = weights.shape[0]
    if k % block:
        raise ValueError(f"{k} rows are not a whole number of blocks of {block}")
    shrinks = np.linspace(1.0, 0.7, steps + 1)
    weighting = np.ones(k, np.float32) if importance is None else np.asarray(importance, dtype=np.float32)
    if weights.dtype not in (np.float32, np.float64):
        weights = weights.astype(np.float32)
    codes, scales, zeros = _fit(weights, weighting, shrinks, bits, MODES[zero_point], block)
    return BlockCodes(codes, scales, zeros, bits, block)


def round_to_nearest(weights: np.ndarray, bits: int, block: int, zero_point: str) -> BlockCodes:
    """Min/max round-to-nearest. zero_point: none (symmetric), integer, or float (exact range)."""
    return _fitted(weights, None, bits, block, zero_point, steps=0)


def importance_search(
    weights: np.ndarray, importance: np.ndarray, bits: int, block: int, zero_point: str, steps: int = SEARCH_STEPS
) -> BlockCodes:
    """Per block, shrink the quantization range to minimize sum(importance_k * (w_k - q_k)^2).

    importance is the mean squared activation of each input channel on calibration text (llama.cpp's
    "importance matrix"): errors on channels that carry large activations cost more. Compiled, the
    search of every linear of Llama 3.2 1B's shape takes 16 s here; as numpy passes over whole
    arrays it took 49 s, half of the int4 stage."""
    return _fitted(weights, importance, bits, block, zero_point, steps)


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
