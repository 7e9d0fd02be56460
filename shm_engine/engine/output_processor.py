"""Frontend side of outputs: per-request detokenization, stop strings, RequestOutput objects.

It runs in the client process, so the engine never touches text. A stop string ends the request
here and the caller aborts it in the engine (the engine only knows token-level stops).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shm_engine.engine.protocol import EngineCoreOutputs, Logprobs
from shm_engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from shm_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Logprob:
    """One token's entry in a logprobs dict, as vLLM's ``Logprob``: the raw model logprob, the
    token's rank in the vocabulary at that position (1: the most likely; a tie counts every
    token as likely as it, as vLLM's) and the token decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token id: Logprob}, the sampled (or prompt) token first, then the top-n.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def snapshot(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            self.token_ids,
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, {token id: Logprob} (its
    # own first, then the top-n of its position); None for the first, which nothing predicts.
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class _RequestState:
    """One engine request (one of the n completions of a user request)."""

    engine_id: str
    parent: _ParentState
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    completion: CompletionOutput


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_RequestState] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(c.completion.finished() for c in self.children)

    def output(self) -> RequestOutput:
        """A snapshot: later steps change neither its text nor its finish reasons. The token
        and logprob lists are shared and keep growing (copying them would cost O(length) a step)."""
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [c.completion.snapshot() for c in self.children],
            self.finished,
            self.num_cached_tokens,
            self.error,
            self.metrics,
            self.prompt_logprobs,
        )


_RETIRED_KEPT = 4096  # ended requests' engine ids remembered (a reuse long after is safe anyway)


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Engine-side id of completion ``index``; a single completion keeps the user's id."""
    return request_id if n == 1 else f"{index}_{request_id}"


