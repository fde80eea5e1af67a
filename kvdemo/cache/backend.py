"""`Backend`: a KV cache format's card, as the registry (`kvdemo.cache.registry.BACKENDS`) knows it, and the types of
the rules it carries. Each format fills one in its folder's `__init__.py` (`kvdemo.cache.formats`). No torch: the
command line's `--help` reads them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvdemo.cache.options import Option, SpecOptions

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.deploy import Deployment
    from kvdemo.cache.model.geometry import KVGeometry

BytesFormula = Callable[[SpecOptions, "KVGeometry", int, int, int, bool, "Sequence[int] | None"], float]
"""`formula(options, geometry, tokens, residual_tokens, element_bytes, nominal_bits, blocks) -> bytes` (see
`estimate_kv_bytes`): `options` resolved, `residual_tokens` already capped at what the residual can hold, `blocks`
the store's blocks in tokens (None: one block; only a layout that pads per block reads them)."""
CacheMaker = Callable[[str, SpecOptions, "PreTrainedConfig"], "Cache"]
"""`make(backend_name, options, model_config) -> Cache`: options as a spec gives them (`CacheSpec.given()`)."""
WidthRule = Callable[[SpecOptions, str, int], "str | None"]
"""`rule(options, tensor, width) -> why it cannot run, or None` for one stored tensor (`keys` or `values`) of `width`
values per head and token, for a backend whose layout needs more of a width than a group size (TurboQuant's rotation
and dense packing)."""
GroupRule = Callable[[int, int, int, int, int], "str | None"]
"""`rule(nbits, q_group_size, axis, heads, width) -> why it cannot run, or None` for one stored tensor (keys or
values) of `heads` heads of `width` values per token (`KVGeometry.shapes`)."""
DeployRule = Callable[["Backend", SpecOptions, SpecOptions, "PreTrainedConfig"], "tuple[Deployment, ...]"]
"""`rule(backend, given, resolved, model_config) -> the engines that store this cache the same way on this model`,
each with the line that asks it to (`kvdemo.cache.deploy`), kvdemo's own line left out (`CacheSpec.deployments`
adds it); `given`: the options a spec sets, `resolved`: every option with its default."""


