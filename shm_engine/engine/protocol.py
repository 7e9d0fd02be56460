"""Messages between an engine client and EngineCoreProc, one tagged union per direction.

Every struct is ``array_like`` (no field names on the wire) and ``omit_defaults``. Per-step outputs
are columnar (one list of ids, one flat token array) rather than one struct per request: decoding
256 small structs costs several times more than a few flat columns, and this message is sent every
step. Prompt token ids travel as an int32 numpy array: packed inline in the msgpack body up to
4 KiB (1024 tokens, the codec's ``inline_max``), as a raw aux frame beyond.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from shm_engine.engine.config import EngineConfig
from shm_engine.sampling_params import SamplingParams

_STRUCT = {"array_like": True, "omit_defaults": True, "tag": True, "kw_only": True}


# --------------------------------------------------------------------------- client -> engine


class EngineCoreRequest(msgspec.Struct, **_STRUCT):
    request_id: str
    prompt_token_ids: np.ndarray  # int32 [n]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None


class AbortRequests(msgspec.Struct, **_STRUCT):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, **_STRUCT):
    call_id: int
    method: str
    args: list[Any] = []


ClientMessage = EngineCoreRequest | AbortRequests | UtilityCall


# --------------------------------------------------------------------------- engine -> client


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Logprobs for one sampled token: the sampled one first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int = 1


class RequestError(msgspec.Struct, array_like=True):
    request_id: str
    message: str


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_count: int = 0
    spec_draft_tokens: int = 0  # speculative decoding since start: drafts checked
    spec_accepted_tokens: int = 0  # and found right


class EngineCoreOutputs(msgspec.Struct, **_STRUCT):
    """One step's results for one client.

    Columns are aligned: request ``request_ids[i]`` produced ``num_new_tokens[i]`` tokens, found
    consecutively in ``new_token_ids``. Only requests with something to report appear.
    """

    request_ids: list[str] = []
    num_new_tokens: list[int] = []
    new_token_ids: list[int] = []
    # Sparse columns, keyed by the row index into request_ids.
    finished: dict[int, str] = {}  # row -> finish reason ("stop", "length", "abort", "error")
    stop_reasons: dict[int, int | str] = {}  # row -> the stop token id that ended it
    num_cached_tokens: dict[int, int] = {}  # row -> prefix-cache hit, on a request's first row
    logprobs: dict[int, list[Logprobs]] = {}
    # row -> the logprobs of prompt tokens 1.. of that request, on its first row (prompt_logprobs)
    prompt_logprobs: dict[int, list[Logprobs]] = {}
    errors: list[RequestError] = []  # requests rejected before running (validation)
    utility_output: UtilityOutput | None = None
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


# EngineCoreOutputs' sparse columns keyed by row: what splitting outputs by client must carry
# over row by row (a column left out here is lost for engines that serve several clients).
ROW_COLUMNS = ("finished", "stop_reasons", "num_cached_tokens", "logprobs", "prompt_logprobs")


class EngineDead(msgspec.Struct, **_STRUCT):
    """The engine hit a fatal error; every request of every client is lost."""

    message: str


EngineMessage = EngineCoreOutputs | EngineDead


# --------------------------------------------------------------------------- handshake


class EngineStartup(msgspec.Struct, **_STRUCT):
    """The client's answer to EngineHello: how to build the engine."""

    config: EngineConfig


class EngineHello(msgspec.Struct, **_STRUCT):
    """First message of the engine after the channel is up: who it is."""

    pid: int
    engine_index: int


class EngineReady(msgspec.Struct, **_STRUCT):
    """Sent once the model is loaded and the KV cache allocated."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    model_name: str
    weights: str = ""  # what the model packed (Int8Llama.weight_summary), for the server's log
