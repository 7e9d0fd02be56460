"""Engine-side state of one request: its tokens, progress through the KV cache and why it stopped."""

from __future__ import annotations

import enum
import time

from shm_engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id
    FINISHED_LENGTH = 4  # max_tokens or the model's context length
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# The OpenAI-style finish_reason strings the client sees.
FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence inside the engine.

    ``all_token_ids`` holds prompt then output tokens; ``num_computed_tokens`` counts how many of
    them already have KV entries in the cache. The difference is what the scheduler still owes.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "all_token_ids",
        "sampling_params",
        "arrival_time",
        "priority",
        "cache_salt",
        "eos_token_ids",
        "max_tokens",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "stop_reason",
        "prompt_logprobs",
        "matcher",
        "constraint_error",
        "bad_words_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length, set on first schedule
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        # Logprobs of prompt tokens 1, 2, ... as computed so far (when asked for); handed out
        # with the first output token, then None.
        self.prompt_logprobs: list | None = None if sampling_params.prompt_logprobs is None else []
        # structured outputs: an llguidance LLMatcher that has consumed the output so far
        self.matcher = None
        self.constraint_error: str | None = None  # why the constraint ends the request
        self.bad_words_token_ids: list[list[int]] = []  # SamplingParams.bad_words, tokenized

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_prompt_scored(self) -> int:
        """Prompt tokens whose logprobs are known (all of them once they were handed out)."""
        p = self.prompt_logprobs
        return self.num_prompt_tokens - 1 if p is None else len(p)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __lt__(self, other: Request) -> bool:
        # Priority scheduling: lower value first, then earlier arrival, then id for a total order.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, out={self.num_output_tokens})"
        )
