"""The options a format may take, as its card (`kvdemo.cache.backend.Backend.options`) declares them: `Option`, the
order the page and the command line show them in, and the options several formats share (the group-wise integer ones,
`sliding`, `protect`). No torch: the command line's `--help` reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypedDict

from kvdemo.cache.layer_plan import PLAN, canonical_plan
from kvdemo.cache.layer_plan import SYNTAX as PLAN_SYNTAX
from kvdemo.cache.policies import (
    FLUSH_POLICIES,
    PROTECT_CHOICES,
    ROTATIONS,
    SLIDING_CHOICES,
)

SHOWN_ORDER = (
    "nbits",
    "q_group_size",
    "residual_length",
    "axis_key",
    "axis_value",
    "flush",
    "storage",
    "rotation",
    "nbits_value",
    "optimize",
    "sliding",
    "protect",
    "scale",
    "norm_correction",
    "type_k",
    "type_v",
    "layout",
    PLAN,
)
"""The order in which the page's fields, the command line's flags and the tables' columns show the options kvdemo's
formats have taken so far (the page's `/prefill` API takes them in this order, so a browser's kept state and a client's
positional call keep meaning what they meant). An option a format adds later goes after them
(`kvdemo.cache.registry.SPEC_OPTIONS`); the options themselves are each format's (`Backend.options`)."""

PLANNED = ("nbits", "nbits_value", "rotation")
"""The options a plan sets per layer: a spec with a plan leaves them unset (`CacheSpec.validate`)."""


class SpecOptions(TypedDict, total=False):
    """Options by name, as `CacheSpec.given()` and `CacheSpec.resolved()` give them, for the type checker: the keys of
    the options formats have taken so far (`SHOWN_ORDER`), integers but for the text options (`flush`, `storage`,
    `rotation`, `optimize`, `type_k`, ...); a later format's options are read with `.get`."""

    nbits: int
    nbits_value: int
    q_group_size: int
    residual_length: int
    axis_key: int
    axis_value: int
    flush: str
    storage: str
    rotation: str
    optimize: str
    sliding: str
    protect: str
    scale: str
    norm_correction: str
    type_k: str
    type_v: str
    layout: str
    plan: str


@dataclass(frozen=True)
class Option:
    """One option of a backend.

    Attributes:
        name: the transformers keyword (`nbits`, `q_group_size`, `residual_length`, `axis_key`, `axis_value`), or
            kvdemo's `flush` (the flush policy, `kvdemo.cache.layers.flush`) or `storage` (how `dynamic` grows its
            tensors, `kvdemo.cache.layers.storage`).
        default: the value transformers uses when the option is left unset.
        choices: the allowed values (integers, or words for a text option such as `flush`), or None where any
            integer >= `minimum` is allowed (then model-dependent rules may narrow it, see `CacheSpec.validate`).
        minimum: the smallest allowed value when `choices` is None.
        help: one line for `--help` and the page, with the unit.
        same_as: for an option that takes another option's value when unset (`nbits_value` takes `nbits`'s, so
            that `nbits` alone means transformers' one precision for keys and values), that option's name; its
            `default` is then only the other option's default.
        canonical: for a text option written in a syntax of its own rather than chosen from `choices` (`plan`), the
            function that checks a text and gives its one canonical form (raises ValueError saying what to change);
            `syntax` describes that syntax in one line.
        acts_on: the layer kinds the option changes, where it does not act on full-attention layers (`sliding`:
            sliding_attention, chunked_attention); empty for the others. `kvdemo.cache.catalogue.all_specs` leaves
            such an option at its default (on the test models it changes nothing); the model-family matrix runs it.
        in_matrix: False for an option `all_specs` leaves at its default because it changes which layers are
            quantized rather than how (`protect`: each of its values keeps layers as `dynamic` keeps them; its own
            tests run it on every backend, `tests/test_protect.py`), or only which block format one layer class
            writes (`ggml`'s `type_k` and `type_v`: each type byte for byte in `tests/test_ggml.py`; mlx's `nbits`,
            nvfp4's rules, fp8's `float8`: each in its format's tests).
        quiet: True for an option added after specs were written without it (`sliding`, `protect`, `scale`,
            `norm_correction`): at its default, `CacheSpec.full_text` and the page's spec leave it out, so a text
            without it keeps meaning what it meant.
    """

    name: str
    default: int | str
    choices: tuple[int | str, ...] | None = None
    minimum: int | None = None
    help: str = ""
    same_as: str | None = None
    canonical: Callable[[str], str] | None = None
    syntax: str = ""
    acts_on: tuple[str, ...] = ()
    in_matrix: bool = True
    quiet: bool = False

    @property
    def is_text(self) -> bool:
        """True for an option whose values are words (`flush`, `storage`), False for an integer option."""
        return isinstance(self.default, str)

    def allowed_text(self) -> str:
        """The allowed values as text: `2|4`, `>=1`, or the syntax of a text option without choices (`plan`)."""
        if self.canonical is not None:
            return self.syntax
        return "|".join(map(str, self.choices)) if self.choices is not None else f">={self.minimum}"

    @property
    def default_text(self) -> str:
        """The default as `--help` and the README say it: `4`, `requantize`, `nbits` for a `same_as` option, `none`
        for an empty one (`plan`)."""
        return self.same_as or str(self.default) or "none"


