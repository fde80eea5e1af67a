"""What kvdemo does with each kind of cache layer, by transformers' layer type: the one place that maps
`config.layer_types` (as `transformers.cache_utils.get_layer_types_and_kwargs` reads them, KV-shared and MLP-only
layers turned into `dummy`) to what a backend does with a layer (`LayerKind.action`: quantize it, keep it as
transformers builds it, or hold nothing), what the snapshot keeps of it, and what the geometry counts. The spec's
checks (`kvdemo.cache.spec`), the cache builder (`kvdemo.cache.layers.by_kind`), the geometry
(`kvdemo.cache.model.geometry`), the telemetry, the planner (which plans the quantized layers only) and the snapshot
(`kvdemo.cache.state.snapshot`) read it.

- `full_attention`: keys and values that grow with the context; every backend stores them (quantized on the
  quantized backends).
- `sliding_attention`, `chunked_attention`: keys and values of the last `sliding_window` tokens
  (`DynamicSlidingWindowLayer`). A quantized backend keeps them at full precision as transformers builds them
  (`sliding=keep`, the default: vLLM's `kv_cache_dtype_skip_layers=sliding_window`, mlx-lm's rotating cache), or
  quantizes them too (`sliding=quantize`, llama.cpp's choice: `kvdemo.cache.layers.sliding`).
- `linear_attention`, `conv`: a fixed-size conv and recurrent state written in place (Mamba, gated DeltaNet,
  LFM2's short convolutions): no keys, no values; kept as transformers builds them, the snapshot clones the states.
- `hybrid`, `hybrid_sliding`: one layer with both (Falcon-H1); kept whole at full precision on every backend
  (transformers' combined layer class holds the attention and the Mamba parts together).
- `dummy`: a layer that holds nothing (KV shared with an earlier layer, Gemma 3n/4; or no attention).

A quantized backend must quantize at least one layer: a spec that would quantize nothing (a model of sliding layers
alone with `sliding=keep`, Falcon-H1's combined layers) is refused, never a full-precision cache labelled quantized.

Latent caches (Multi-head Latent Attention: DeepSeek-V2/V3, MiniCPM3, Kimi, GLM-4 MoE Lite, Mistral 4) are
`full_attention` layers whose stored tensors are not the attention's keys and values: the model caches a
compressed latent (`[batch, 1, tokens, kv_lora_rank]`) and the rotary part of the key
(`[batch, 1, tokens, qk_rope_head_dim]`) and up-projects them after `cache.update` (`expand_kv`). `is_latent`
names them; their layers are read whole at every step and any rotation is undone before the up-projection
(`kvdemo.cache.layers.flush.quantized_cache`), never block-wise or on the query side.

Everything a backend cannot serve raises `UnsupportedModelError` (a `ValueError`) when the session is built,
before any forward pass, naming the model's layer kinds and what would work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdemo.cache.policies import PROTECT_CHOICES, SLIDING_CHOICES, VLLM_PROTECT, parse_protect

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

QUANTIZE, KEEP, NOTHING = "quantize", "keep", "nothing"
"""What a backend does with a layer (`LayerKind.action`)."""


class UnsupportedModelError(ValueError):
    """A spec that cannot be served on this model's kind of layers, raised before the prefill: the message names
    the layer kinds and what would work. A `ValueError`, so every caller that reports bad input reports it."""


@dataclass(frozen=True)
class LayerKind:
    """What kvdemo does with one of transformers' layer types.

    Attributes:
        name: transformers' layer type (`full_attention`, `sliding_attention`, ...).
        holds_kv: the layer caches keys and values (`layer.keys`, `layer.values`).
        in_place_state: the layer holds conv or recurrent states written in place (cloned by the snapshot).
        sliding: the keys and values are the last `sliding_window` tokens only.
        quantizable: a quantized backend stores this layer quantized (full attention; a sliding layer with
            `sliding=quantize`, see `action`).
    """

    name: str
    holds_kv: bool
    in_place_state: bool = False
    sliding: bool = False
    quantizable: bool = False

    def action(self, quantized: bool, sliding: str = SLIDING_CHOICES[0]) -> str:
        """What a backend does with this layer: `QUANTIZE` (a quantized backend's layer), `KEEP` (transformers'
        own dynamic layer, full precision) or `NOTHING` (a layer that holds nothing).

        Args:
            quantized: whether the backend quantizes (`Backend.quantized`).
            sliding: the spec's `sliding` option (`kvdemo.cache.policies.SLIDING_CHOICES`).
        """
        if not self.holds_kv and not self.in_place_state:
            return NOTHING
        if quantized and (self.quantizable or (self.sliding and not self.in_place_state and sliding == "quantize")):
            return QUANTIZE
        return KEEP


LAYER_KINDS: dict[str, LayerKind] = {
    "full_attention": LayerKind("full_attention", holds_kv=True, quantizable=True),
    "sliding_attention": LayerKind("sliding_attention", holds_kv=True, sliding=True),
    "chunked_attention": LayerKind("chunked_attention", holds_kv=True, sliding=True),
    "linear_attention": LayerKind("linear_attention", holds_kv=False, in_place_state=True),
    "conv": LayerKind("conv", holds_kv=False, in_place_state=True),
    "hybrid": LayerKind("hybrid", holds_kv=True, in_place_state=True),
    "hybrid_sliding": LayerKind("hybrid_sliding", holds_kv=True, in_place_state=True, sliding=True),
    "dummy": LayerKind("dummy", holds_kv=False),
}
"""transformers' layer types that kvdemo knows, by name; any other is refused on every backend."""


