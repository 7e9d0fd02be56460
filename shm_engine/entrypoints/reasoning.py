"""Reasoning outputs: the ``<think>...</think>`` part of a thinking model's answer goes to the
chat API's ``reasoning`` field (and its older name ``reasoning_content``), the rest to
``content``, as vLLM's ``--reasoning-parser`` does.

- ``deepseek_r1``: the answer starts inside the thinking (the R1 distills' template opens
  ``<think>`` in the prompt); a leading ``<think>`` is dropped, ``</think>`` ends it.
- ``qwen3``: thinking where the answer starts with ``<think>`` (Qwen3 writes it itself), or
  where the prompt ends inside an open one (the Thinking-2507 templates); with
  ``enable_thinking: false`` the template closes an empty one in the prompt and the answer is
  all content.

An answer cut while still thinking (max_tokens) is all reasoning, streamed or whole. The
answer's leading whitespace after ``</think>`` is dropped; an answer that did not think is
left as written.
"""

from __future__ import annotations

from shm_engine.entrypoints.tags import partial_tag

_OPEN, _CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")
REASONING_TAGS = (_OPEN, _CLOSE)


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves a ``<think>`` open for the answer."""
    return prompt_tail.rstrip().endswith(_OPEN)


class ReasoningSplitter:
    """Splits one choice's text, delta by delta, into (reasoning, content).

    ``inside``: the prompt left a ``<think>`` open (see ``prompt_opens_thinking``)."""

    def __init__(self, parser: str, inside: bool = False) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self._starts_inside = inside or parser == "deepseek_r1"
        self._state = "start"  # start -> thinking -> answer (or start -> answer)
        self._pending = ""  # text that may still be a tag's beginning
        self._strip = False  # the answer after </think>: its leading whitespace is dropped

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self._pending += delta
        reasoning = content = ""
        if self._state == "start":
            head = self._pending.lstrip()
            if head.startswith(_OPEN):
                self._state, self._pending = "thinking", head[len(_OPEN) :]
            elif not finished and _OPEN.startswith(head):
                return "", ""  # may still open with <think>
            else:
                self._state = "thinking" if self._starts_inside else "answer"
        if self._state == "thinking":
            end = self._pending.find(_CLOSE)
            if end < 0:
                keep = 0 if finished else partial_tag(self._pending, _CLOSE)
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                return reasoning, ""
            reasoning = self._pending[:end]
            self._pending = self._pending[end + len(_CLOSE) :]
            self._state, self._strip = "answer", True
        if self._state == "answer":
            content, self._pending = self._pending, ""
            if self._strip:
                content = content.lstrip()
                self._strip = not content
        return reasoning, content
