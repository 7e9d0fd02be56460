"""Structured outputs: compile a request's constraint into a token matcher (llguidance) and
hand the scheduler each step's mask of allowed tokens.

llguidance walks the tokenizer's vocabulary as a trie against an Earley parser of the grammar, so a
mask costs tens to hundreds of microseconds, not a pass over 49k token strings in Python.
The engine owns one ``GrammarCompiler``: the tokenizer's trie is built on the first constrained
request (~0.3 s for SmolLM2's 49k tokens), and compiled grammars are kept by their source, so a
schema sent with every request is compiled once and then copied (microseconds to ~1 ms).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

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
    """Builds a matcher per constrained request, on a thread of its own with a large stack.

    NOTE: llguidance recurses natively along chains of grammar rules and JSON-schema ``$ref``s
    (~20 kB of stack a ``$ref``): on a default 8 MiB thread stack a chain of 1,000 ``$ref``s
    killed the engine process with SIGSEGV. Its parser guards syntactic nesting (parentheses,
    inline schemas) itself; the chains are bounded here by the grammar's size (MAX_SOURCE_BYTES)
    and compiled, and copied, on a thread whose stack holds that (the stack is reserved address
    space, not memory). One thread compiles for every client, one request at a time; a
    client's input thread waits for its request's compile.
    """

    STACK_BYTES = 256 << 20
    MAX_SOURCE_BYTES = 256 << 10  # of llguidance's grammar text: ~3,700 chained $refs

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        """``tokenizer``: the model's (``model.tokenizer.Tokenizer``), or None without one."""
        self._source_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._worker: ThreadPoolExecutor | None = None

    def compile(self, params: StructuredOutputsParams):
        """A fresh matcher at the constraint's start; ValueError naming what is wrong."""
        with self._lock:
            if self._worker is None:
                self._worker = _big_stack_executor(self.STACK_BYTES)
        return self._worker.submit(self._compile, params).result()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams):
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
        if len(source) > self.MAX_SOURCE_BYTES:
            raise ValueError(
                f"the structured output constraint is too large: {len(source)} bytes as a "
                f"grammar, at most {self.MAX_SOURCE_BYTES}"
            )
        template = self._compiled.get(source)
        if template is None:
            template = llguidance.LLMatcher(
                self._ll_tokenizer(), source, log_level=0, limits=_limits()
            )
            if template.is_error():
                raise ValueError(f"invalid structured output constraint: {template.get_error()}")
            self._compiled[source] = template
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(source)
        return template.deep_copy()

    def _ll_tokenizer(self):
        import llguidance

        if self._tokenizer is None:
            if self._source_tokenizer is None or not self._eos:
                raise ValueError("structured outputs need the model's tokenizer and EOS token")
            self._tokenizer = llguidance.LLTokenizer(
                self._source_tokenizer.backend.to_str(),
                n_vocab=self.vocab_size,
                eos_token=self._eos,
            )
        return self._tokenizer


def _limits():
    """llguidance's limits, but at most 5,000 Earley items a step (default 50,000).

    NOTE: the masks are computed on the engine's busy loop. A 60-character ambiguous grammar
    (``s: s s | s s s | "a" | ""``) took up to 0.7 s a mask under the defaults, slowing every
    other request of the engine ~100x; at 5,000 items its worst mask is ~20 ms and it ends
    with an error after ~30 tokens, while schemas of 300 properties or nested anyOfs stay far
    below the limit."""
    import llguidance

    return llguidance.LLParserLimits(step_max_items=5_000)


def _block_signals() -> None:
    """Helper threads leave SIGINT/SIGTERM to the main thread, whose handlers act on them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _big_stack_executor(stack_bytes: int) -> ThreadPoolExecutor:
    """A one-thread executor whose thread has ``stack_bytes`` of stack.

    NOTE: threading.stack_size is process-wide and applies when a thread starts; the executor
    starts its thread on the first submit, made here while the size is set."""
    executor = ThreadPoolExecutor(1, "grammar", _block_signals)
    previous = threading.stack_size(stack_bytes)
    try:
        executor.submit(lambda: None).result()
    finally:
        threading.stack_size(previous)
    return executor


# A mask or token step of a constraint that takes longer ends its request with an error: it runs
# on the busy loop, where every other request waits for it. Realistic constraints take ~0.01-0.3
# ms; an ambiguous grammar grows slower with each token (_limits).
# NOTE: CPU time of the calling thread (llguidance computes there, without the GIL): wall time
# also counted waiting for the GIL behind another thread's long C call, and a review saw a
# 0.1 ms mask measured at 80 ms, ending an innocent request.
MAX_CALL_SECONDS = 0.05


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

    def fill(self, matchers: list) -> tuple[np.ndarray, list[str | None]]:
        """The masks, and for each why its request must end (a mask too slow), or None."""
        out = np.empty((len(matchers), self.words), dtype=np.int32)
        errors = []
        for row, matcher in zip(out, matchers, strict=True):
            t0 = time.thread_time()
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            errors.append(_too_slow(time.thread_time() - t0))
        return out, errors


def consume(matcher, token: int) -> str | None:
    """Feed a sampled token to a matcher; why the request must end with an error, or None.

    A refused token is possible only when other masks left the constraint no token (its only
    ones among stop ids masked during min_tokens) or llguidance hit one of its limits."""
    t0 = time.thread_time()
    ok = matcher.consume_token(token)
    seconds = time.thread_time() - t0
    if not ok:
        return f"token {token} breaks the constraint: {matcher.get_error()[:500]}"
    return _too_slow(seconds)


def _too_slow(seconds: float) -> str | None:
    if seconds <= MAX_CALL_SECONDS:
        return None
    return (
        f"the constraint took {seconds * 1e3:.0f} ms for one token (at most "
        f"{MAX_CALL_SECONDS * 1e3:.0f} ms): too costly to follow"
    )


def allowed_tokens(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """One row of MaskFiller.fill as a bool array over the vocabulary (for tests and tools)."""
    words = np.ascontiguousarray(mask, dtype=np.int32).view(np.uint8)
    return np.unpackbits(words, count=vocab_size, bitorder="little").view(np.bool_)
