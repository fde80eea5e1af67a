"""The model families of the model-family matrix, listed in one place: one tiny random model per family, built from
its own transformers config class (4 layers, hidden 128, the embedded tokenizer's vocabulary), and the table of what
kvdemo does with each family on each backend (docs/models.md holds it; `python -m tests.families` prints it).

The table is what `CacheSpec.validate` says before anything runs (works, or refused and why);
`tests/test_families.py` runs every cell it says works and proves it right, and proves every refused cell is
refused before the prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import AutoConfig, PreTrainedConfig

from kvdemo.cache.model.layer_kinds import kinds_text, layer_types, quantized_layers
from kvdemo.cache.policies import SLIDING_CHOICES
from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.models import LoadedModel

VOCAB = 49152
"""The embedded tokenizer's vocabulary (SmolLM2)."""

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,
)
_LINEAR = dict(
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
_MAMBA2 = dict(mamba_n_heads=16, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)
_SLIDING = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
_GEMMA4 = dict(global_head_dim=64, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, sliding_window=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama 3": ("llama", {}),
    "Qwen3": ("qwen3", {}),
    "Qwen3-MoE": ("qwen3_moe", _MOE),
    "Mistral": ("mistral", dict(sliding_window=None)),
    "Mistral (window)": ("mistral", dict(sliding_window=16)),
    "Phi-3 longrope": (  # its switch at 64 tokens, below the matrix's context: prefilled in one pass, long factors
        "phi3",
        dict(
            original_max_position_embeddings=64,  # the config's own field wins over rope_parameters' (else 4096)
            rope_parameters=dict(
                rope_type="longrope",
                short_factor=[1.0] * 16,
                long_factor=[1.5] * 16,
                original_max_position_embeddings=64,
                rope_theta=10000.0,
            ),
        ),
    ),
    "SmolLM3": ("smollm3", {}),
    "OLMo 2": ("olmo2", {}),
    "OLMo 3": ("olmo3", dict(sliding_window=16)),
    "Granite 3": ("granite", {}),
    "Command R": ("cohere", {}),
    "Cohere2": ("cohere2", dict(sliding_window=16)),
    "Gemma 2": ("gemma2", dict(sliding_window=16)),
    "Gemma 3": ("gemma3_text", dict(sliding_window=16, layer_types=_SLIDING)),
    "Gemma 4": ("gemma4_text", dict(layer_types=_SLIDING, **_GEMMA4)),
    "Gemma 4 (KV sharing)": (
        "gemma4_text",
        dict(layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, **_GEMMA4),
    ),
    "GPT-OSS": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
    "Qwen3-Next": ("qwen3_next", dict(shared_expert_intermediate_size=64, **_MOE, **_LINEAR)),
    "Qwen3.5": ("qwen3_5_text", _LINEAR),
    "Falcon-H1": ("falcon_h1", dict(mamba_d_ssm=256, **_MAMBA2)),
    "LFM2": ("lfm2", dict(layer_types=["conv", "conv", "full_attention", "conv"])),
    "Jamba": (
        "jamba",
        dict(
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=16,
            mamba_dt_rank=8,
            use_mamba_kernels=False,
        ),
    ),
    "Bamba": ("bamba", dict(attn_layer_indices=[1, 3], **_MAMBA2)),
    "Granite 4.0-H": (
        "granitemoehybrid",
        dict(
            layer_types=["mamba", "attention", "mamba", "attention"],
            num_local_experts=2,
            shared_intermediate_size=64,
            **_MAMBA2,
        ),
    ),
    "DeepSeek-V3 (MLA)": (
        "deepseek_v3",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=64,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=32,
            head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            moe_intermediate_size=64,
            n_group=1,
            topk_group=1,
        ),
    ),
}
"""Family name -> (transformers model type, the config's options beside `_BASE`)."""

SPECS = (
    CacheSpec("dynamic"),
    CacheSpec("quanto", nbits=4),
    CacheSpec("hqq", nbits=4, rotation="hadamard"),
    CacheSpec("fp8"),
    CacheSpec("quanto", nbits=4, sliding="quantize"),
    CacheSpec("turboquant", nbits=4),
    CacheSpec("ggml", type_k="q4_0"),
    CacheSpec("nvfp4"),
    CacheSpec("mlx", nbits=4, kv_group_size=32),
    CacheSpec("int8"),
)
"""One spec per backend of the registry (hqq rotated: a rotation must be undone where the model reads the cache;
turboquant's keys are always rotated; ggml's q4_0 rotated by llama.cpp's rule, its sliding layers quantized as
llama.cpp's are; nvfp4 and int8 with theirs quantized as the engines store them; mlx in groups of 32, which the tiny
head_dims take), and quanto with its sliding-window layers quantized too (`sliding=quantize`)."""


def family_config(name: str) -> PreTrainedConfig:
    """The tiny config of family `name`."""
    model_type, extra = FAMILIES[name]
    return AutoConfig.for_model(model_type, **{**_BASE, **extra})


def tiny_family(name: str, tokenizer) -> LoadedModel:
    """The random model of family `name` (`family_config`, seed 0) as a `LoadedModel` with the embedded tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(name)).eval()
    return LoadedModel(model, tokenizer, name, None, 1024, torch.device("cpu"), torch.float32, frozenset({2}))


def verdict(spec: CacheSpec, config: PreTrainedConfig) -> str | None:
    """Why `spec` is refused on this model before anything runs, or None where it runs."""
    try:
        spec.validate(config)
    except ValueError as error:
        return str(error)
    return None


def _short(reason: str) -> str:
    """A refusal in a table cell: the message's first clause, without the backend's name."""
    return "refused: " + reason.split(":")[0].split(";")[0].split("backend=")[-1].partition(" ")[2]


def markdown_table(configs: Callable[[str], PreTrainedConfig] = family_config) -> str:
    """docs/models.md's table: one row per family (its layer kinds, how many a quantized backend quantizes with
    `sliding=keep` and with `sliding=quantize`), one column per spec of `SPECS`."""
    rows = [
        "| family | layers | quantized: sliding=keep, =quantize | "
        + " | ".join(f"`{spec.text}`" for spec in SPECS)
        + " |",
        "|---|---|---|" + "---|" * len(SPECS),
    ]
    for name in FAMILIES:
        config = configs(name)
        cells = [verdict(spec, config) for spec in SPECS]
        shown = ["works" if reason is None else _short(reason) for reason in cells]
        share = ", ".join(f"{len(quantized_layers(config, sliding))}" for sliding in SLIDING_CHOICES)
        rows.append(f"| {name} | {kinds_text(layer_types(config))} | {share} | " + " | ".join(shown) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
