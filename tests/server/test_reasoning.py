"""Reasoning outputs: the splitter that sends a thinking model's <think> part to `reasoning`,
the same however the text is streamed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shm_engine.entrypoints.reasoning import ReasoningSplitter, prompt_opens_thinking


def split_all(parser: str, text: str, cuts: list[int], inside: bool = False) -> tuple[str, str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(points, points[1:], strict=False)] or [""]
    splitter = ReasoningSplitter(parser, inside=inside)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, finished=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


CASES = [
    ("qwen3", "<think>\nplan\n</think>\n\nParis.", ("\nplan\n", "Paris.")),
    ("qwen3", "  <think>a</think>b", ("a", "b")),
    ("qwen3", "Paris, not <think> here.", ("", "Paris, not <think> here.")),
    ("qwen3", "<think>cut while thinking </thi", ("cut while thinking </thi", "")),
    ("qwen3", "<thin", ("", "<thin")),  # a start of the tag, and no more
    ("qwen3", " Paris.\n", ("", " Paris.\n")),  # no thinking: the answer as written
    ("deepseek_r1", "plan</think>\n\nParis.", ("plan", "Paris.")),
    ("deepseek_r1", "<think>\nplan</think>Paris.", ("\nplan", "Paris.")),
    ("deepseek_r1", "all thinking", ("all thinking", "")),
    ("deepseek_r1", "plan</think>a </think> b", ("plan", "a </think> b")),
]


@pytest.mark.parametrize("parser, text, expected", CASES)
@given(cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_reasoning_splits_the_same_in_any_pieces(parser, text, expected, cuts) -> None:
    assert split_all(parser, text, cuts) == expected


@given(cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_a_prompt_that_opens_thinking_makes_the_answer_start_inside(cuts) -> None:
    """The Qwen3 Thinking-2507 templates end the prompt with an open <think>."""
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("assistant\n<think>\n\n</think>\n\n")
    text = "Let me plan.\n</think>\n\nParis."
    assert split_all("qwen3", text, cuts, inside=True) == ("Let me plan.\n", "Paris.")
    assert split_all("qwen3", text, cuts) == ("", text)


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningSplitter("nope")