SLIDING_OPTION = Option(
    "sliding",
    SLIDING_CHOICES[0],
    choices=SLIDING_CHOICES,
    help="sliding-window layers: keep them at full precision as transformers builds them (vLLM, mlx-lm), or quantize "
    "them too, forgetting tokens past the window (llama.cpp)",
    acts_on=("sliding_attention", "chunked_attention"),
    quiet=True,
)
"""The quantized backends' `sliding` option (`kvdemo.cache.policies.SLIDING_CHOICES`,
`kvdemo.cache.model.layer_kinds`)."""

ENGINE_SLIDING_OPTION = replace(
    SLIDING_OPTION,
    default=SLIDING_CHOICES[1],
    help="sliding-window layers: quantize them in the same format, as vLLM and SGLang store every attention layer "
    "(the default), or keep them at full precision (vLLM's --kv-cache-dtype-skip-layers sliding_window)",
)
"""`sliding` for a format an engine stores in one dtype for every attention layer (nvfp4, int8): quantized by
default; kept is vLLM's skip-layers line (`kvdemo.cache.deploy.vllm_skip_layers`)."""

PROTECT_OPTION = Option(
    "protect",
    PROTECT_CHOICES[0],
    choices=PROTECT_CHOICES,
    help="first:last: keep that many of the first and of the last quantized layers at full precision (vLLM keeps 2:2 "
    "under its TurboQuant presets)",
    in_matrix=False,
    quiet=True,
)
"""The quantized backends' `protect` option (`kvdemo.cache.policies.PROTECT_CHOICES`,
`kvdemo.cache.model.layer_kinds`)."""


def group_options(nbits: tuple[int, ...], axes: tuple[int, ...]) -> dict[str, Option]:
    """The options of a group-wise integer backend with a residual (transformers' `QuantizedLayer`)."""
    return {
        "nbits": Option(
            "nbits",
            4,
            choices=nbits,
            help="bits per quantized value (the keys', and the values' too unless nbits_value is set)",
        ),
        "nbits_value": Option(
            "nbits_value",
            4,
            choices=nbits,
            help="bits per quantized value of the values alone (llama.cpp's --cache-type-v beside --cache-type-k); "
            "unset: nbits, as transformers",
            same_as="nbits",
        ),
        "q_group_size": Option(
            "q_group_size",
            64,
            minimum=1,
            help="values that share one scale and zero point (must fit head_dim; left at 64 on a head_dim it does not "
            "divide, the largest power of two that does)",
        ),
        "residual_length": Option(
            "residual_length", 128, minimum=1, help="tokens kept in full precision before a flush quantizes them"
        ),
        "axis_key": Option("axis_key", 0, choices=axes, help="axis along which keys are grouped"),
        "axis_value": Option("axis_value", 0, choices=axes, help="axis along which values are grouped"),
        "flush": Option(
            "flush",
            FLUSH_POLICIES[0],
            choices=FLUSH_POLICIES,
            help="at a flush, re-quantize the whole layer (transformers) or append the residual block (KIVI)",
        ),
        "rotation": Option(
            "rotation",
            ROTATIONS[0],
            choices=ROTATIONS,
            help="hadamard: keys and values rotated along head_dim before quantizing, the query rotated to match "
            "(QuaRot, llama.cpp); none: as transformers",
        ),
        "sliding": SLIDING_OPTION,
        "protect": PROTECT_OPTION,
        PLAN: Option(
            PLAN,
            "",
            help="each layer's nbits, nbits_value and rotation (kvdemo.cache.layer_plan; made by kvdemo.evals.planner "
            "for a byte budget); set, it replaces nbits, nbits_value and rotation",
            canonical=canonical_plan,
            syntax=PLAN_SYNTAX,
        ),
    }