STATE_ATTRIBUTES = ("conv_states", "recurrent_states")
"""The attributes that hold a layer's in-place states (transformers' `LinearAttentionCacheLayerMixin`): state index
-> tensor or None. The snapshot clones them; the telemetry counts them."""


def layer_types(model_config: PreTrainedConfig) -> list[str]:
    """The decoder's layer types, one per layer, as transformers builds a `DynamicCache` from them
    (`get_layer_types_and_kwargs`: KV-shared and MLP-only layers are `dummy`)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    return list(get_layer_types_and_kwargs(model_config.get_text_config(decoder=True))[0])


def is_latent(model_config: PreTrainedConfig) -> bool:
    """Whether the model caches a compressed latent instead of its attention's keys and values (MLA: its text
    config has `kv_lora_rank`; see the module docstring)."""
    return getattr(model_config.get_text_config(decoder=True), "kv_lora_rank", None) is not None


def kinds_text(types: Sequence[str]) -> str:
    """The layer kinds of a model in a few words, e.g. `3 sliding_attention + 1 full_attention layers`."""
    counts = Counter(types)
    return " + ".join(f"{n} {name}" for name, n in counts.items()) + " layers"


def layer_actions(
    model_config: PreTrainedConfig,
    quantized: bool,
    sliding: str = SLIDING_CHOICES[0],
    protect: str = PROTECT_CHOICES[0],
) -> list[str]:
    """`LayerKind.action` of each decoder layer, in order (`QUANTIZE`, `KEEP`, `NOTHING`); a layer type kvdemo does
    not know counts as `KEEP` (`serving_problem` refuses it first). With `protect` (`first:last`,
    `kvdemo.cache.policies.PROTECT_CHOICES`) the first `first` and last `last` of the layers a quantized backend would
    quantize are kept at full precision instead (vLLM's boundary protection); `protect=vllm` is vLLM's own rule
    (`kvdemo.cache.policies.VLLM_PROTECT`)."""
    unknown = LayerKind("unknown", holds_kv=True)
    kinds = [LAYER_KINDS.get(kind, unknown) for kind in layer_types(model_config)]
    actions = [kind.action(quantized, sliding) for kind in kinds]
    if protect == VLLM_PROTECT:  # decoder layers at each end, whatever they are; none on a hybrid model
        edge = min(2, len(actions) // 2)
        hybrid = any(kind.in_place_state for kind in kinds)
        for index in [] if hybrid else [*range(edge), *range(len(actions) - edge, len(actions))]:
            actions[index] = KEEP if actions[index] == QUANTIZE else actions[index]
        return actions
    first, last = parse_protect(protect)
    chosen = [i for i, action in enumerate(actions) if action == QUANTIZE]
    for index in chosen[:first] + chosen[len(chosen) - last :] if last else chosen[:first]:
        actions[index] = KEEP
    return actions


def quantized_layers(
    model_config: PreTrainedConfig, sliding: str = SLIDING_CHOICES[0], protect: str = PROTECT_CHOICES[0]
) -> list[int]:
    """The indices of the layers a quantized backend stores quantized (a plan gives one entry to each)."""
    actions = layer_actions(model_config, True, sliding, protect)
    return [i for i, action in enumerate(actions) if action == QUANTIZE]


def serving_problem(
    backend: str,
    quantized: bool,
    model_config: PreTrainedConfig,
    sliding: str = SLIDING_CHOICES[0],
    protect: str = PROTECT_CHOICES[0],
    takes_sliding: bool = True,
) -> str | None:
    """Why `backend` cannot serve this model's layers, with what would work, or None.

    Args:
        backend: the backend's name (for the message).
        quantized: whether it is a quantized backend (`Backend.quantized`).
        model_config: the model's config.
        sliding: the spec's `sliding` option (`keep` or `quantize`).
        takes_sliding: whether the backend takes `sliding` (mlx keeps sliding-window layers, as mlx-lm must).
        protect: the spec's `protect` option (`first:last`); protecting every quantized layer is refused.
    """
    types = layer_types(model_config)
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown:
        return (
            f"this model has {kinds_text(types)}; kvdemo does not know how to save and restore "
            f"{', '.join(unknown)} layers, so no backend can serve it. Use a model whose layers are "
            f"{', '.join(LAYER_KINDS)}"
        )
    if not any(LAYER_KINDS[t].holds_kv for t in types):
        return f"this model has {kinds_text(types)}: no layer caches keys and values, so there is no KV cache to show"
    if quantized and not quantized_layers(model_config, sliding):
        slides = any(LAYER_KINDS[t].sliding and not LAYER_KINDS[t].in_place_state for t in types)
        fix = (
            "set sliding=quantize to quantize the sliding-window layers (llama.cpp's choice), or use backend=dynamic"
            if slides and sliding != "quantize" and takes_sliding
            else f"{backend} keeps sliding-window layers at full precision: use a backend that takes sliding=quantize, "
            "or backend=dynamic"
            if slides and not takes_sliding
            else "backend=dynamic serves it"
        )
        return (
            f"backend={backend} would quantize nothing here: this model has {kinds_text(types)}, and kvdemo "
            f"quantizes full_attention layers (sliding_attention ones with sliding=quantize) and keeps the others at "
            f"full precision (hybrid attention-and-Mamba layers whole); {fix}"
        )
    if quantized and not quantized_layers(model_config, sliding, protect):
        count = len(quantized_layers(model_config, sliding))
        counted = [c for c in PROTECT_CHOICES if c != VLLM_PROTECT]
        most = next((c for c in reversed(counted) if quantized_layers(model_config, sliding, c)), "0:0")
        lower = f"set protect={most} or lower" if most != PROTECT_CHOICES[0] else f"set protect={most}"
        return (
            f"protect={protect} keeps the first and last layers of the {count} layers {backend} quantizes on this "
            f"model at full precision, so it would quantize nothing; {lower} (protect=0:0 protects none; written "
            "beside a preset, backend:preset,protect=..., it replaces the preset's)"
        )
    return None