@dataclass(frozen=True)
class Backend:
    """A KV cache backend as the registry knows it.

    Attributes:
        name: the name a spec uses (`dynamic`, `quanto`, `hqq`, `fp8`).
        summary: one line for the page, `--help` and the README: what stores the cache.
        behaviour: one line on its residual and flushes, for the page.
        quantized: True for the `QuantizedCache` backends; they quantize the layers `kvdemo.cache.model.layer_kinds`
            says they take (full attention; sliding with `sliding=quantize`) and keep the others at full precision.
        prefill_reads_cache: True where the engine's prefill attends through the stored cache (llama.cpp reads its
            blocks for the prompt's own tokens): the prefill's chunks then run over the cache itself, never over a
            full-precision `DynamicCache` handed over at the end (`kvdemo.qa.prefill.run_prefill`), and
            `QASession.prefill_from` refuses it. False: the prefill attends in full precision, as transformers'
            quantized layers return their first update's states as given.
        make_cache: `make_cache(name, options, model_config) -> Cache`, the empty cache of validated options (the
            backend's `name`, the options a spec sets: `CacheSpec.given()`), called by `Backend.empty_cache`.
        kv_bytes: its `BytesFormula`.
        options: the options it takes, by name (only `storage` for `dynamic`, only `sliding` for `fp8`).
        group_rule: its `GroupRule` for q_group_size, or None when it takes no q_group_size.
        compare_nbits: the nbits it is compared at by default (`(None,)`: the backend as it is; `()`: not at all),
            its other options at their defaults (`kvdemo.cache.catalogue.default_compare_specs`).
        module: the Python module it needs, or None; pip: the command that installs it.
        width_rule: its `WidthRule`, or None where any width is stored.
        presets: named option sets a spec may give after the colon instead of nbits (`turboquant:k8v4`: vLLM's
            `kv_cache_dtype` presets), name -> {option: value}; `CacheSpec.parse` expands them.
        candidates: option sets a recommendation measures besides its grid and the presets
            (`kvdemo.compare.candidates`; ggml's keys at 8 bits or more with values of fewer bytes).
        combination_rule: `rule(resolved options) -> why they cannot go together, or None`, for options that are
            each allowed but not together (turboquant's norm correction at nbits 8); None where any go together.
        deploy: its `DeployRule`: the engines that store a spec's cache the same way (None: kvdemo only).
        stored: `stored() -> {name: type}`, the store types a session file writes (`store_types`); None: plain tensors
            only.
        on_device: `on_device(device) -> a note or None`, what a GPU job sets up for this format before it runs
            (quanto's unpacking on CUDA, `kvdemo.cache.formats.quanto.device`); None: nothing.
        reference: the implementation its bytes are checked against, and the test that checks them (docs/formats.md).
        residual_rule: `rule(resolved options) -> bool`, whether a spec of these options keeps a full-precision
            residual it flushes (`CacheSpec.keeps_residual`); None: whenever the format takes `residual_length`
            (turboquant's vLLM write path, `residual_length=1` under `layout=vllm`, codes every token as it comes).
        examples: named spec texts the rest of kvdemo starts from (`kvdemo.cache.catalogue.examples`): purpose ->
            {text of this backend: its place among every backend's texts for that purpose}, e.g.
            `{"needle": {"hqq:2": 1, "hqq:4": 2}}`, so that no other module names a backend.
    """

    name: str
    summary: str
    behaviour: str
    quantized: bool
    make_cache: CacheMaker
    kv_bytes: BytesFormula
    options: dict[str, Option] = field(default_factory=dict)
    group_rule: GroupRule | None = None
    compare_nbits: tuple[int | None, ...] = (None,)
    module: str | None = None
    pip: str | None = None
    width_rule: WidthRule | None = None
    presets: dict[str, dict[str, int | str]] = field(default_factory=dict)
    candidates: tuple[dict[str, int | str], ...] = ()
    combination_rule: Callable[[SpecOptions], str | None] | None = None
    deploy: DeployRule | None = None
    examples: dict[str, dict[str, int]] = field(default_factory=dict)
    prefill_reads_cache: bool = False
    stored: Callable[[], dict[str, type]] | None = None
    on_device: Callable[[torch.device], str | None] | None = None
    reference: str = ""
    residual_rule: Callable[[SpecOptions], bool] | None = None

    def set_up(self, device: torch.device) -> str | None:
        """Its set-up on `device` before a GPU job runs (`on_device`), or None where it has none."""
        return self.on_device(device) if self.on_device is not None else None

    def store_types(self) -> dict[str, type]:
        """The types of its store a session file writes (`kvdemo.cache.state.serialize`), by the name the file gives
        them: its records (named tuples of tensors) and tensor subclasses; imported only now (the card needs no
        torch). A store type no format declares is refused at save."""
        return self.stored() if self.stored is not None else {}

    @property
    def hands_over(self) -> bool:
        """Whether a long prefill runs over a full-precision `DynamicCache` and hands the context's keys and values
        to this backend's cache in one update per layer (`kvdemo.qa.prefill.hand_over`)."""
        return self.quantized and not self.prefill_reads_cache

    @property
    def has_residual(self) -> bool:
        """True where the format can keep a full-precision residual that is flushed (it takes `residual_length`);
        whether a spec of it does: `CacheSpec.keeps_residual`."""
        return "residual_length" in self.options

    def empty_cache(self, options: SpecOptions, model_config: PreTrainedConfig) -> Cache:
        """The empty transformers cache of this backend with `options` (the ones a spec sets; transformers fills
        the rest with its defaults, the registry's `Option.default`), checked before by `CacheSpec.validate`."""
        return self.make_cache(self.name, options.copy(), model_config)

    def installed(self) -> bool:
        """Whether the module this backend needs can be imported (without importing it)."""
        if self.module is None:
            return True
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # the parent package (e.g. `optimum`) is missing
            return False

    def options_text(self) -> str:
        """Its options with allowed values and defaults, e.g. `nbits 2|4 (default 4), ...`; `none` without."""
        text = ", ".join(f"{n} {o.allowed_text()} (default {o.default_text})" for n, o in self.options.items())
        return text or "none"
