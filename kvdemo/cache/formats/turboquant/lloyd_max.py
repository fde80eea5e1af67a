"""Lloyd-Max scalar codes for the coordinates of a randomly rotated unit vector, and the bit packing of their codes:
the quantizer of TurboQuant's keys (`kvdemo.cache.formats.turboquant.layers`).

TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal Distortion
Rate", arXiv:2504.19874, ICLR 2026, Algorithm 1, `TurboQuant_mse`): rotate a unit vector x of dimension d at random,
so that each coordinate of y = R x follows one known distribution whatever x was, then round every coordinate to the
nearest centroid of the optimal scalar (Lloyd-Max) code for that distribution; store the centroid indices, b bits a
coordinate. Its Lemma 1 gives the distribution of one coordinate of a uniform random unit vector in d dimensions:

    f_d(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - x^2)^((d-3)/2),   -1 <= x <= 1,

which tends to the Gaussian N(0, 1/d) as d grows. kvdemo solves the code for the exact marginal f_d of the model's
head_dim (`exact_marginal`), not for its Gaussian limit: the two differ little at head_dim 64 to 256, but the exact
one costs nothing more (the code is solved once per head_dim and bits, in milliseconds), needs no argument about when
d is "large enough", and is the distribution the paper's Theorem 1 is stated for. `gaussian` gives the limit, with
which the test checks the textbook Lloyd-Max values: for N(0, 1) at 2 bits, centroids +-0.4528 and +-1.510, and the
distortion per vector d x E[(y_i - c(y_i))^2] = 0.3634, 0.1175, 0.03454, 0.009497 at 1, 2, 3, 4 bits (Max 1960;
the paper rounds them to 0.36, 0.117, 0.03, 0.009).

The solver is Lloyd's algorithm (Lloyd 1982; Max 1960): boundaries halfway between neighbouring centroids, each
centroid the mean of the density over its cell, repeated until no centroid moves; the integrals are sums over a fine
grid (cumulative sums, so each iteration costs only the centroids' count). Pattern: vLLM's
`quantization/turboquant/centroids.py`, which solves it for N(0, 1/d) with trapezoid sums.

Codes are packed eight at a time into `bits` bytes (`pack_codes`), so b-bit codes take exactly b bits each, 3 bits
included (llama.cpp's and vLLM's dense packing), for any head_dim that is a multiple of 8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

CODE_BITS = (1, 2, 3, 4)
"""The widths `pack_codes` packs eight codes at a time into (8-bit codes are stored as they are, one byte each)."""

_GRID = 400_001
"""Points of the grid the code's integrals are summed over (spacing 5e-6 of the support for the exact marginal)."""


@dataclass(frozen=True)
class LloydMaxCode:
    """An optimal scalar code of `2**bits` levels for one density.

    Attributes:
        bits: bits per coordinate (1 to 4).
        centroids: [2**bits] float64, increasing: the value each code index stands for.
        boundaries: [2**bits - 1] float64: a coordinate between boundaries[i-1] and boundaries[i] takes index i.
        distortion: E[(y - c(y))^2] for one coordinate y of the density (the mean squared error per coordinate).
    """

    bits: int
    centroids: torch.Tensor
    boundaries: torch.Tensor
    distortion: float

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The index of the nearest centroid of each value (any shape, any float dtype): uint8 of the same shape."""
        return torch.bucketize(values, self.boundaries.to(values.dtype)).to(torch.uint8)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The centroid of each code (an integer tensor of any shape): `dtype`, the same shape."""
        return self.centroids.to(dtype)[codes.long()]


