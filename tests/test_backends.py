"""The backend registry, CacheSpec.validate's messages, build_cache, and a sweep proving that validate
accepts exactly the option combinations that run."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, QuantizedCache
from transformers.cache_utils import Fp8QuantizedLayer, HQQQuantizedLayer, QuantoQuantizedLayer

from kvdemo import BACKENDS, CacheSpec, build_cache
from kvdemo.cache.formats.hqq.layers import ExactHQQLayer
from kvdemo.cache.formats.quanto.layers import ExactQuantoLayer
from kvdemo.cache.model.groups import allowed_group_sizes
from kvdemo.cache.model.layer_kinds import UnsupportedModelError


def _config(kv_heads=3, head_dim=64, layers=1, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=kv_heads * head_dim,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        **extra,
    )


def test_registry_lists_the_formats_and_their_options():
    assert list(BACKENDS) == ["dynamic", "quanto", "hqq", "fp8", "turboquant", "ggml", "nvfp4", "mlx", "int8"]
    assert BACKENDS["quanto"].options["nbits"].choices == (2, 4)
    assert BACKENDS["hqq"].options["nbits"].choices == (1, 2, 3, 4, 8)
    assert BACKENDS["turboquant"].options["nbits"].choices == (2, 3, 4, 8)
    assert list(BACKENDS["fp8"].options) == ["sliding", "protect", "scale", "float8"]
    assert list(BACKENDS["dynamic"].options) == ["storage"]
    assert BACKENDS["dynamic"].options["storage"].choices == ("concat", "growing")
    assert BACKENDS["hqq"].options["residual_length"].default == 128
    assert BACKENDS["turboquant"].options["flush"].default == "append"  # vLLM codes each token once
    assert BACKENDS["quanto"].pip == "pip install optimum-quanto==0.2.7"
    assert [b.has_residual for b in BACKENDS.values()] == [False, True, True, False, True, False, False, False, False]
    assert all("protect" in b.options for b in BACKENDS.values() if b.quantized and b.name not in ("ggml", "mlx"))
    assert list(BACKENDS["mlx"].options) == ["nbits", "kv_group_size", "quantized_kv_start"]  # mlx-lm keeps no layer
    assert list(BACKENDS["ggml"].options) == ["type_k", "type_v", "rotation", "sliding"]  # llama.cpp keeps no layer


def test_numpy_integers_are_integers():
    import numpy as np

    assert CacheSpec("hqq", nbits=np.int64(4)).validate().nbits == 4


def test_spec_defaults_and_label():
    spec = CacheSpec("hqq", nbits=2, residual_length=4)
    assert spec.resolved() == {
        "nbits": 2,
        "nbits_value": 2,  # unset: nbits's, as transformers' one precision
        "q_group_size": 64,
        "residual_length": 4,
        "axis_key": 0,
        "axis_value": 0,
        "flush": "requantize",
        "rotation": "none",
        "optimize": "true",
        "sliding": "keep",  # sliding-window layers at full precision (a text option at its default: not labelled)
        "protect": "0:0",  # no edge layer kept at full precision
    }
    assert spec.label == "hqq nbits=2 q_group_size=64 residual_length=4"
    assert spec.replace(rotation="hadamard").label == "hqq nbits=2 q_group_size=64 residual_length=4 rotation=hadamard"
    assert CacheSpec("fp8").resolved() == {"sliding": "keep", "protect": "0:0", "scale": "per_tensor", "float8": "e4m3"}
    assert CacheSpec("fp8").label == "fp8" and CacheSpec("fp8").full_text == "fp8"  # quiet options at their defaults
    assert CacheSpec("fp8", scale="per_token_head").full_text == "fp8,scale=per_token_head"
    assert CacheSpec("fp8", sliding="quantize").label == "fp8 sliding=quantize"
    # nbits_value is shown only where it differs from nbits, so each text means one spec
    mixed = spec.replace(nbits=4, nbits_value=2)
    assert mixed.label == "hqq nbits=4 nbits_value=2 q_group_size=64 residual_length=4"
    assert mixed.short_text == "hqq:4,nbits_value=2,residual_length=4"
    assert CacheSpec.parse(mixed.full_text) == mixed.replace(q_group_size=64, axis_key=0, axis_value=0).replace(
        flush="requantize", rotation="none", optimize="true"
    )
    assert "nbits_value" not in spec.replace(nbits_value=2).full_text
    assert spec.replace(nbits_value=2).resolved() == spec.resolved()


@pytest.mark.parametrize(
    "text, spec",
    [
        ("dynamic", CacheSpec("dynamic")),
        ("fp8", CacheSpec("fp8")),
        ("hqq:4", CacheSpec("hqq", nbits=4)),
        (" HQQ : 2 , residual-length = 16 ", CacheSpec("hqq", nbits=2, residual_length=16)),
        (
            "quanto:2,q_group_size=32,residual_length=8,axis_key=-1,axis_value=-1",
            CacheSpec("quanto", nbits=2, q_group_size=32, residual_length=8, axis_key=-1, axis_value=-1),
        ),
        ("hqq,q_group_size=32", CacheSpec("hqq", q_group_size=32)),
    ],
)
def test_spec_syntax_round_trips(text, spec):
    assert CacheSpec.parse(text) == spec and CacheSpec.parse(spec.text) == spec


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "an empty spec; write backend[:nbits][,option=value...]"),
        ("hqq:", "give the nbits after the colon"),
        ("hqq:four", "nbits='four' must be an integer"),
        ("hqq:4,residual_length=1_6", "residual_length='1_6' must be an integer"),
        ("hqq:+4", "nbits='+4' must be an integer"),
        ("int3", "backend='int3' is not a backend"),
        ("hqq:4,bits=2", "'bits' is not an option; options: nbits, q_group_size"),
        ("hqq:4,nbits=2", "nbits is given twice"),
        ("hqq:4,residual_length", "is not option=value"),
        ("fp8:4", "nbits=4 is not an option of the fp8 backend"),
        ("quanto:3", "nbits=3 is not allowed for quanto; allowed: 2, 4"),
    ],
)
def test_spec_syntax_errors_say_what_to_write(text, message):
    with pytest.raises(ValueError) as error:
        CacheSpec.parse(text)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "spec, message",
    [
        (CacheSpec("int3"), "backend='int3' is not a backend; choose one of dynamic, quanto, hqq, fp8, turboquant"),
        (CacheSpec("quanto", nbits=3), "nbits=3 is not allowed for quanto; allowed: 2, 4"),
        (CacheSpec("hqq", nbits=5), "nbits=5 is not allowed for hqq; allowed: 1, 2, 3, 4, 8"),
        (CacheSpec("hqq", nbits=0), "nbits=0 is not allowed for hqq; allowed: 1, 2, 3, 4, 8"),
        (
            CacheSpec("fp8", nbits=4),
            "nbits=4 is not an option of the fp8 backend (it takes sliding, protect, scale, float8); leave it unset",
        ),
        (CacheSpec("fp8", residual_length=8), "residual_length=8 is not an option of the fp8 backend"),
        (CacheSpec("dynamic", q_group_size=32), "q_group_size=32 is not an option of the dynamic backend"),
        (CacheSpec("hqq", residual_length=0), "residual_length=0 is not allowed for hqq; it must be >= 1"),
        (CacheSpec("quanto", residual_length=-3), "residual_length=-3 is not allowed for quanto; it must be >= 1"),
        (CacheSpec("quanto", q_group_size=0), "q_group_size=0 is not allowed for quanto; it must be >= 1"),
        (CacheSpec("quanto", axis_key=1), "axis_key=1 is not allowed for quanto; allowed: 0, -1"),
        (CacheSpec("hqq", axis_value=-1), "axis_value=-1 is not allowed for hqq; allowed: 0, 1"),
        (CacheSpec("hqq", nbits=4.0), "nbits=4.0 must be an integer"),
        (CacheSpec("hqq", residual_length=True), "residual_length=True must be an integer"),
        (CacheSpec(["hqq"]), "backend=['hqq'] is not a backend"),
        (
            CacheSpec("hqq", residual_length=10**40),
            "residual_length=1000000000000000000000000000000000000... is not allowed; it must be <= 1,048,576",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None,
)
def test_invalid_options_are_refused_with_what_is_allowed(spec, message):
    with pytest.raises(ValueError) as error:
        spec.validate()
    assert message in str(error.value)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            CacheSpec("quanto", q_group_size=48),
            "q_group_size=48 (axis_key=0): q_group_size=48 must divide head_dim=64; "
            "allowed here: 1, 2, 4, 8, 16, 32, 64",
        ),
        (CacheSpec("hqq", q_group_size=128), "q_group_size=128 must divide head_dim=64"),
        (
            CacheSpec("hqq", nbits=1, q_group_size=4),
            "hqq packs 8 1-bit values together, so q_group_size must be a multiple of 8; allowed here: 8, 16, 32, 64",
        ),
        (CacheSpec("hqq", nbits=2, q_group_size=2), "so q_group_size must be a multiple of 4"),
        (CacheSpec("hqq", nbits=3, axis_key=1), "nbits=3 with axis_key=1: hqq's 3-bit packing"),
        # no group size fits the values' 3 bits on axis 1: the message names the bits, not q_group_size
        (CacheSpec("hqq", nbits=4, nbits_value=3, axis_value=1), "nbits_value=3 with axis_value=1: hqq's 3-bit"),
        (
            CacheSpec("hqq", nbits=4, axis_value=1, q_group_size=64),
            "num_key_value_heads x head_dim / q_group_size = 192/64",
        ),
        # the sizes offered fit keys and values alike (3 fits the keys' axis -1, not the values' head_dim)
        (
            CacheSpec("quanto", axis_key=-1, q_group_size=64),
            "with axis -1 must divide num_key_value_heads=3; allowed here: 1",
        ),
    ],
)
def test_group_sizes_that_do_not_fit_the_model_are_refused(spec, message):
    with pytest.raises(ValueError) as error:
        spec.validate(_config())
    assert message in str(error.value)


@pytest.mark.parametrize(
    "spec, head_dim, fitted",
    [
        (CacheSpec("hqq", nbits=4, axis_value=1), 64, 32),  # 64 does not fit axis 1's 3 x 64 in 4-bit packs
        (CacheSpec("quanto", axis_key=-1), 64, None),  # axis -1 on 3 heads takes 1 or 3: refused, never fitted to 1
        (CacheSpec("hqq"), 96, 32),  # Phi-3's head_dim: 3 x 32
        (CacheSpec("quanto"), 80, 16),  # 80 = 5 x 16
        (CacheSpec("hqq"), 192, 64),  # the default fits: left unset
        (CacheSpec("hqq", nbits=1), 80, 16),  # 1-bit packs of 8: 16 divides 80
    ],
)
def test_an_unset_q_group_size_is_fitted_to_the_model(spec, head_dim, fitted):
    """A q_group_size left unset takes the backend's default (64) where it fits the stored widths, else the largest
    size below it that fits keys and values alike; the fitted spec says so in its text."""
    config = _config(head_dim=head_dim)
    if fitted is None:
        with pytest.raises(ValueError, match="q_group_size=64 \\(axis_key=-1\\): .* allowed here: 1"):
            spec.validate(config)
        return
    got = spec.validate(config)
    assert got.resolved()["q_group_size"] == fitted
    assert (got.q_group_size is None) == (fitted == 64)
    assert build_cache(spec, config).layers[0].q_group_size == fitted


def test_a_quantized_backend_that_would_quantize_nothing_is_refused_with_what_works():
    mixed = _config(layers=2, layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    assert CacheSpec("hqq").validate(mixed).backend == "hqq"  # the full-attention layer quantized, the other kept
    every_sliding = _config(layers=2, layer_types=["sliding_attention"] * 2, sliding_window=16)
    for backend in ("quanto", "hqq", "fp8"):
        with pytest.raises(
            UnsupportedModelError,
            match=f"backend={backend} would quantize nothing here: this model has 2 sliding_attention layers.*; "
            "set sliding=quantize to quantize the sliding-window layers \\(llama.cpp's choice\\), or use "
            "backend=dynamic",
        ):
            CacheSpec(backend).validate(every_sliding)
        assert CacheSpec(backend, sliding="quantize").validate(every_sliding).sliding == "quantize"
    assert CacheSpec("dynamic").validate(every_sliding).backend == "dynamic"


def test_missing_backend_package_raises_import_error_with_pip_command(monkeypatch):
    monkeypatch.setitem(BACKENDS, "hqq", dataclasses.replace(BACKENDS["hqq"], module="hqq_not_installed_here"))
    with pytest.raises(
        ImportError, match=r"the hqq backend needs the hqq_not_installed_here package: pip install hqq==0.2.8.post1"
    ):
        CacheSpec("hqq").validate()
    monkeypatch.setitem(BACKENDS, "quanto", dataclasses.replace(BACKENDS["quanto"], module="optimum_missing.quanto"))
    with pytest.raises(ImportError, match="pip install optimum-quanto==0.2.7"):
        build_cache(CacheSpec("quanto"), _config())


def test_build_cache_returns_the_transformers_classes_with_the_options():
    config = _config(layers=2)
    assert type(build_cache(CacheSpec(), config)) is DynamicCache
    cache = build_cache(CacheSpec("hqq", nbits=2, q_group_size=16, residual_length=5, axis_value=1), config)
    assert type(cache) is QuantizedCache and all(type(layer) is ExactHQQLayer for layer in cache.layers)
    layer = cache.layers[0]
    assert (layer.nbits, layer.q_group_size, layer.residual_length, layer.axis_key, layer.axis_value) == (
        2,
        16,
        5,
        0,
        1,
    )
    assert type(build_cache(CacheSpec("quanto"), config).layers[1]) is ExactQuantoLayer  # transformers', in place
    assert issubclass(ExactQuantoLayer, QuantoQuantizedLayer) and issubclass(ExactHQQLayer, HQQQuantizedLayer)
    fp8 = build_cache(CacheSpec("fp8"), config).layers[0]
    assert isinstance(fp8, Fp8QuantizedLayer) and type(fp8).__name__ == "ExactFp8Layer"  # transformers', bitwise
    with pytest.raises(ValueError):
        build_cache(CacheSpec("quanto", nbits=8), config)


def test_allowed_group_sizes_on_the_embedded_shape():
    config = _config()
    assert allowed_group_sizes(CacheSpec("hqq", nbits=1), config)["axis_key"] == [8, 16, 32, 64]
    assert allowed_group_sizes(CacheSpec("hqq", nbits=4, axis_value=1), config)["axis_value"] == [
        1,
        2,
        3,
        4,
        6,
        8,
        12,
        16,
        24,
        32,
        48,
        96,
    ]
    assert allowed_group_sizes(CacheSpec("fp8"), config) == {"axis_key": [], "axis_value": []}


def _runs(model, config, spec) -> bool:
    """Prefill lengths 1, 5 and 37, then three decode steps with residual_length=2 (flushes)."""
    for tokens in (1, 5, 37):
        cache = QuantizedCache(spec.backend, config, **spec.given())
        try:
            with torch.no_grad():
                out = model(torch.arange(tokens).view(1, -1) % 64, cache=cache)
                for _ in range(3):
                    out = model(torch.tensor([[1]]), cache=cache)
        except (ValueError, RuntimeError):
            return False
        if not torch.isfinite(out.logits).all():
            return False
    return True


@pytest.mark.parametrize("kv_heads, head_dim", [(3, 64), (2, 32)])
@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_validation_predicts_what_runs(backend, kv_heads, head_dim):
    """Every nbits x q_group_size x axis combination on the embedded model's KV shape (3 heads of 64) and
    another: every spec validate() accepts runs without an error (validate may refuse a few that would run:
    it asks q_group_size to divide head_dim where the backend would take a divisor of heads x head_dim)."""
    config = _config(kv_heads=kv_heads, head_dim=head_dim)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    info = BACKENDS[backend]
    mismatches, accepted_count = [], 0
    axes = info.options["axis_key"].choices
    for nbits, group, axis_key, axis_value in itertools.product(
        info.options["nbits"].choices, (1, 2, 3, 4, 8, 16, 32, 48, 64, 128), axes, axes
    ):
        spec = CacheSpec(
            backend, nbits=nbits, q_group_size=group, residual_length=2, axis_key=axis_key, axis_value=axis_value
        )
        try:
            spec.validate(config)
            accepted = True
        except ValueError:
            accepted = False
        accepted_count += accepted
        if accepted and not _runs(model, config, spec):
            mismatches.append(f"accepted but fails: {spec.label}")
    assert mismatches == []
    assert accepted_count >= 20
