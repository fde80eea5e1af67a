"""hqq's `optimize` switch: its quantizer with the half-quadratic optimiser of scales and zero points off.

hqq's `Quantizer.quantize(tensor, ..., optimize=True)` (the default, and transformers' `HQQQuantizedLayer._quantize`,
which leaves it at that) first takes each group's min and max, then refines the zero points by up to 20 iterations
of a proximal solver of the lp-norm error (`hqq.core.optimize.optimize_weights_proximal_legacy`; HQQ, Badri and
Shaji 2023, https://mobiusml.github.io/hqq_blog/). `optimize=False`, the library's own option, stops after the
min-max rounding: `round(x * scale + zero)` clamped, what optimum-quanto does too.

Why a KV cache wants the choice: the solver is a dozen element-wise passes (a fractional power among them) per
iteration over every value quantized, so a flush of one 128-token block in all 30 layers of the embedded model costs
200-405 ms, 2.4-3.8 times a plain decode step at 1k-8k tokens; without it the flush step is 1.05-1.31 times a plain
one (docs/benchmarks.md, "hqq's optimiser", which gives what the solver buys in fidelity beside the cost: little at
4 bits, 10-46 % of the mean KL at 3 bits).

How: `MinMaxQuantizer` is hqq's `Quantizer` whose `quantize` passes `optimize=False`; a layer built with
`optimize=false` has it as its `quantizer` attribute (transformers' layer calls `self.quantizer.quantize` and
`self.quantizer.dequantize`). The store it makes is hqq's own `(W_q, meta)` pair, de-quantized by hqq's own code.
"""

from __future__ import annotations

from hqq.core.quantize import Quantizer


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