def _solve(grid: torch.Tensor, density: torch.Tensor, bits: int, iterations: int = 10_000) -> LloydMaxCode:
    """Lloyd's algorithm on a density symmetric about 0 sampled on `grid` (float64, increasing, symmetric; the density
    need not be normalised). Each step's centroids are made exactly symmetric (c_i = -c_{n-1-i}), as the optimal code
    of a symmetric density is, so that grid rounding does not tilt them."""
    weight = density / density.sum()
    mass, moment, square = weight.cumsum(0), (weight * grid).cumsum(0), (weight * grid * grid).cumsum(0)

    def cell_sums(cumulative: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
        totals = torch.cat([cumulative.new_zeros(1), cumulative[cuts - 1], cumulative[-1:]])
        return totals[1:] - totals[:-1]

    levels = 2**bits
    std = math.sqrt(float(square[-1]) - float(moment[-1]) ** 2)
    centroids = torch.linspace(-2.5 * std, 2.5 * std, levels, dtype=torch.float64) + float(moment[-1])
    for _ in range(iterations):
        boundaries = (centroids[1:] + centroids[:-1]) / 2
        cuts = torch.searchsorted(grid, boundaries)
        masses = cell_sums(mass, cuts)
        updated = torch.where(masses > 0, cell_sums(moment, cuts) / masses.clamp_min(1e-300), centroids)
        updated = (updated - updated.flip(0)) / 2
        moved = float((updated - centroids).abs().max())
        centroids = updated
        if moved < 1e-13 * std:
            break
    boundaries = (centroids[1:] + centroids[:-1]) / 2
    cuts = torch.searchsorted(grid, boundaries)
    masses = cell_sums(mass, cuts)
    # E[(y - c)^2] per cell = E[y^2] - 2 c E[y] + c^2 P, summed
    distortion = float(
        (cell_sums(square, cuts) - 2 * centroids * cell_sums(moment, cuts) + centroids**2 * masses).sum()
    )
    return LloydMaxCode(bits, centroids, boundaries, distortion)


def _checked_bits(bits: int) -> None:
    if bits not in CODE_BITS:
        raise ValueError(f"a Lloyd-Max code here has {', '.join(map(str, CODE_BITS))} bits per coordinate, not {bits}")


@lru_cache(maxsize=64)
def exact_marginal(dimension: int, bits: int) -> LloydMaxCode:
    """The Lloyd-Max code of `bits` bits for one coordinate of a uniform random unit vector in `dimension`
    dimensions (the density f_d of the module docstring: TurboQuant's Lemma 1), solved once and cached.

    Raises:
        ValueError: `dimension` < 3 (f_d is a density for d >= 2, and flat or peaked at the ends below 3) or
            `bits` outside `CODE_BITS`.
    """
    _checked_bits(bits)
    if dimension < 3:
        raise ValueError(f"the exact marginal needs a dimension of 3 or more, not {dimension}")
    grid = torch.linspace(-1.0, 1.0, _GRID, dtype=torch.float64)
    density = torch.exp((dimension - 3) / 2 * torch.log1p(-grid * grid).clamp_min(-1e300))
    density[0] = density[-1] = 0.0 if dimension > 3 else 1.0
    return _solve(grid, density, bits)


@lru_cache(maxsize=16)
def gaussian(bits: int, variance: float = 1.0) -> LloydMaxCode:
    """The Lloyd-Max code of `bits` bits for N(0, variance) (the exact marginal's limit, N(0, 1/d); the textbook
    values of the module docstring for variance 1). Raises ValueError: `bits` outside `CODE_BITS`."""
    _checked_bits(bits)
    std = math.sqrt(variance)
    grid = torch.linspace(-12 * std, 12 * std, _GRID, dtype=torch.float64)
    return _solve(grid, torch.exp(-grid * grid / (2 * variance)), bits)


def marginal_density(dimension: int, values: torch.Tensor) -> torch.Tensor:
    """f_d at `values` (float64, any shape, within [-1, 1]): the normalised density of one coordinate of a uniform
    random unit vector in `dimension` dimensions (module docstring), what `exact_marginal` solves its code for.
    Raises ValueError: `dimension` < 3."""
    if dimension < 3:
        raise ValueError(f"the exact marginal needs a dimension of 3 or more, not {dimension}")
    log_norm = math.lgamma(dimension / 2) - math.lgamma((dimension - 1) / 2) - 0.5 * math.log(math.pi)
    inside = (1 - values * values).clamp_min(0)
    return torch.exp(log_norm + (dimension - 3) / 2 * torch.log(inside))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `bits` bits (uint8, last axis a multiple of 8 long) packed densely: eight codes in `bits` bytes.

    Args:
        codes: [..., n] uint8, each below 2**bits; n a multiple of 8 (8-bit codes: any n, returned as they are).
        bits: 1 to 4, or 8.

    Returns:
        [..., n * bits / 8] uint8, a new contiguous tensor.

    Raises:
        ValueError: another width, or n not a multiple of 8.
    """
    if bits == 8:
        return codes.contiguous()
    _checked_bits(bits)
    if codes.shape[-1] % 8:
        raise ValueError(f"codes are packed eight at a time; the last axis has {codes.shape[-1]}")
    if 8 % bits == 0:  # whole codes a byte: OR the shifted codes in uint8 (a decode step's token: 3 ops, not 8)
        per = 8 // bits
        grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per)
        packed = grouped[..., 0].clone()
        for i in range(1, per):
            packed |= grouped[..., i] << (i * bits)
        return packed
    groups = codes.reshape(*codes.shape[:-1], -1, 8).to(torch.int64)
    word = (groups << (torch.arange(8) * bits)).sum(-1, keepdim=True)  # 8 x bits <= 32 bits of an int64
    packed = (word >> (torch.arange(bits) * 8)) & 0xFF
    return packed.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_codes` undone: [..., n * bits / 8] uint8 -> [..., n] int64 codes (ready to index a table)."""
    if bits == 8:
        return packed.long()
    groups = packed.reshape(*packed.shape[:-1], -1, bits).to(torch.int64)
    word = (groups << (torch.arange(bits) * 8)).sum(-1, keepdim=True)
    codes = (word >> (torch.arange(8) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


LOOKUP_BITS = {1: 8, 2: 8, 3: 12, 4: 16}
"""Bits of packed codes read per table lookup in `decode_packed`: a byte (8 or 4 codes), 12 bits (4 three-bit codes,
half of a 3-byte group) or 16 bits (4 four-bit codes); the table holds 2^these rows of as many levels."""


@lru_cache(maxsize=64)
def _lookup_table(bits: int, levels: tuple[float, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """[2^LOOKUP_BITS[bits], LOOKUP_BITS[bits] / bits]: row w holds the levels of the codes packed in word w (cached:
    read-only; at most 65,536 x 4 values, 1 MiB in float32)."""
    width = LOOKUP_BITS[bits]
    words = torch.arange(2**width)
    codes = torch.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(width // bits)], dim=-1)
    return torch.tensor(levels, dtype=torch.float64)[codes].to(dtype=dtype, device=device)


def decode_packed(packed: torch.Tensor, bits: int, levels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`levels[unpack_codes(packed, bits)]` in `dtype`, the same values, with one table lookup per 8, 12 or 16 packed
    bits instead of one per code (`LOOKUP_BITS`): torch's gather costs about the same per index whatever the row's
    width, so reading four codes per lookup is about four times faster (measured on one key store of [1, 3, 2,048,
    64] at 4 bits: 1.4 ms per code, 0.36 ms per 16 bits). The 16-bit words are read as little-endian int16 (x86, ARM).

    Args:
        packed: [..., n * bits / 8] uint8 from `pack_codes`.
        bits: 1 to 4, or 8.
        levels: [2^bits] the value of each code (a code's centroids, or 0 .. 2^bits - 1 for uniform codes).
        dtype: the result's dtype.

    Returns:
        [..., n] of `dtype`: a new tensor.
    """
    if bits == 8:
        return levels.to(dtype=dtype, device=packed.device)[packed.long()]
    table = _lookup_table(bits, tuple(levels.tolist()), dtype, str(packed.device))
    if bits in (1, 2):
        index = packed.int()
    elif bits == 4:
        index = packed.contiguous().view(torch.uint16).int()
    else:  # 3 bits: each 3-byte group is 24 bits, two lookups of 12
        groups = packed.reshape(*packed.shape[:-1], -1, 3).to(torch.int32)
        word = groups[..., 0] | (groups[..., 1] << 8) | (groups[..., 2] << 16)
        index = torch.stack([word & 0xFFF, word >> 12], dim=-1)
    return torch.nn.functional.embedding(index, table).reshape(*packed.shape[:-1], -1)


def decode_integers(packed: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """`unpack_codes(packed, bits)` as `dtype` (the codes themselves: uniform codes before their scale and zero), by
    shifts and masks on the bytes for 1, 2, 4 and 8 bits, each written once into the result, converted on the way (no
    table: 0.8 ms against 1.4 ms by `decode_packed` for a [1, 3, 8,000, 64] store at 4 bits); 3 bits by
    `decode_packed`.

    Args:
        packed: [..., n * bits / 8] uint8 from `pack_codes`. bits: 1 to 4, or 8. dtype: the result's.

    Returns:
        [..., n] of `dtype`, a new tensor.
    """
    if bits == 3:
        return decode_packed(packed, bits, torch.arange(8, dtype=torch.float64), dtype)
    if bits == 8:
        return packed.to(dtype)
    per = 8 // bits
    out = torch.empty(*packed.shape, per, dtype=dtype, device=packed.device)
    mask = (1 << bits) - 1
    for index in range(per):
        out[..., index] = (packed >> (bits * index)) & mask if index < per - 1 else packed >> (bits * index)
    return out.reshape(*packed.shape[:-1], -1)
