"""Tags models write around parts of their answers (``<tool_call>``, ``<think>``): what the
readers of tool calls and reasoning share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0: none): text a stream
    holds back until the next delta shows whether the tag follows."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def tags_special(tokenizer: Any, tags: Iterable[str]) -> bool:
    """Whether any tag is a special token of ``tokenizer``: skipping special tokens would take
    it out of the text its reader needs (keeping them lets other specials' text through)."""
    ids = (tokenizer.token_to_id(tag) for tag in tags)
    return any(i is not None and i in tokenizer.all_special_ids for i in ids)
