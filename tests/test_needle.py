"""kvdemo.needle.grid: contexts of an exact token length with each needle at its depth, the graded score against a
plain forward, the grid's bookkeeping (cells, prefills, progress), cancel and bad input, on a tiny model; one
grid on the embedded model, which finds a needle with the full-precision cache.

Cost: 19 s for 41 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch

from kvdemo import CacheSpec, QASession
from kvdemo.cache.state.budget import KVBudgetError
from kvdemo.needle.grid import hit, longest_length, needle_grid, plan_contexts
from kvdemo.needle.haystack import _SENTENCE_END, build_context, haystack_text, make_needles
from kvdemo.needle.inputs import parse_depths, parse_lengths
from kvdemo.needle.records import NeedleCancelled

DEPTHS = [0, 25, 50, 75, 100]


def test_needles_are_reproducible_distinct_and_absent_from_the_haystack():
    text = haystack_text()
    first, again, other = make_needles(range(40), 7, text), make_needles(range(40), 7, text), make_needles(range(40), 8)
    assert first == again and first != other
    assert len({n.name for n in first}) == 40 and len({n.value for n in first}) == 40
    for n in first:
        assert len(n.value) == 6 and n.value.isdigit() and n.value not in text
        assert all(part.lower() not in text.lower() for part in n.name.split())
        assert n.text == f"The special magic number for {n.name} is {n.value}."
        assert n.question == f"What is the special magic number for {n.name} mentioned in the text?"


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("The number is 482913.", True),
        ("It is 482,913", True),
        ("482 913!", True),
        ("4829130", False),
        ("1482913", False),
        ("48291", False),
        ("", False),
    ],
)
def test_hit_reads_the_value_as_a_whole_number(answer, expected):
    assert hit(answer, "482913") is expected


def _filler_and_needle_chars(text, placements):
    """The context with the needles taken out, and where each needle was (a character of that text)."""
    chars = {}
    for p in sorted(placements, key=lambda p: text.index(p.needle.text)):
        start = text.index(p.needle.text)
        end = start + len(p.needle.text)
        if start > 0 and text[start - 1] == " ":
            start -= 1
        elif text[end : end + 1] == " ":
            end += 1
        text = text[:start] + text[end:]
        chars[p.needle.name] = start
    return text, chars


@pytest.mark.parametrize("length", [4096, 7936])
def test_each_needle_sits_at_its_token_depth_in_a_context_of_exactly_the_length(tiny, length):
    planner = dataclasses.replace(tiny, max_context_tokens=8192)  # tokenization only: the embedded tokenizer
    (context,) = plan_contexts(planner, [length], DEPTHS, seed=3)
    session = QASession(planner)
    tokenizer = tiny.tokenizer
    ids = session.context_ids(context.text)
    overhead = len(session.context_ids(""))
    assert len(ids) == context.length == length
    assert context.haystack_tokens == length - overhead - sum(p.tokens for p in context.placements)
    filler, chars = _filler_and_needle_chars(context.text, context.placements)
    filler_offsets = tokenizer(filler, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    for p in context.placements:
        piece = tokenizer.decode(ids[p.position : p.position + p.tokens])
        assert piece.strip() == p.needle.text and context.text.count(p.needle.value) == 1
        before = p.position - overhead - sum(q.tokens for q in context.placements if q.position < p.position)
        assert p.placed_depth == pytest.approx(100 * before / context.haystack_tokens, abs=0.01)
        if p.needle.depth == 0:
            assert p.position == overhead
        elif p.needle.depth == 100:
            assert p.position + p.tokens == length  # the last tokens of the context
        else:  # right after the last sentence end at or before the requested token (Kamradt's rule)
            target = filler_offsets[round(p.needle.depth / 100 * context.haystack_tokens)][0]
            here = chars[p.needle.name]
            assert filler[:here].rstrip()[-1] in ".!?\"')]"
            assert not [m for m in _SENTENCE_END.finditer(filler) if here < m.end() <= target]
            assert 0 <= p.needle.depth - p.placed_depth < 2.5  # sentences here are under 100 tokens


def test_every_short_length_is_cut_exactly(tiny):
    planner = dataclasses.replace(tiny, max_context_tokens=8192)
    session = QASession(planner)
    lengths = list(range(150, 1400, 23))
    for context in plan_contexts(planner, lengths, [0, 40, 100], seed=5, needles_per_context=1):
        assert len(session.context_ids(context.text)) == context.length
    with pytest.raises(ValueError, match="haystack is empty"):
        plan_contexts(planner, [300], [50], haystack="  ")
    short = "Rollo led the Normans. They settled in Normandy. Their duchy grew."
    context = build_context(planner, 300, make_needles([50], 1), haystack=short)  # read again from its start
    assert len(session.context_ids(context.text)) == 300 and context.text.count(short.split(".")[0]) > 5


def _plain_score(loaded, context, needle, value_tokens):
    """log P(value) from one forward over context + question + answer prefix + value (no cache)."""
    session = QASession(loaded)
    session.prefill(context.text, reserve_tokens=64)  # question_ids needs the prompt's layout
    answer = loaded.tokenizer(f"{needle.answer_prefix} {needle.value}", add_special_tokens=False)["input_ids"]
    assert loaded.tokenizer.decode(answer[-value_tokens:]) == needle.value
    ids = session.context_ids(context.text) + session.question_ids(needle.question) + answer
    with torch.no_grad():
        logprobs = torch.log_softmax(loaded.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(float(logprobs[i - 1, ids[i]]) for i in range(len(ids) - value_tokens, len(ids)))


def test_graded_score_equals_a_plain_forward(tiny):
    grid = needle_grid(tiny, ["dynamic"], [220], [0, 50, 100], seed=1, max_new_tokens=4)
    (context,) = plan_contexts(tiny, [220], [0, 50, 100], seed=1, max_new_tokens=4)
    placements = {p.needle.name: p for p in context.placements}
    assert [c.depth for c in grid.cells] == [0, 50, 100]
    for cell in grid.cells:
        placement = placements[cell.name]
        assert (cell.value, cell.position, cell.placed_depth) == (
            placement.needle.value,
            placement.position,
            placement.placed_depth,
        )
        assert cell.value_tokens == 6  # one token per digit
        assert cell.score == pytest.approx(_plain_score(tiny, context, placement.needle, 6), abs=2e-3)
        assert cell.score < 0 and cell.cache_length_after == 220 and cell.hit == hit(cell.answer, cell.value)


def test_grid_bookkeeping(tiny, monkeypatch):
    prefills = []
    real_prefill = QASession.prefill

    def counting_prefill(self, context, *args, **kwargs):
        prefills.append((self.spec.text, len(self.context_ids(context))))
        return real_prefill(self, context, *args, **kwargs)

    monkeypatch.setattr(QASession, "prefill", counting_prefill)
    progress = []
    grid = needle_grid(
        tiny,
        ["dynamic", "fp8", CacheSpec("dynamic")],
        [240, 160],
        [100, 0, 50],
        needles_per_context=2,
        max_new_tokens=3,
        on_progress=lambda *a: progress.append(a),
    )
    assert grid.specs == ("dynamic", "fp8") and grid.lengths == (160, 240) and grid.depths == (0, 50, 100)
    assert grid.complete and grid.needles_per_context == 2
    # 2 specs x 2 lengths x 2 contexts (depths 0 and 100 together, 50 alone)
    assert prefills == [(spec, n) for spec in ("dynamic", "fp8") for n in (160, 160, 240, 240)]
    keys = [(c.spec_text, c.length, c.depth) for c in grid.cells]
    assert keys == [(s, n, d) for s in ("dynamic", "fp8") for n in (160, 240) for d in (0, 50, 100)]
    for cell in grid.cells:
        assert cell.cache_length_after == cell.length
        assert cell.needles_in_context == (1 if cell.depth == 50 else 2)
        shared = [c for c in grid.cells if (c.spec_text, c.context) == (cell.spec_text, cell.context)]
        assert len(shared) == cell.needles_in_context and {c.prefill_seconds for c in shared} == {cell.prefill_seconds}
        assert cell.seconds == pytest.approx(
            cell.prefill_seconds / cell.needles_in_context + cell.answer_seconds + cell.score_seconds
        )
    dynamic, fp8 = grid.cells[:6], grid.cells[6:]
    assert [(c.name, c.value, c.position) for c in dynamic] == [(c.name, c.value, c.position) for c in fp8]
    assert fp8[0].kv_bytes < dynamic[0].kv_bytes
    # progress: 2 specs x 2 lengths x (2 prefills + 3 answers + 3 scorings) = 32 units, counted up to the total
    assert {total for _, total, _ in progress} == {32} and progress[-1][0] == 32
    assert [done for done, _, _ in progress] == sorted(done for done, _, _ in progress)
    assert progress[0] == (0, 32, "dynamic: prefilling 160 tokens")
    # the table, the summary and the exports agree with the cells
    table = grid.to_frame()
    assert list(table.columns) == list(grid.COLUMNS) and len(table) == 12
    assert table["score"].tolist() == [round(c.score, 4) for c in grid.cells]
    summary = grid.summary_frame()
    assert summary["cells"].tolist() == [6, 6]
    assert summary["prefill s"].iloc[1] == pytest.approx(
        sum({c.context: c.prefill_seconds for c in fp8}.values()), abs=0.01
    )
    assert table["cut"].tolist() == [(not c.hit and c.finish_reason == "max_new_tokens") for c in grid.cells]
    assert summary["cut"].tolist() == [sum(c.cut for c in dynamic), sum(c.cut for c in fp8)]
    assert grid.to_csv().splitlines()[0].startswith("spec text,length,depth,placed depth,hit,cut,score")
    assert grid.to_dict()["cells"][0]["name"] == grid.cells[0].name


def test_one_needle_per_context_keeps_the_needles(tiny):
    together = needle_grid(tiny, ["dynamic"], [200], [0, 100], max_new_tokens=2)
    apart = needle_grid(tiny, ["dynamic"], [200], [0, 100], needles_per_context=1, max_new_tokens=2)
    assert [(c.name, c.value) for c in together.cells] == [(c.name, c.value) for c in apart.cells]
    assert [c.needles_in_context for c in together.cells] == [2, 2]
    assert [c.needles_in_context for c in apart.cells] == [1, 1] and [c.context for c in apart.cells] == [0, 1]
    (one,) = plan_contexts(tiny, [200], [0, 100], max_new_tokens=2)
    first, second = plan_contexts(tiny, [200], [0, 100], needles_per_context=1, max_new_tokens=2)
    assert [p.needle for p in first.placements + second.placements] == [p.needle for p in one.placements]
    assert first.haystack_tokens == one.haystack_tokens + one.placements[1].tokens  # more haystack, same length


def test_cancel_keeps_the_finished_cells(tiny):
    cancel = threading.Event()

    def on_progress(done, total, what):
        if what == "hqq:4: prefilled 200 tokens":
            cancel.set()  # stops at the first decode step of the next answer

    with pytest.raises(NeedleCancelled) as caught:
        needle_grid(
            tiny, ["dynamic", "hqq:4"], [200], [0, 100], max_new_tokens=3, cancel=cancel, on_progress=on_progress
        )
    grid = caught.value.grid
    assert not grid.complete and [(c.spec_text, c.depth) for c in grid.cells] == [("dynamic", 0), ("dynamic", 100)]
    assert "cancelled after 2 cell(s)" in str(caught.value)


def test_cancel_acts_within_one_chunk_of_a_long_prefill(tiny):
    cancel, seen = threading.Event(), []

    def on_progress(done, total, what):
        seen.append(what)
        if what == "hqq:4: prefilling 256 of 400 tokens":
            cancel.set()

    with pytest.raises(NeedleCancelled) as caught:
        needle_grid(tiny, ["dynamic", "hqq:4"], [400], [50], max_new_tokens=3, cancel=cancel, on_progress=on_progress)
    assert [c.spec_text for c in caught.value.grid.cells] == ["dynamic"]
    assert "dynamic: prefilling 256 of 400 tokens" in seen and "dynamic: prefilling 400 of 400 tokens" in seen
    assert seen[-1] == "hqq:4: prefilling 256 of 400 tokens"  # the next chunk never ran


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(specs=[]), "give a list of specs"),
        (dict(specs="dynamic"), "give a list of specs"),
        (dict(specs=["hqq:5"]), "nbits=5 is not allowed for hqq"),
        (dict(specs=["int3"]), "backend='int3' is not a backend"),
        (dict(lengths=[]), "give a list of context lengths"),
        (dict(lengths=[200.5]), "length 200.5 must be a whole number of tokens >= 1"),
        (dict(lengths=[True]), "length True must be a whole number"),
        (dict(lengths=["200"]), "length '200' must be a whole number"),
        (dict(lengths=[200, 200]), "length 200 is given twice"),
        (dict(lengths=[60]), "length 60 is too short for 2 needle"),
        (dict(lengths=[417]), "length 417 does not fit: the longest context is 416 tokens"),
        (dict(depths=[]), "give a list of depths"),
        (dict(depths=[-1]), "depth -1 must be a number from 0 to 100"),
        (dict(depths=[100.5]), "depth 100.5 must be a number from 0 to 100"),
        (dict(depths=[math.nan]), "depth nan must be a number from 0 to 100"),
        (dict(depths=["50"]), "depth '50' must be a number"),
        (dict(depths=[50, 50.0]), "depth 50.0 is given twice"),
        (dict(needles_per_context=0), "needles_per_context=0 must be a whole number >= 1 (or None)"),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be a whole number >= 1"),
        (dict(seed=1.5), "seed=1.5 must be a whole number or a text"),
        (dict(haystack=""), "the haystack is empty"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(tiny, monkeypatch, kwargs, message):
    monkeypatch.setattr(QASession, "prefill", lambda *a, **k: pytest.fail("a prefill ran"))
    args = dict(specs=["dynamic"], lengths=[200], depths=[0, 100], max_new_tokens=32) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        needle_grid(tiny, **args)


def test_kv_budget_is_checked_for_the_longest_length_first(tiny, monkeypatch):
    monkeypatch.setattr(QASession, "prefill", lambda *a, **k: pytest.fail("a prefill ran"))
    with pytest.raises(KVBudgetError, match="a fp8 KV cache for the longest context \\(300 tokens"):
        needle_grid(tiny, ["fp8"], [200, 300], [50], kv_budget_bytes=20_000)


def test_longest_length_and_parsing():
    assert parse_lengths("1024, 2048 4096") == [1024, 2048, 4096]
    assert parse_depths("100, 0 50%") == [0.0, 50.0, 100.0]
    for bad, message in (
        ("1024,abc", "'abc' is not a whole number of tokens"),
        ("", "lengths is empty"),
        ("1024,1024", "given twice"),
        ("0", "length 0 must be a whole number of tokens >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_lengths(bad)
    for bad, message in (
        ("0,x", "'x' is not a number"),
        ("0,150", "depth 150.0 must be a number from 0 to 100"),
        (" ", "depths is empty"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_depths(bad)


def test_embedded_model_finds_a_needle_with_the_full_precision_cache(embedded):
    assert longest_length(embedded) == 8192 - 64 - 32
    grid = needle_grid(embedded, ["dynamic"], [512], [50], seed=0)
    (cell,) = grid.cells
    assert cell.hit and cell.value in cell.answer
    assert -3.0 < cell.score < 0 and cell.cache_length_after == 512 and 0 < cell.placed_depth <= 50


def test_heatmap_frame_and_figure_read_the_table(tiny):
    from kvdemo.charts.needle import SCORE_FLOOR, needle_heatmap_figure, needle_heatmap_frame

    grid = needle_grid(tiny, ["dynamic", "fp8"], [200, 260], [100, 0], max_new_tokens=2)
    table = grid.to_frame()
    scores, hits = needle_heatmap_frame(table, "fp8"), needle_heatmap_frame(table, "fp8", "hit")
    assert list(scores.index) == [0.0, 100.0] and list(scores.columns) == [200, 260]
    for cell in grid.cells[4:]:
        assert scores.at[cell.depth, cell.length] == round(cell.score, 4)
        assert hits.at[cell.depth, cell.length] == float(cell.hit)
    assert needle_heatmap_frame(table, "hqq:4").empty
    with pytest.raises(ValueError, match="value='rank': choose one of score, hit"):
        needle_heatmap_frame(table, "fp8", "rank")
    figure = needle_heatmap_figure(table)
    panels = [ax for ax in figure.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["dynamic", "fp8"]
    assert panels[1].images[0].get_array().tolist() == scores.to_numpy().tolist()
    low = min(c.score for c in grid.cells)
    assert panels[0].images[0].get_clim() == (max(low, SCORE_FLOOR), 0.0)
    # 2 tokens cannot hold the number: every miss was cut by max_new_tokens, and says so
    assert any(cell.cut for cell in grid.cells[4:])
    assert [t.get_text() for t in panels[1].texts] == [
        ("\u2713" if cell.hit else "cut " if cell.cut else "\u2717") + f"{cell.score:.1f}"
        for cell in sorted(grid.cells[4:], key=lambda c: (c.depth, c.length))
    ]
    uncut = needle_heatmap_figure(table.assign(cut=False), ["fp8"])  # a miss that ended otherwise: a cross
    assert all(t.get_text()[0] in "\u2713\u2717" for t in uncut.axes[0].texts)
    hit_panels = [ax for ax in needle_heatmap_figure(table, ["fp8"], value="hit").axes if ax.images]
    assert len(hit_panels) == 1 and hit_panels[0].images[0].get_clim() == (0.0, 1.0)
