"""kvdemo.evals.cases: the text that continues a selection of an article (for perplexity), on the shipped examples."""

from __future__ import annotations

from kvdemo.evals.cases import continuation_for, example_path, load_case


def test_continuation_is_the_paragraphs_after_the_last_selected(normans):
    assert normans.continuation is None  # the whole article: nothing follows
    chosen = normans.select("0,2-3")
    assert chosen.following == normans.paragraphs[4:]
    assert chosen.continuation == "\n\n" + "\n\n".join(normans.paragraphs[4:])
    assert chosen.context + chosen.continuation == "\n\n".join(normans.paragraphs[:1] + normans.paragraphs[2:])
    last = len(normans.paragraphs) - 1
    assert normans.select(f"0,{last}").continuation is None


def test_continuation_for_a_pasted_example(normans):
    assert continuation_for(normans.select("0-11").context) == normans.select("0-11").continuation
    california = load_case(example_path("southern_california"))
    assert continuation_for(california.select("2").context) == "\n\n" + "\n\n".join(california.paragraphs[3:])
    assert continuation_for("Some text of my own.\n\nAnother paragraph.") is None
    assert continuation_for("   ") is None and continuation_for(None) is None
