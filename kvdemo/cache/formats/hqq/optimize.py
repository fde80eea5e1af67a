"""hqq's `optimize` option: its half-quadratic optimiser of zero points, fused into one C loop on the CPU, or off.

hqq's `Quantizer.quantize(tensor, ..., optimize=True)` (the default, and transformers' `HQQQuantizedLayer._quantize`,
which leaves it at that) first takes each group's min and max, then refines the zero points by up to 20 iterations
of a proximal solver of the lp-norm error (`hqq.core.optimize.optimize_weights_proximal_legacy`; HQQ, Badri and
Shaji 2023, https://mobiusml.github.io/hqq_blog/). `optimize=False`, the library's own option, stops after the
min-max rounding: `round(x * scale + zero)` clamped, what optimum-quanto does too.

- `optimize=true` (the default): `ProximalQuantizer`. hqq runs each iteration of its solver as a dozen torch
  operations, each a pass over the tensor, one of them a fractional power; on the blocks a KV cache flushes (a
  128-token block of 3 heads of 64: 24,576 values) each operation costs 3-5 us of dispatch and the power 55 us, so
  one tensor takes about 3 ms and a flush of the embedded model's 30 layers (keys and values) 180 ms, 3.4 plain
  decode steps. `ProximalQuantizer` runs the same iterations with the same stopping rule in one C loop
  per group (`proximal.c`, compiled once per machine by `kvdemo.cache.read.c_build`), about 4 times faster. It
  differs from hqq's solver in float rounding only (the power as expf(p * logf(a)), sums in another order): the
  tests bound the zero points and codes against hqq's own solver on real keys and values. Where the kernel cannot
  be built (no C compiler), on CUDA tensors, and for hqq's other paths (`channel_wise=False`, no groups), it is
  hqq's own `quantize`.
- `optimize=false`: `MinMaxQuantizer`, hqq's `Quantizer` whose `quantize` passes `optimize=False`.

Each is the `quantizer` attribute of the layers built with it (transformers' layer calls `self.quantizer.quantize`
and `self.quantizer.dequantize`). The store is hqq's own `(W_q, meta)` pair, packed and de-quantized by hqq's code.
"""

from __future__ import annotations

import ctypes
import inspect
from pathlib import Path

import torch
from hqq.core.optimize import optimize_weights_proximal_legacy
from hqq.core.quantize import Quantizer

from kvdemo.cache.read import c_build

SOURCE = Path(__file__).with_name("proximal.c")
"""The fused solver's C source."""

SOLVER_PARAMS: dict = inspect.signature(optimize_weights_proximal_legacy).parameters["opt_params"].default
"""hqq's own solver parameters (lp_norm 0.7, beta 10, iters 20 in hqq 0.2.8), read from its signature."""

_FLOAT_P = ctypes.POINTER(ctypes.c_float)


class MinMaxQuantizer(Quantizer):
    """hqq's `Quantizer` with `optimize=False` at every `quantize` (see the module docstring); everything else,
    de-quantization included, is the library's."""

    @classmethod
    def quantize(cls, tensor, *args, **kwargs):
        """`Quantizer.quantize(tensor, *args, optimize=False, **kwargs)`: the min-max rounding only.

        Args:
            tensor: the keys or values to quantize, e.g. [batch, kv_heads, tokens, head_dim].

        Returns:
            hqq's `(W_q, meta)`: the packed codes and the scale, zero point and shape to de-quantize them.
        """
        kwargs["optimize"] = False
        return super().quantize(tensor, *args, **kwargs)


def fused_solver():
    """The C function `hqq_proximal` (`proximal.c`), its argument types set; None where it cannot be used:
    no compiler (`c_build.build_problem(SOURCE)` says why), or an hqq whose `Quantizer.optimize_weights` is no longer
    the legacy proximal solver the kernel repeats."""
    if Quantizer.optimize_weights is not optimize_weights_proximal_legacy:
        return None
    arguments = [_FLOAT_P, _FLOAT_P, _FLOAT_P, ctypes.c_long, ctypes.c_long]
    arguments += [ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_int, _FLOAT_P, ctypes.c_int]
    return c_build.function(SOURCE, "hqq_proximal", ctypes.c_int, arguments)


