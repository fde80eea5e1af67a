"""Helpers the tests share (the fixtures are in conftest.py): the spec matrix, tiny random Llama models built from a
config, a fault injected into a forward pass, and the page's handlers called as the page calls them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvdemo.cache.catalogue import all_specs
from kvdemo.cache.spec import CacheSpec, build_cache
from kvdemo.qa.models import LoadedModel

# Every backend and nbits the registry allows; the options left unset take the backend's defaults.
ALL_SPECS = all_specs()


def spec_id(spec: CacheSpec) -> str:
    return spec.label.replace(" ", ",")


def read_whole(returned: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's `update` result as attention reads it whole: a decode step's marked tail (the store handed to
    kvdemo's attention, `kvdemo.cache.layers.blockwise.marked_tail`) joined with every stored token; else as it is."""
    from kvdemo.cache.layers.blockwise import blocks_of

    blocks = blocks_of(returned[0])
    return returned if blocks is None else blocks.materialized(*returned)


def filled_layer(spec: CacheSpec, config, keys: torch.Tensor, values: torch.Tensor, steps: int = 0):
    """Layer 0 of a cache of `spec` for `config` after a prefill of `keys`, `values` ([batch, kv_heads, tokens,
    head_dim]) and `steps` decode steps that feed the same rows again, one token each."""
    layer = build_cache(spec, config).layers[0]
    layer.update(keys, values)
    for i in range(steps):
        layer.update(keys[..., i : i + 1, :], values[..., i : i + 1, :])
    return layer


def make_tiny(tokenizer, *, kv_heads: int = 2, head_dim: int = 64, layers: int = 2, seed: int = 0) -> LoadedModel:
    """A random Llama with the given KV shape and the embedded tokenizer (vocab 49,152), float32 on CPU; hidden size
    128, or 64 x kv_heads where 128 does not split into 2 x kv_heads attention heads."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128 if 128 % (2 * kv_heads) == 0 else 64 * kv_heads,
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
    """The data of a plot's update returned by a handler, as a DataFrame. A native plot's `gr.update(value=frame,
    ...)` gives the frame, a component (`gr.LinePlot(value=frame, ...)`) the `columns` and `data` of its
    postprocessed value; a matplotlib figure (the step-time chart) the points of each labelled scatter (`step`,
    `ms`, `kind`); an encoded empty chart (`PlotData`) no row."""
    import pandas as pd
    from matplotlib.figure import Figure

    if isinstance(update, Figure):
        rows = [
            (x, y, collection.get_label())
            for collection in update.axes[0].collections
            for x, y in collection.get_offsets()
        ]
        return pd.DataFrame(rows, columns=["step", "ms", "kind"])
    if getattr(update, "type", None) == "matplotlib":
        return pd.DataFrame(columns=["step", "ms", "kind"])
    if isinstance(update, dict):  # a `gr.update(value=frame, ...)`: Gradio postprocesses the frame as it is
        return update["value"]
    return pd.DataFrame(update.value["data"], columns=update.value["columns"])


def plot_title(update) -> str:
    """The title of a plot's update: a native plot's `title` (a component or a `gr.update` dict), a matplotlib
    figure's, or the one `views` encoded an empty step-time chart with (`views._empty_step_chart`)."""
    from matplotlib.figure import Figure

    from kvdemo.ui import views

    if isinstance(update, Figure):
        return update.axes[0].get_title()
    if getattr(update, "type", None) == "matplotlib":  # an encoded empty chart: which of the two
        for streaming in (True, False):
            title = views.waiting_step_title(streaming)
            if views._empty_step_chart(title) == update:
                return title
        raise AssertionError("an encoded plot that is not one of the empty step-time charts")
    return update["title"] if isinstance(update, dict) else update.title


def logits_through(loaded: LoadedModel, cache, ids: list[int]) -> torch.Tensor:
    """The model's logits [len(ids), vocab] for `ids` fed through `cache` in one forward pass (no gradients)."""
    with torch.no_grad():
        return loaded.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0]


def at_once(visit: Callable[[str], None], visitors: Iterable[str], timeout: float = 300) -> None:
    """`visit(visitor)` for every visitor, each in a thread of its own, all started together (two visitors of the
    page at the same time); raises the first error a visit raised, once every thread has ended."""
    errors: list[BaseException] = []

    def run(visitor: str) -> None:
        try:
            visit(visitor)
        except BaseException as error:  # raised in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(visitor,)) for visitor in visitors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
