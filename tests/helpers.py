"""Helpers the tests share (the fixtures are in conftest.py): the spec matrix, tiny random Llama models built from a
config, a fault injected into a forward pass, and the page's handlers called as the page calls them."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvdemo.cache.spec import CacheSpec, all_specs
from kvdemo.qa.models import LoadedModel

# Every backend and nbits the registry allows; the options left unset take the backend's defaults.
ALL_SPECS = all_specs()


def spec_id(spec: CacheSpec) -> str:
    return spec.label.replace(" ", ",")


def make_tiny(tokenizer, *, kv_heads: int = 2, head_dim: int = 64, layers: int = 2, seed: int = 0) -> LoadedModel:
    """A random Llama with the given KV shape and the embedded tokenizer (vocab 49,152), float32 on CPU."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads * 2,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=f"tiny-llama-{layers}x{kv_heads}x{head_dim}",
        source=None,
        max_context_tokens=config.max_position_embeddings,
        device=torch.device("cpu"),
        dtype=torch.float32,
        eos_token_ids=frozenset({2}),
    )


def fail_forward_at(monkeypatch, loaded: LoadedModel, call: int, message: str) -> None:
    """Make the model's `call`-th forward pass from now on raise `RuntimeError(message)` (a fault inside a
    decode step); the others run as usual. Undone by `monkeypatch.undo()` or at the test's end."""
    calls = {"n": 0}
    forward = loaded.model.forward

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError(message)
        return forward(*args, **kwargs)

    monkeypatch.setattr(loaded.model, "forward", failing_forward)


def refused(result) -> str:
    """The refusal a page handler showed: the output that starts with ⚠ (a prefill's or a comparison's view, an
    answer's updates, a status line). Fails when there is none, so a test cannot pass on a silent handler."""
    if not isinstance(result, (str, tuple)):  # an answer's updates (a generator or a list of views)
        result = list(result)[-1]
    items = [result] if isinstance(result, str) else list(result)
    found = [item for item in items if isinstance(item, str) and "⚠ " in item]
    assert found, f"no refusal shown in {result!r}"
    return found[-1]


def named_handlers(demo) -> dict:
    """The page's named event functions (`api_name` -> fn). `prefill` and `gate` are called as the page's state
    inputs in order (Context box, backend, options in `GROUP_OPTIONS` order; missing trailing options left empty),
    then the request, and `progress=` optionally: Gradio's own `special_args` puts the request (and progress)
    where the handler's signature takes them, as it does for a browser's call. `before_answer` is the Ask
    click's first step (no API name of its own)."""
    from gradio.helpers import special_args

    from kvdemo.cache.registry import GROUP_OPTIONS

    def as_the_page_calls(fn):
        def called(*args, progress=None):
            *inputs, request = args
            inputs += [None] * (2 + len(GROUP_OPTIONS) - len(inputs))
            ordered, progress_index, *_ = special_args(fn, inputs, request)
            if progress is not None:
                ordered[progress_index] = progress
            return fn(*ordered)

        return called

    fns = {f.api_name: f.fn for f in demo.fns.values() if f.api_name}
    by_name = {getattr(f.fn, "__name__", ""): f.fn for f in demo.fns.values()}
    return {
        **fns,
        "prefill": as_the_page_calls(fns["prefill"]),
        "gate": as_the_page_calls(by_name["gate"]),
        "before_answer": by_name["before_answer"],  # the Ask click's step before the queue
    }


def plotted(update) -> Any:
    """The data of a plot's update returned by a handler, as a DataFrame: what Gradio sends the page. A native
    plot (`gr.LinePlot(value=frame, ...)`) gives `columns` and `data` of its postprocessed value; an Altair plot
    (`PlotData`, the step-time chart) its Vega-Lite spec's inline `data.values`."""
    import json

    import pandas as pd

    if getattr(update, "type", None) == "altair":
        return pd.DataFrame(json.loads(update.plot)["data"]["values"], columns=["step", "ms", "kind", "layers flushed"])
    return pd.DataFrame(update.value["data"], columns=update.value["columns"])


def plot_title(update) -> str:
    """The title of a plot's update: a native plot's `title`, or an Altair plot's (`PlotData`) spec title."""
    import json

    if getattr(update, "type", None) == "altair":
        return json.loads(update.plot)["title"]
    return update.title
