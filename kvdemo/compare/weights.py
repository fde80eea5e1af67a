"""What a model's weights say about its KV cache before anything runs (`read_weights`): the traits a recommendation
prints beside its pick, and the one it acts on.

- **head_dim** of each stored key, and **query heads per KV head** (GQA): with many query heads on one KV head, one
  stored key's error reaches all of them.
- **QK-norm** (an RMSNorm on each head's queries and keys before RoPE: Qwen3, Gemma 3, OLMo 2): it holds every key
  to a fixed scale; without it a key channel can grow without bound, and a group-wise grid spends its range on it.
- **The key bias per layer**, ||b_k|| of `k_proj.bias`: Qwen2 and Qwen2.5 carry huge key biases at their first and
  last layers (llama.cpp#21385: ||b_k|| about 605 and 921 on Qwen2.5-7B against a median of 22, and every model of a
  26-model sweep with a layer over 5x the median quantized its cache worse). A bias adds one fixed vector to every
  key of its layer, so the layer's keys sit far from zero in a few channels. A layer over `OUTLIER` x the median is an
  outlier; where every outlier lies within the first or last `PROTECTABLE` layers, the recommendation also measures
  each candidate that can keep layers at full precision with those layers kept (`protect=n:n`,
  `kvdemo.cache.policies`), and where one lies deeper it says so.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from kvdemo.cache.model.geometry import kv_geometry
from kvdemo.cache.policies import PROTECT_CHOICES
from kvdemo.qa.models import LoadedModel

OUTLIER = 5.0
"""A layer whose key bias norm passes this many times the median of the layers' is an outlier (llama.cpp#21385's
sweep: every model over 5x quantized its cache worse)."""
PROTECTABLE = max(int(c.split(":")[0]) for c in PROTECT_CHOICES if c[0].isdigit())
"""The most layers `protect` keeps at each end (4: `protect=4:4`)."""


@dataclass(frozen=True)
class WeightTraits:
    """What the weights say (see the module's docstring).

    Attributes:
        head_dims: the distinct head_dim of the stored keys, ascending.
        gqa: query heads per KV head (1.0: multi-head attention).
        qk_norm: whether every attention layer normalizes its keys (`k_norm`).
        key_bias_norms: ||k_proj.bias||_2 per attention layer, in layer order (empty: no key bias).
        outliers: the layers whose key bias norm passes `OUTLIER` x the median.
        protect: `n:n` keeping every outlier at full precision, "" where none is or one lies deeper.
    """

    head_dims: tuple[int, ...]
    gqa: float
    qk_norm: bool
    key_bias_norms: tuple[float, ...] = ()
    outliers: tuple[int, ...] = ()
    protect: str = ""

    def summary(self) -> str:
        """One line: `head_dim 64, 3 query heads per KV head, no QK-norm, no key bias`, and the outliers with what
        the recommendation did about them."""
        parts = [
            f"head_dim {'/'.join(map(str, self.head_dims))}",
            f"{self.gqa:g} query heads per KV head",
            "QK-norm" if self.qk_norm else "no QK-norm",
        ]
        if not self.key_bias_norms:
            parts.append("no key bias")
        else:
            median = statistics.median(self.key_bias_norms)
            parts.append(f"key bias norm median {median:.3g}")
            if self.outliers:
                each = ", ".join(f"layer {i} {self.key_bias_norms[i]:.3g}" for i in self.outliers)
                what = (
                    f"candidates also measured with protect={self.protect} (those layers at full precision)"
                    if self.protect
                    else f"too deep for protect (at most {PROTECTABLE} layers at each end)"
                )
                parts.append(f"outliers over {OUTLIER:g}x: {each}; {what}")
        return ", ".join(parts)


def read_weights(loaded: LoadedModel) -> WeightTraits:
    """The traits of `loaded`'s attention layers, read from its modules and config (no forward pass)."""
    attention = [m for m in loaded.model.modules() if isinstance(getattr(m, "k_proj", None), torch.nn.Linear)]
    norms = tuple(
        float(m.k_proj.bias.detach().float().norm()) for m in attention if m.k_proj.bias is not None
    )  # every attention layer, or none
    norms = norms if len(norms) == len(attention) else ()
    geometry = kv_geometry(loaded.config).per_layer
    text = loaded.config.get_text_config(decoder=True)
    heads, kv_heads = getattr(text, "num_attention_heads", 0), getattr(text, "num_key_value_heads", None)
    gqa = heads / (kv_heads or heads) if heads else 1.0
    outliers: tuple[int, ...] = ()
    protect = ""
    if len(norms) > 2 and (median := statistics.median(norms)) > 0:
        outliers = tuple(i for i, n in enumerate(norms) if n > OUTLIER * median)
        depth = max((min(i + 1, len(norms) - i) for i in outliers), default=0)
        protect = f"{depth}:{depth}" if 0 < depth <= PROTECTABLE else ""
    return WeightTraits(
        head_dims=tuple(sorted({layer.key_dim for layer in geometry})),
        gqa=gqa,
        qk_norm=bool(attention) and all(getattr(m, "k_norm", None) is not None for m in attention),
        key_bias_norms=norms,
        outliers=outliers,
        protect=protect,
    )
