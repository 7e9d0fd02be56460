"""The offline API, shaped like vLLM's ``LLM`` so users can switch with an import change.

from shm_engine import LLM, SamplingParams
llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shm_engine.engine.client import EngineDeadError, InprocClient, SyncMPClient
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.output_processor import OutputProcessor, RequestOutput
from shm_engine.engine.protocol import EngineCoreRequest
from shm_engine.sampling_params import SamplingParams

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
        **engine_args: Any,
    ):
        from shm_engine.model.loader import load_model

        self.config = EngineConfig(model=model, **engine_args)
        # NOTE: load_model is lazy (weights are read on access), so this only parses metadata.
        self.tokenizer = load_model(model).tokenizer
        if in_process:
            self.client = InprocClient(self.config)
        elif data_parallel_size > 1:
            from shm_engine.engine.dp_client import DPClient

            self.client = DPClient(self.config, data_parallel_size)
        else:
            self.client = SyncMPClient(self.config)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        ids = [self._add(p, sp) for p, sp in zip(prompts, params, strict=True)]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's own chat template (with its default system prompt) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [
            {
                "prompt": text,
                "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
            }
            for text in (
                self.tokenizer.apply_chat_template(conv, add_generation_prompt, chat_template)
                for conv in conversations
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None):
        """Yield the text of one completion as it is generated (n must be 1)."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() produces one completion; use generate() for n > 1")
        rid = self._add(prompt, params)
        sent = 0
        try:
            while True:
                for r in self._pump():
                    if r.request_id != rid:
                        continue
                    if r.error:
                        raise ValueError(r.error)
                    text = r.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if r.finished:
                        return
        finally:
            if self.processor.engine_ids(rid):  # closed early: stop generating
                self.processor.abort(rid)
                with contextlib.suppress(EngineDeadError):
                    self.client.abort_requests([rid])

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text = prompt.get("prompt")
            token_ids = prompt.get("prompt_token_ids")
            if token_ids is None:
                if text is None:
                    raise ValueError("a prompt needs 'prompt' or 'prompt_token_ids'")
                token_ids = self.tokenizer.encode(text)
        rid = str(next(self._ids))
        token_array = np.asarray(token_ids, dtype=np.int32)
        for eid, child_params in self.processor.add_request(rid, text, list(token_ids), params):
            self.client.add_request(
                EngineCoreRequest(
                    request_id=eid,
                    prompt_token_ids=token_array,
                    sampling_params=child_params,
                    arrival_time=time.time(),
                )
            )
        return rid

    def _pump(self) -> list[RequestOutput]:
        """One engine step's outputs, processed; stop-string hits are aborted in the engine."""
        out = self.client.get_output(timeout=1.0)
        if out is None:
            return []
        results, to_abort = self.processor.process(out)
        if to_abort:
            self.client.abort_requests(to_abort)
        return results

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(finished) < len(request_ids):
                for r in self._pump():
                    if r.finished and r.request_id in wanted:
                        finished[r.request_id] = r
                        bar.update(1)
        except BaseException:
            # Interrupted (Ctrl-C, dead engine): do not leave our requests running in the engine.
            for rid in request_ids:
                engine_ids = self.processor.engine_ids(rid)
                self.processor.abort(rid)
                with contextlib.suppress(EngineDeadError):
                    self.client.abort_requests(engine_ids)
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
        self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