def child_seed(seed: int, index: int) -> int:
    """vLLM's ``seed + index`` for completion ``index`` of a seeded request, kept an int64 (the
    sampler reads seeds mod 2^64, so child 0 draws as the same request with n=1 does); -1, which
    would mean "no seed", becomes 2^63 - 1."""
    s = (seed + index + 2**63) % 2**64 - 2**63
    return 2**63 - 1 if s == -1 else s


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}  # engine id -> child
        self.parents: dict[str, _ParentState] = {}
        # engine ids of requests that ended here, newest last: the engine may still send the
        # tokens it produced before their abort, so a new request reusing the user's id runs
        # under another engine id (vLLM makes its internal ids unique for the same reason)
        self._retired: dict[str, None] = {}
        self._reuses = 0
        self._decoded: dict[int, str] = {}  # token id -> its text alone (Logprob.decoded_token)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a user request; returns the (engine id, params) of each engine request."""
        if request_id in self.parents:
            raise ValueError(f"duplicate request_id {request_id!r}")
        params.check_types()  # and again the values: fields may have been assigned since
        params.validate()
        parent = _ParentState(request_id, prompt, prompt_token_ids)
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                # Each completion samples independently; a seeded request stays reproducible.
                seed = None if params.seed is None else child_seed(params.seed, i)
                child_params = SamplingParams(**{**_fields(params), "n": 1, "seed": seed})
            eid = child_request_id(request_id, i, params.n)
            if eid in self._retired:
                self._reuses += 1
                eid = f"{eid}@reuse{self._reuses}"
            state = _RequestState(
                eid,
                parent,
                i,
                child_params,
                IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens
                ),
                CompletionOutput(i, "", [], 0.0 if params.logprobs is not None else None),
            )
            if params.logprobs is not None:
                state.completion.logprobs = []
            parent.children.append(state)
            children.append((eid, child_params))
        taken = [s.engine_id for s in parent.children if s.engine_id in self.states]
        if taken:  # e.g. "0_x" alone next to "x" with n = 2
            raise ValueError(
                f"request_id {request_id!r}: engine id {taken[0]!r} is another request's"
            )
        # NOTE: registered only once every child was built, so a failure leaves nothing behind.
        self.parents[request_id] = parent
        for state in parent.children:
            self.states[state.engine_id] = state
        return children

    def engine_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.engine_id for c in parent.children] if parent else []

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        for c in parent.children:
            self._retire(c.engine_id)
            if not c.completion.finished():
                c.completion.finish_reason = reason
        return parent.output()

    def _retire(self, engine_id: str) -> None:
        self.states.pop(engine_id, None)
        self._retired[engine_id] = None
        if len(self._retired) > _RETIRED_KEPT:
            del self._retired[next(iter(self._retired))]

    def process(self, out: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs; returns updated requests and engine ids to abort (stop strings)."""
        now = time.time()
        touched: dict[str, _ParentState] = {}
        to_abort: list[str] = []
        for err in out.errors:
            state = self.states.get(err.request_id)
            if state is None:
                continue
            state.parent.error = err.message
            state.completion.finish_reason = "error"
            touched[state.parent.request_id] = state.parent
            # The request fails as a whole: its other completions are stopped, and say so.
            for c in state.parent.children:
                if not c.completion.finished():
                    c.completion.finish_reason = "abort"
                    to_abort.append(c.engine_id)
        k = 0
        for row, (eid, n) in enumerate(zip(out.request_ids, out.num_new_tokens, strict=True)):
            new_ids = out.new_token_ids[k : k + n]
            k += n
            state = self.states.get(eid)
            if state is None or state.completion.finished():
                continue  # aborted here already; the engine's late token is dropped
            parent = state.parent
            m = parent.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if row in out.num_cached_tokens:
                parent.num_cached_tokens = out.num_cached_tokens[row]
            if row in out.prompt_logprobs and parent.prompt_logprobs is None:  # n > 1: the first
                parent.prompt_logprobs = [None] + [
                    self._position(lp) for lp in out.prompt_logprobs[row]
                ]
            finish = out.finished.get(row)
            lps = out.logprobs.get(row)
            if n > 1 and state.params.stop:
                # NOTE: several tokens of one step (speculative decoding) are applied one by
                # one, so a stop string ends the output at the token that completed it, with
                # the token ids and logprobs one token a step would have given
                for j, token in enumerate(new_ids):
                    last = j == n - 1
                    stopped = self._apply(
                        state, [token], lps[j : j + 1] if lps else None,
                        finish if last else None, out.stop_reasons.get(row) if last else None,
                    )  # fmt: skip
                    if stopped:
                        break
            else:
                stopped = self._apply(state, new_ids, lps, finish, out.stop_reasons.get(row))
            if stopped:
                to_abort.append(eid)
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = now
                self.parents.pop(parent.request_id, None)
                for c in parent.children:
                    self._retire(c.engine_id)
            results.append(parent.output())
        return results, to_abort

    def _apply(
        self,
        state: _RequestState,
        new_ids: list[int],
        lps: list[Logprobs] | None,
        finish: str | None,
        stop_reason: int | str | None,
    ) -> bool:
        """Add a step's tokens to a completion; True if a stop string ended it here (the
        engine request is then aborted)."""
        comp, params = state.completion, state.params
        comp.token_ids.extend(new_ids)
        if lps:
            self._add_logprobs(comp, lps)
        if finish == "stop" and not params.include_stop_str_in_output:
            new_ids = new_ids[:-1]  # the EOS or stop token: its text is not output (vLLM)
        delta = state.detok.add(new_ids)
        if finish is not None:
            delta += state.detok.flush()
            comp.stop_reason = stop_reason
        comp.text += delta
        # Stop strings count only past min_tokens, like vLLM's.
        stopped = bool(
            params.stop
            and len(comp.token_ids) > params.min_tokens
            and self._check_stop_strings(state, len(delta))
        )
        if stopped:
            finish = "stop"
        if finish is not None:
            comp.finish_reason = finish
        return stopped

    def _check_stop_strings(self, state: _RequestState, delta_len: int) -> bool:
        """Find a stop string that the new text completed; truncate the text there."""
        comp = state.completion
        # NOTE: each stop string is searched only where it would end inside the delta (vLLM's
        # window); one window for all, sized by the longest, found a short one that had ended
        # before min_tokens allowed stopping.
        text, n = comp.text, len(comp.text) - delta_len + 1
        hits = [
            (i, stop)
            for stop in state.params.stop
            if (i := text.find(stop, max(0, n - len(stop)))) >= 0
        ]
        if not hits:
            return False
        i, stop = min(hits)  # the earliest stop string in the text wins
        end = i + len(stop) if state.params.include_stop_str_in_output else i
        comp.text = comp.text[:end]
        comp.stop_reason = stop
        return True

    def _add_logprobs(self, comp: CompletionOutput, entries: list[Logprobs]) -> None:
        for lp in entries:
            comp.logprobs.append(self._position(lp))
            comp.cumulative_logprob += lp.logprobs[0]

    def _position(self, lp: Logprobs) -> PositionLogprobs:
        """One position's dict: the sampled token (its rank from the engine) first, then the
        top-n, ranked 1..n; a sampled token among them keeps its top-n entry (vLLM's order)."""
        ranks = [lp.sampled_rank, *range(1, len(lp.token_ids))]
        return {
            t: Logprob(v, r, self._decode_one(t))
            for t, v, r in zip(lp.token_ids, lp.logprobs, ranks, strict=True)
        }

    def _decode_one(self, token_id: int) -> str:
        """vLLM's decoded_token: the token decoded on its own, special tokens included."""
        text = self._decoded.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._decoded[token_id] = text
        return text


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}