def _pointer(tensor: torch.Tensor):
    """A float pointer to a contiguous float32 CPU tensor's data."""
    return ctypes.cast(tensor.data_ptr(), _FLOAT_P)


def solve_zero(solver, groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, max_v: int) -> torch.Tensor:
    """hqq's proximal solver of the zero points (`optimize_weights_proximal_legacy`), run by the fused kernel.

    Args:
        solver: `fused_solver()`.
        groups: [rows, group] float32, one group per row.
        scale: [rows] hqq's inverted scales (codes = round(x * scale + zero)).
        zero: [rows] the min-max zero points to start from.
        max_v: the largest code, 2**nbits - 1.

    Returns:
        [rows] the refined zero points (a new tensor).
    """
    groups, scale = groups.contiguous(), scale.contiguous()
    zero, work = zero.clone().contiguous(), torch.empty_like(groups)
    rows, group = groups.shape
    p = SOLVER_PARAMS
    solver(_pointer(groups), _pointer(scale), _pointer(zero), rows, group, float(max_v), p["beta"], p["lp_norm"],
           p["iters"], _pointer(work), torch.get_num_threads())  # fmt: skip
    return zero


class ProximalQuantizer(Quantizer):
    """hqq's `Quantizer` whose optimiser is the fused kernel on CPU tensors (see the module docstring)."""

    @classmethod
    def quantize(
        cls,
        tensor: torch.Tensor,
        nbits: float = 4,
        channel_wise: bool = True,
        group_size: int | None = 64,
        optimize: bool = True,
        round_zero: bool = False,
        axis: int = 0,
        bitpack: bool = True,
        compute_dtype: torch.dtype | None = None,
        view_as_float: bool = False,
        device: str = "cuda",
    ):
        """hqq 0.2.8's `Quantizer.quantize` (hqq/core/quantize.py) step for step, with `Quantizer.optimize_weights`
        replaced by `solve_zero`: the groups (`axis` 1: rows of `group_size` consecutive values; 0: columns of a
        [group_size, -1] view), their min-max scale and zero point, the solver, the codes, then hqq's own meta and
        bit packing. Falls back to hqq's own `quantize` where the kernel does not apply (module docstring).

        Args:
            tensor: the keys or values to quantize, e.g. [batch, kv_heads, tokens, head_dim], on the CPU.

        Returns:
            hqq's `(W_q, meta)`.
        """
        solver = fused_solver() if optimize and channel_wise and group_size else None
        if solver is None or tensor.device.type != "cpu":
            return super().quantize(tensor, nbits, channel_wise, group_size, optimize, round_zero, axis, bitpack,
                                    compute_dtype, view_as_float, device)  # fmt: skip
        assert nbits in Quantizer.SUPPORTED_BITS and axis in (0, 1) and group_size, (nbits, axis, group_size)
        W = tensor.float()
        shape = W.shape
        W = W.reshape(-1, group_size) if axis == 1 else W.reshape(group_size, -1)
        _min, _max = W.min(dim=axis, keepdim=True)[0], W.max(dim=axis, keepdim=True)[0]
        max_v = round(2**nbits - 1)
        denom = _max - _min
        scale = max_v / denom
        scale = torch.where(denom.abs() <= 1e-4, torch.full_like(scale, 1.0), scale).clamp(max=2e4)
        zero = -_min * scale
        if round_zero:
            zero = torch.round(zero)
        rows = W if axis == 1 else W.t()
        zero = solve_zero(solver, rows, scale.reshape(-1), zero.reshape(-1), max_v).reshape(zero.shape)
        W_q = torch.round(W * scale + zero).clamp_(0, max_v)
        meta = {"nbits": nbits, "group_size": group_size, "shape": shape, "scale": 1.0 / scale, "zero": zero}
        meta |= {"axis": axis, "packing": Quantizer.bit_to_packing[nbits], "view_as_float": view_as_float}
        meta["unpack_view_dtype"] = Quantizer.unpack_view_dtype[meta["packing"]]
        if bitpack:
            W_q = Quantizer.pack[meta["packing"]](W_q)
            if view_as_float:
                W_q = W_q.view(torch.float32 if compute_dtype is None else compute_dtype)
        else:
            W_q = W_q.to(tensor.dtype)
            meta["packing"] = None
        return W_q, meta
