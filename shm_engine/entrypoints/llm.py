"""The offline API, shaped like vLLM's ``LLM`` so users can switch with an import change.

from shm_engine import LLM, SamplingParams
llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shm_engine.engine.client import (
    EngineDeadError,
    EngineLaunch,
    InprocClient,
    SyncMPClient,
    close_launches,
    launch_engines,
)
from shm_engine.engine.config import EngineConfig, speculative_args
from shm_engine.engine.output_processor import OutputProcessor, RequestOutput
from shm_engine.engine.protocol import EngineCoreRequest
from shm_engine.entrypoints.async_engine import (
    check_priority,
    check_prompt_fits,
    check_stop_token_ids,
    check_token_ids,
)
from shm_engine.entrypoints.hf_tokenizer import HFStyleTokenizer
from shm_engine.model.tokenizer import template_kwargs
from shm_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shm_engine.engine.dp_client import DPClient

    EngineClient = InprocClient | SyncMPClient | DPClient

PromptType = str | Mapping[str, Any]  # text, or {"prompt_token_ids": [...]} / {"prompt": ...}
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """Runs an engine (in another process by default) and generates for batches of prompts."""

    def __init__(
        self,
        model: str | None = None,
        *,
        in_process: bool = False,
        data_parallel_size: int = 1,
        speculative_config: dict | None = None,
        **engine_args: Any,
    ):
        """``engine_args`` are EngineConfig's; ``speculative_config`` is vLLM's spelling of its
        speculative fields (``{"method": "ngram", "num_speculative_tokens": K, ...}``)."""
        from shm_engine.model.loader import load_model_info, resolve_model_path

        engine_args.update(speculative_args(speculative_config))
        self.config = EngineConfig(model=model, **engine_args)
        if data_parallel_size < 1 or (in_process and data_parallel_size != 1):
            raise ValueError(
                f"data_parallel_size must be at least 1 (1 with in_process), got {data_parallel_size}"
            )
        resolve_model_path(model)  # a missing model fails here, before an engine is spawned
        # NOTE: the engine processes (one a replica) start first; this one reads only the
        # config and tokenizer (no torch, no weights: ~0.45 s of the GGUF's vocabulary) while
        # the engines import their own, and a model it cannot read stops them at once.
        launches = None if in_process else launch_engines(data_parallel_size)
        try:
            info = load_model_info(model)
            self.client = self._start_client(in_process, data_parallel_size, launches)
        except BaseException:
            close_launches(launches)  # those no client adopted (the others stop with it)
            raise
        # NOTE: an LLM dropped without shutdown() stops its engine when it is collected (or at
        # exit); the client cannot do this itself, since its receiver thread keeps it reachable.
        self._stop_engine = weakref.finalize(self, self.client.shutdown)
        self.tokenizer = info.tokenizer
        self._sampling_defaults = info.sampling_defaults
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # NOTE: the newest output of every request in flight, whoever pumped it: a stream paused
        # while generate() (or another stream) runs finds its outputs, its last one included,
        # here (each is cumulative, so the newest is all a consumer needs).
        self._latest: dict[str, RequestOutput] = {}

    def _start_client(
        self, in_process: bool, data_parallel_size: int, launches: list[EngineLaunch] | None
    ) -> EngineClient:
        if in_process:
            return InprocClient(self.config)
        if data_parallel_size > 1:
            from shm_engine.engine.dp_client import DPClient

            return DPClient(self.config, data_parallel_size, launches)
        return SyncMPClient(self.config, launch=launches[0] if launches else None)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``, ``chat`` and ``stream`` use without SamplingParams: vLLM's
        defaults, overridden by the model's generation_config.json sampling values."""
        return SamplingParams(**self._sampling_defaults)

    @property
    def max_model_len(self) -> int:
        """The longest sequence, prompt and output, a request may reach."""
        return self.client.ready.max_model_len

    def get_tokenizer(self) -> HFStyleTokenizer:
        """The model's tokenizer with Hugging Face's conventions (as vLLM's get_tokenizer)."""
        return HFStyleTokenizer(self.tokenizer)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Every prompt is checked before any is sent: an
        empty one or one that cannot fit the context raises ValueError, as in vLLM.

        ``priority``: one a prompt, for ``scheduling_policy="priority"`` (lower runs first). A
        prompt dict may carry vLLM's ``cache_salt`` (prefix-cache blocks shared only within it)."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError("give one priority per prompt")
        for prio in priorities:
            check_priority(prio, self.config.scheduling_policy == "priority")
        priorities = [int(p) for p in priorities]
        for sp in params:
            check_stop_token_ids(sp, self.client.ready.vocab_size)
        # Every prompt is tokenized (and checked) before any is sent.
        inputs = [(*self._tokenize(p), _cache_salt(p)) for p in prompts]
        ids: list[str] = []
        try:
            for (text, token_ids, salt), sp, prio in zip(inputs, params, priorities, strict=True):
                ids.append(self._add(text, token_ids, sp, prio, salt))
        except BaseException:
            self._abort(ids)  # the prompts sent before the one that failed
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's own chat template (with its default system prompt) and generate.

        ``tools``: OpenAI's tool objects, for a template that shows them to the model (the
        calls it writes are its text; the server's tool_choice is what parses them)."""
        extra = template_kwargs(chat_template_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [
            {
                "prompt": text,
                "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
            }
            for text in (
                self.tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt,  # with continue_final_message: ValueError (vLLM)
                    chat_template,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    **extra,
                )
                for conv in conversations
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None):
        """Yield the text of one completion as it is generated (n must be 1)."""
        params = sampling_params or self.get_default_sampling_params()
        if params.n != 1:
            raise ValueError("stream() produces one completion; use generate() for n > 1")
        check_stop_token_ids(params, self.client.ready.vocab_size)
        rid = self._add(*self._tokenize(prompt), params, cache_salt=_cache_salt(prompt))
        sent = 0
        hold = params.stop_holdback
        try:
            while True:
                r = self._latest.pop(rid, None)
                if r is None:
                    self._pump()
                    continue
                if r.error:
                    raise ValueError(r.error)
                text = r.outputs[0].text
                end = len(text) if r.finished else len(text) - hold
                if end > sent:
                    yield text[sent:end]
                    sent = end
                if r.finished:
                    return
        finally:
            self._abort([rid])  # a no-op once it finished; closed early: stop generating

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text and ids; ValueError (as vLLM's) if it is empty, cannot fit or has
        ids out of the vocabulary."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text = prompt.get("prompt")
            token_ids = prompt.get("prompt_token_ids")
            if token_ids is None:
                if text is None:
                    raise ValueError("a prompt needs 'prompt' or 'prompt_token_ids'")
                token_ids = self.tokenizer.encode(text)
            else:
                check_token_ids(token_ids, self.client.ready.vocab_size)
        check_prompt_fits(len(token_ids), self.max_model_len)
        return text, list(token_ids)

    def _add(
        self,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        rid = str(next(self._ids))
        token_array = np.asarray(token_ids, dtype=np.int32)
        try:
            for eid, child_params in self.processor.add_request(rid, text, token_ids, params):
                self.client.add_request(
                    EngineCoreRequest(
                        request_id=eid,
                        prompt_token_ids=token_array,
                        sampling_params=child_params,
                        arrival_time=time.time(),
                        priority=priority,
                        cache_salt=cache_salt,
                    )
                )
        except BaseException:
            self._abort([rid])  # children sent before the failure
            raise
        return rid

    def _abort(self, request_ids: list[str]) -> None:
        """Stop requests in the engine and forget them here (unknown or finished ones: no-op)."""
        for rid in request_ids:
            self._latest.pop(rid, None)
            engine_ids = self.processor.engine_ids(rid)
            if engine_ids:
                self.processor.abort(rid)
                with contextlib.suppress(EngineDeadError):
                    self.client.abort_requests(engine_ids)

    def _pump(self) -> None:
        """One engine step's outputs, processed into ``_latest``; stop-string hits are aborted
        in the engine.

        NOTE: a Ctrl-C between taking a step's output off the queue and storing what it made
        lost that step for every request in flight (a stream paused meanwhile could miss text,
        or wait forever for the finish it held): it is held until the step is stored, and the
        wait is short, so Ctrl-C still acts within ~0.1 s."""
        with _ctrl_c_held():
            out = self.client.get_output(timeout=0.1)
            if out is None:
                return
            results, to_abort = self.processor.process(out)
            for r in results:
                self._latest[r.request_id] = r
            if to_abort:
                self.client.abort_requests(to_abort)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        waiting = list(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while True:
                for rid in waiting:
                    r = self._latest.get(rid)
                    if r is not None and r.finished:
                        if r.error:
                            # NOTE: raise as vLLM's LLM does (its outputs have no error field);
                            # the handler below aborts the other prompts.
                            raise ValueError(r.error)
                        finished[rid] = self._latest.pop(rid)
                        bar.update(1)
                waiting = [rid for rid in waiting if rid not in finished]
                if not waiting:
                    break
                self._pump()
        except BaseException:
            # Interrupted (Ctrl-C, dead engine): do not leave our requests running in the engine.
            self._abort(request_ids)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]

    # ------------------------------------------------------------------ engine utilities

    def get_stats(self):
        return self.client.call_utility("get_stats")

    def reset_prefix_cache(self) -> int:
        return self.client.call_utility("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self.client.call_utility("sleep", level)

    def wake_up(self) -> None:
        self.client.call_utility("wake_up")

    def shutdown(self) -> None:
        """Stop the engine (once; later calls do nothing)."""
        self._stop_engine()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _cache_salt(prompt: PromptType) -> str | None:
    """vLLM's prompt-dict ``cache_salt``: a non-empty string, or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string")
    return salt


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Ctrl-C (SIGINT under Python's own handler, in the main thread) raised only once the
    block is done; elsewhere, or under a handler of the application's, nothing changes."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if pressed:
            raise KeyboardInterrupt
