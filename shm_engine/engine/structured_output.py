"""Structured outputs: compile a request's constraint into a token matcher (llguidance) and
hand the scheduler each step's mask of allowed tokens.

llguidance walks the tokenizer's vocabulary as a trie against an Earley parser of the grammar, so a
mask costs tens to hundreds of microseconds, not a pass over 49k token strings in Python.
The engine owns one ``GrammarCompiler``: the tokenizer's trie is built on the first constrained
request (~0.4 s for SmolLM2's 49k tokens), and compiled grammars are kept by their source, so a
schema sent with every request is compiled once and then copied (microseconds).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

from shm_engine.sampling_params import StructuredOutputsParams

_CACHE_SIZE = 64


def grammar_source(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for a constraint; ValueError for a malformed one (a schema
    that is not JSON, ...). Grammar errors proper are found when it is compiled."""
    import llguidance

    matcher = llguidance.LLMatcher
    if params.json is not None or params.json_object:
        schema = {"type": "object"} if params.json_object else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object")
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        return matcher.grammar_from_json_schema(schema, defaults=options)
    if params.regex is not None:
        return matcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # NOTE: Lark string literals take JSON's escapes, so json.dumps quotes any choice.
        return matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, params.choice)))
    assert params.grammar is not None
    text = params.grammar
    if "::=" in text:  # GBNF (llama.cpp's, and what vLLM's xgrammar backend takes)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises whatever its parser meets
            raise ValueError(f"invalid GBNF grammar: {e}") from None
    return matcher.grammar_from_lark(text)


class GrammarCompiler:
    """Builds a matcher per constrained request; thread-safe (the input thread compiles)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        """``tokenizer``: the model's (``model.tokenizer.Tokenizer``), or None without one."""
        self._source_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def _ll_tokenizer(self):
        import llguidance

        if self._tokenizer is None:
            if self._source_tokenizer is None or not self._eos:
                raise ValueError("structured outputs need the model's tokenizer and EOS token")
            self._tokenizer = llguidance.LLTokenizer(
                self._source_tokenizer.backend.to_str(),
                n_vocab=self.vocab_size,
                eos_token=self._eos or None,
            )
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams):
        """A fresh matcher at the constraint's start; ValueError naming what is wrong."""
        try:
            import llguidance
        except ImportError:  # pragma: no cover - a dependency; only a broken install lacks it
            raise ValueError("structured outputs need the llguidance package") from None
        try:
            source = grammar_source(params)
        except ValueError:
            raise
        except Exception as e:  # llguidance's converters: whatever a strange input makes them
            raise ValueError(f"invalid structured output constraint: {e}") from None
        with self._lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return template.deep_copy()
            tokenizer = self._ll_tokenizer()
        # NOTE: outside the lock (and the GIL: llguidance drops it while compiling), so a slow
        # grammar delays only its own request's thread.
        template = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid structured output constraint: {template.get_error()}")
        with self._lock:
            self._compiled[source] = template
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template.deep_copy()


class MaskFiller:
    """Each step's masks, one int32 row of ``ceil(vocab / 32)`` words a matcher (bit t % 32 of
    word t // 32: token t allowed).

    A mask costs ~10 us in a JSON string without a length bound and ~150-250 us with one (the
    tokenizer's precomputed slices no longer apply) on SmolLM2's vocabulary.
    NOTE: one after the other on the calling thread. llguidance's thread pool (LLExecutor)
    filled a batch's masks in parallel, but its idle workers spin after the call and take the
    cores from the model's forward: batch-8 JSON decode steps 17 -> 20 ms on 2 cores, where
    this loop costs ~0.3 ms (benchmarks/RESULTS.md)."""

    def __init__(self, vocab_size: int) -> None:
        self.words = (vocab_size + 31) // 32

    def fill(self, matchers: list) -> np.ndarray:
        out = np.empty((len(matchers), self.words), dtype=np.int32)
        for row, matcher in zip(out, matchers, strict=True):
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return out


def allowed_tokens(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """One row of MaskFiller.fill as a bool array over the vocabulary (for tests and tools)."""
    words = np.ascontiguousarray(mask, dtype=np.int32).view(np.uint8)
    return np.unpackbits(words, count=vocab_size, bitorder="little").view(np.bool_)
