"""OpenAI-compatible API logic: OpenAI requests become AsyncLLM requests and outputs become
OpenAI responses (JSON or SSE chunks). The app and process around it are api_server.py's.

Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for
invalid parameters, messages the chat template refuses and prompts that do not fit the context,
404 for an unknown model, 503 when the engine is gone. No request error takes the server down.
A client that disconnects has its request aborted in the engine: streaming responses are
cancelled by ``SSEResponse``'s disconnect watcher, non-streaming ones race the generation
against ``http.disconnect`` (streaming.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shm_engine.engine.output_processor import CompletionOutput, RequestOutput
from shm_engine.entrypoints.async_engine import (
    AsyncLLM,
    PromptTooLongError,
    RequestHandle,
    check_token_ids,
)
from shm_engine.entrypoints.metrics import ServerMetrics
from shm_engine.entrypoints.openai_errors import (
    APIError,
    ClientDisconnected,
    bad_request,
    engine_dead,
    error_body,
    to_api_error,
)
from shm_engine.entrypoints.openai_logprobs import (
    LogprobCursor,
    LogprobFormatter,
    TokenTable,
    vllm_prompt_logprobs,
)
from shm_engine.entrypoints.openai_protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    screen_counts,
)
from shm_engine.entrypoints.reasoning import (
    REASONING_TAGS,
    ReasoningSplitter,
    prompt_opens_thinking,
)
from shm_engine.entrypoints.streaming import SSE_DONE, SSEResponse, merge_streams, until_disconnect
from shm_engine.entrypoints.tags import tags_special
from shm_engine.entrypoints.tool_calls import (
    ToolCallDelta,
    ToolCallReader,
    ToolUse,
    finish_reason,
    parser_tags_special,
    whole_calls,
)
from shm_engine.sampling_params import LIST_CAPS, SamplingParams

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class ChatOptions:
    """How the server renders chats and reads tool calls (serve's flags)."""

    chat_template: str | None = None  # instead of the model's own
    tool_call_parser: str | None = None  # reads the calls of tool_choice "auto"; None: refused
    reasoning_parser: str | None = None  # splits <think>...</think> into `reasoning`


# --------------------------------------------------------------------------- per-request state


@dataclass
class _Choice:
    """What one choice has already sent to the client (outputs are cumulative)."""

    text_sent: int = 0
    text_bytes_sent: int = 0  # UTF-8 length of the text sent; kept only with logprobs
    done: bool = False
    lp: LogprobCursor = field(default_factory=LogprobCursor)
    tools: ToolCallReader | None = None  # reads tool calls out of a chat choice's text
    reasoning: ReasoningSplitter | None = None  # and its reasoning, before that

    def read(self, text: str, finished: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """A chat choice's next text as (reasoning, content, tool call pieces)."""
        reasoning, calls = "", []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, finished)
        if self.tools is not None:
            text, calls = self.tools.feed(text, finished)
        return reasoning, text, calls


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    request_id: str
    priority: int = 0
    cache_salt: str | None = None
    choices: list[_Choice] = field(default_factory=list)
    final: RequestOutput | None = None
    handle: RequestHandle | None = None


def _sse_chunk(
    rid: str, obj: str, created: int, model: str, choices: list[dict], usage: dict | None
) -> bytes:
    """One SSE event of a streamed completion (OpenAI chunk shape)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return b"data: " + _json.encode(body) + b"\n\n"


def _sse_error(e: BaseException) -> bytes:
    """A failure after the stream started: an error event (the status line is already sent)."""
    err = to_api_error(e)
    return b"data: " + _json.encode(error_body(err.status, err.message, err.type)) + b"\n\n"


# NOTE: prompts x n of one completion request. Each is an engine request, tokenised, added
# and (when the client goes) aborted on the event loop: a body of 100k one-token prompts (0.5 MB)
# had stalled every other request and /health for 12-14 s (a fuzzing review).
MAX_SEQUENCES_PER_REQUEST = 1024


def _usage(prompts: list[_Prompt], generated: bool = True) -> dict[str, Any]:
    """The usage object; generated=False for echo_only, whose one sampled token is dropped."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion = (
        sum(len(c.token_ids) for p in prompts if p.final is not None for c in p.final.outputs)
        if generated
        else 0
    )
    cached = sum(p.final.num_cached_tokens for p in prompts if p.final is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _chunk_usage(p: _Prompt, out: RequestOutput | None) -> dict[str, int]:
    """vLLM's continuous usage stats: the usage so far of the prompt a chunk belongs to (its
    choices' tokens; none before the first or for an echo)."""
    prompt = len(p.token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _finish_reason(c: CompletionOutput) -> str | None:
    r = c.finish_reason
    return None if r is None else ("stop" if r in ("stop", "abort") else r)


def _special_head(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text (a BOS), kept by truncation."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    return full[: len(full) - len(bare)] if full[len(full) - len(bare) :] == bare else []


# --------------------------------------------------------------------------- the server

# Prompts longer than this (characters) are tokenized in a worker thread. Shorter ones encode
# in ~1 ms inline: a thread hop would cost more than that in the 2 ms TTFT budget of the frontend.
INLINE_TOKENIZE_CHARS = 2048


class OpenAIServer:
    """Turns OpenAI requests into AsyncLLM requests and outputs into OpenAI responses."""

    def __init__(
        self,
        engine: AsyncLLM,
        metrics: ServerMetrics,
        model_name: str,
        chat: ChatOptions | None = None,
    ) -> None:
        self.engine = engine
        self.chat_options = chat or ChatOptions()
        self.parser_tags_special = parser_tags_special(
            engine.tokenizer, self.chat_options.tool_call_parser
        )
        self.reasoning_tags_special = self.chat_options.reasoning_parser is not None and (
            tags_special(engine.tokenizer, REASONING_TAGS)
        )
        self.metrics = metrics
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self.tokens = TokenTable(engine.tokenizer)
        self.logprobs = LogprobFormatter(self.tokens)
        # A longer prompt cannot fit in the context, however it tokenizes.
        self.max_prompt_chars = engine.max_model_len * self.tokens.max_token_chars
        self._special_head = _special_head(self.tokenizer)

    # ------------------------------------------------------------------ helpers

    def screen_body(self, path: str, body: bytes) -> str | None:
        """Why a large body is refused before validation, or None (see HotRoutes).

        A chat with more messages than the context has tokens cannot fit (every message takes
        at least one), and validating 300k of them held the event loop for 2 s; 2.5M stop
        strings (31 MB) held it for 15 s before SamplingParams refused them.
        """
        counts = screen_counts(body)
        if counts is None:
            return None
        for name, cap in {**LIST_CAPS, "tools": MAX_TOOLS}.items():
            if counts[name] > cap:
                return f"{name} takes at most {cap} entries, got {counts[name]}"
        limit, messages = self.engine.max_model_len, counts["messages"]
        if path != "/v1/chat/completions" or messages <= limit or counts["truncating"]:
            return None
        return (
            f"This model's maximum context length is {limit} tokens, but the conversation has "
            f"{messages} messages, more than {limit} tokens can hold."
        )

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model_not_found", "model")

    def check_alive(self) -> None:
        if self.engine.is_dead:
            raise engine_dead(self.engine.dead_reason or "")

    def _check_chars(self, text: str) -> None:
        """Refuse a text too long for the context before paying for its tokenization.

        A 12 MB prompt took 13 s to encode only to be refused for its length afterwards.
        """
        limit = self.max_prompt_chars
        if len(text) <= limit:
            return
        normalizer = self.tokenizer.backend.normalizer
        # NOTE: the bound holds for the text the model tokenizes: a normalizer (NFC, ...) may
        # shorten it first. Only texts past the limit pay for this, off the event loop.
        if normalizer is not None and len(normalizer.normalize_str(text)) <= limit:
            return
        n = self.engine.max_model_len
        raise PromptTooLongError(
            f"This model's maximum context length is {n} tokens, but the prompt has "
            f"{len(text)} characters, more than {n} tokens can hold (the longest token has "
            f"{self.tokens.max_token_chars})."
        )

    def _tokenize(
        self, text: str, add_special_tokens: bool, in_thread: bool, keep: int | None = None
    ) -> list[int]:
        """``keep``: only the last ``keep`` tokens are wanted (truncate_prompt_tokens); else a
        text too long for the context is refused first."""
        if keep is None:
            self._check_chars(text)
        else:
            text = self._text_tail(text, keep)
        if not in_thread:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            # NOTE: encode_batch, not encode: only the batch call releases the GIL while the
            # Rust tokenizer runs, so only it lets the event loop go on next to this thread.
            ids = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return ids if keep is None else self._keep_last(ids, keep, add_special_tokens)

    def _tokenize_all(self, texts: list[str], keep: int | None = None) -> list[list[int]]:
        """Completion prompts' ids, in a worker thread: every length is checked first, so a
        too-long last prompt is refused before the others are paid for."""
        if keep is not None:
            texts = [self._text_tail(text, keep) for text in texts]
        for text in texts if keep is None else ():
            self._check_chars(text)
        rows = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        return rows if keep is None else [self._keep_last(ids, keep, True) for ids in rows]

    async def _encode(self, texts: list[str], keep: int | None = None) -> list[list[int]]:
        """Completion prompts' ids; long ones (in total) are tokenized in a worker thread."""
        # NOTE: the total decides: thousands of prompts each under the limit had stalled the
        # event loop (every stream, /health) for seconds.
        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            return [self._tokenize(text, True, in_thread=False, keep=keep) for text in texts]
        return await asyncio.to_thread(self._tokenize_all, texts, keep)

    def _kept_tokens(
        self, req: CompletionRequest | ChatCompletionRequest, params: SamplingParams
    ) -> int | None:
        """How many prompt tokens vLLM's truncate_prompt_tokens keeps (None: no truncation).

        -1: as many as leave room for an explicit max_tokens, else one token (a default
        max_tokens is then cut to the room left, as for any prompt)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return None
        limit = self.engine.max_model_len
        if k == -1:
            room = 1 if req.max_tokens_unset else (params.max_tokens or 1)
            return max(1, limit - room)
        if k > limit:
            raise bad_request(
                f"truncate_prompt_tokens ({k}) is larger than the context ({limit} tokens)",
                "truncate_prompt_tokens",
            )
        return k

    def _text_tail(self, text: str, keep: int) -> str:
        """The end of a text that still holds more than ``keep`` tokens: a 30 MB prompt cut to
        a few tokens had been tokenized whole (a minute of a core). Every token has at most
        max_token_chars characters; 64 tokens to spare keep the cut's word out of the end."""
        chars = (keep + 64) * self.tokens.max_token_chars
        return text if len(text) <= chars else text[-chars:]

    def _keep_last(self, ids: list[int], keep: int, added: bool) -> list[int]:
        """The last ``keep`` ids, after the special tokens the tokenizer put in front (a
        BOS), as transformers truncates from the left."""
        if len(ids) <= keep:
            return ids
        head = self._special_head if added else []
        if head and keep > len(head) and ids[: len(head)] == head:
            return head + ids[len(ids) - (keep - len(head)) :]
        return ids[-keep:]

    def _chat_text(self, req: ChatTemplateFields) -> str:
        return self.tokenizer.apply_chat_template(
            req.conversation(),
            add_generation_prompt=req.generation_prompt,
            chat_template=self.chat_options.chat_template,
            continue_final_message=req.continue_final_message,
            tools=req.template_tools(),
            **req.template_kwargs(),
        )

    def _render_chat(
        self, req: ChatCompletionRequest, in_thread: bool, keep: int | None
    ) -> tuple[str, list[int]]:
        text = self._chat_text(req)
        return text, self._tokenize(text, False, in_thread, keep)

    async def _prompts_from_completion(
        self, req: CompletionRequest, params: SamplingParams
    ) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str):
            raw: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [list(p)]  # type: ignore[arg-type]
        else:
            raw = list(p)  # type: ignore[arg-type]
        if not raw:
            raise bad_request("prompt must not be empty", "prompt")
        if len(raw) * params.n > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(
                f"prompts x n is {len(raw) * params.n}; one request may ask for at most "
                f"{MAX_SEQUENCES_PER_REQUEST} sequences",
                "prompt",
            )
        prompts = []
        base = f"cmpl-{uuid.uuid4().hex[:24]}"
        keep = self._kept_tokens(req, params)
        encoded = iter(await self._encode([x for x in raw if isinstance(x, str)], keep))
        for i, item in enumerate(raw):
            if isinstance(item, str):
                text, ids = item, next(encoded)
            else:
                try:
                    check_token_ids(item, self.engine.client.ready.vocab_size)
                except ValueError as e:
                    raise bad_request(str(e), "prompt") from None
                text, ids = None, list(item)
            if keep is not None:
                # NOTE: the echo then decodes the tokens the model saw (text None)
                text, ids = None, self._keep_last(ids, keep, added=False)
            fitted = self._fit_default_max_tokens(req, ids, params)
            self.engine.check_prompt(ids, fitted)
            prompts.append(_Prompt(text, ids, fitted, f"{base}-{i}", req.priority, req.cache_salt))
        return prompts

    async def _prompt_from_chat(
        self, req: ChatCompletionRequest, params: SamplingParams
    ) -> _Prompt:
        """The templated prompt; a long conversation is rendered and tokenized in a thread."""
        keep = self._kept_tokens(req, params)
        if req.template_chars() <= INLINE_TOKENIZE_CHARS:
            text, ids = self._render_chat(req, False, keep)
        else:
            text, ids = await asyncio.to_thread(self._render_chat, req, True, keep)
        if keep is not None:
            text = None  # the prompt is the kept tokens
        params = self._fit_default_max_tokens(req, ids, params)
        self.engine.check_prompt(ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        return _Prompt(text, ids, params, rid, req.priority, req.cache_salt)

    def _fit_default_max_tokens(
        self, req: CompletionRequest | ChatCompletionRequest, ids: list[int], params: SamplingParams
    ) -> SamplingParams:
        """A max_tokens the model's generation_config.json gave, not the request, is cut to the
        room the prompt leaves (vLLM's get_max_tokens): it must not turn a request into a 400."""
        if not req.max_tokens_unset or "max_tokens" not in self.engine.sampling_defaults:
            return params
        room = self.engine.max_model_len - len(ids)
        if params.max_tokens is None or params.max_tokens <= room or room < 1:
            return params  # room < 1: check_prompt reports the prompt itself
        return msgspec.structs.replace(
            params, max_tokens=room, min_tokens=min(params.min_tokens, room)
        )

    def _start(self, prompts: list[_Prompt]) -> list[RequestHandle]:
        """Send every prompt to the engine before the HTTP response is set up (TTFT)."""
        handles: list[RequestHandle] = []
        try:
            for p in prompts:
                p.handle = self.engine.add_request(
                    p.text, p.token_ids, p.params, p.request_id, p.priority, p.cache_salt
                )
                handles.append(p.handle)
        except BaseException:
            for h in handles:
                h.close()
            raise
        return handles

    async def _run(self, prompt: _Prompt) -> AsyncIterator[RequestOutput]:
        assert prompt.handle is not None
        async for out in prompt.handle.outputs():
            prompt.final = out
            yield out

    async def _collect(self, prompts: list[_Prompt]) -> None:
        async def one(p: _Prompt) -> None:
            async for _ in self._run(p):
                pass

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # NOTE: gather leaves the others running; their handles are closed (aborted) by
            # the caller next, after which nothing would ever wake them.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _next_delta(
        self, c: CompletionOutput, st: _Choice, hold: int, params: SamplingParams, chat: bool
    ) -> tuple[str, str | None, dict[str, Any] | None] | None:
        """A choice's next chunk: (text, finish reason, the logprobs that go with it).

        None while there is nothing to send. Text is held back while a stop string may still cut
        it; logprobs wait for their tokens' text, so a chunk's logprobs match its text.
        """
        if st.done:
            return None
        finish = _finish_reason(c)
        end = len(c.text) if finish else max(st.text_sent, len(c.text) - hold)
        delta = c.text[st.text_sent : end]
        if not delta and finish is None:
            return None
        st.text_sent = end
        st.done = finish is not None
        if params.logprobs is None or c.logprobs is None:
            return delta, finish, None
        st.text_bytes_sent += len(delta.encode())
        skip = params.skip_special_tokens
        ntok = (
            len(c.token_ids)
            if st.done
            else self.logprobs.tokens_covered(c, st.lp, st.text_bytes_sent, skip)
        )
        if chat:
            return delta, finish, self.logprobs.chat(c, ntok, st.lp, skip, params.logprobs)
        return delta, finish, self.logprobs.completion(c, ntok, st.lp, skip)

    def _completion_delta(
        self, base: int, c: CompletionOutput, st: _Choice, hold: int, params: SamplingParams
    ) -> dict[str, Any] | None:
        """A streamed completions choice (index ``base + c.index``), or None: nothing new."""
        step = self._next_delta(c, st, hold, params, chat=False)
        if step is None:
            return None
        delta, finish, lp = step
        return {"index": base + c.index, "text": delta, "logprobs": lp, "finish_reason": finish,
                "stop_reason": c.stop_reason if finish else None}  # fmt: skip

    def _chat_delta(
        self,
        c: CompletionOutput,
        st: _Choice,
        hold: int,
        params: SamplingParams,
        tools: ToolUse | None,
    ) -> dict[str, Any] | None:
        """A streamed chat choice, or None: nothing new."""
        step = self._next_delta(c, st, hold, params, chat=True)
        if step is None:
            return None
        text, finish, lp = step
        reasoning, text, calls = st.read(text, finish is not None)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [call.to_openai() for call in calls]
        if finish is not None:
            finish = finish_reason(tools, st.tools, finish)
        if not delta and finish is None and lp is None:
            return None  # text a reader holds back
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                "stop_reason": c.stop_reason if finish else None}  # fmt: skip

    def _splits_reasoning(self, params: SamplingParams) -> bool:
        """A reasoning parser applies, unless a constraint shapes the whole answer."""
        return self.chat_options.reasoning_parser is not None and params.structured_outputs is None

    def _chat_choice(self, p: _Prompt, tools: ToolUse | None) -> _Choice:
        """A chat choice's state, with the readers of its reasoning and tool calls."""
        parser, splitter = self.chat_options.reasoning_parser, None
        if parser is not None and self._splits_reasoning(p.params):
            tail = self.tokenizer.decode(p.token_ids[-8:], skip_special_tokens=False)
            splitter = ReasoningSplitter(parser, inside=prompt_opens_thinking(tail))
        return _Choice(tools=tools.reader() if tools is not None else None, reasoning=splitter)

    # ------------------------------------------------------------------ completions

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_alive()
        params = req.sampling_params(self.engine.sampling_defaults)
        prompts = await self._prompts_from_completion(req, params)
        if req.stream:
            return SSEResponse(self._stream_completions(req, prompts), self._start(prompts))
        handles = self._start(prompts)
        try:
            await until_disconnect(raw, self._collect(prompts))
        finally:
            for h in handles:
                h.close()
        choices = []
        for i, p in enumerate(prompts):
            assert p.final is not None
            prefix, echo_skip = self._echo(p) if req.echo else ("", True)
            skip = params.skip_special_tokens
            echoed = None
            if req.echo_logprobs:
                echoed = self.logprobs.prompt(p.final, prefix, echo_skip, req.logprobs)
            for c in p.final.outputs:
                text, lp, finish, reason = prefix + c.text, echoed, _finish_reason(c), c.stop_reason
                if req.echo_only:
                    text, finish, reason = prefix, "length", None
                elif params.logprobs is not None and c.logprobs is not None:
                    cur = LogprobCursor(offset=len(prefix))
                    lp = self.logprobs.completion(c, len(c.token_ids), cur, skip)
                    if echoed is not None:
                        lp = {k: echoed[k] + v for k, v in lp.items()}
                choice = {
                    "index": i * params.n + c.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(p.final, req.prompt_logprobs)
                choices.append(choice)
        return JSONResponse(
            {
                "id": prompts[0].request_id.rsplit("-", 1)[0],
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(prompts, generated=not req.echo_only),
            }
        )

    @staticmethod
    def _echo_only_ends(base: int, out: RequestOutput, states: list[_Choice]) -> list[dict]:
        """The closing chunk of each echo_only choice that just finished (its sampled token is
        not sent; the echoed prompt was the whole answer)."""
        ends = []
        for c in out.outputs:
            st = states[c.index]
            if c.finish_reason is not None and not st.done:
                st.done = True
                ends.append({"index": base + c.index, "text": "", "logprobs": None,
                             "finish_reason": "length", "stop_reason": None})  # fmt: skip
        return ends

    def _echo(self, p: _Prompt) -> tuple[str, bool | None]:
        """The echoed prompt, and whether its logprobs' offsets skip special tokens.

        NOTE: the text and the offsets follow one rule, or offsets index the wrong characters: a
        text prompt is echoed as given, with the special tokens typed in it but not a BOS the
        tokenizer added (None: offsets count a special token where the text holds it); token
        ids are decoded as the request decodes its output (``skip_special_tokens``).
        """
        if p.text is not None:
            return p.text, None
        skip = p.params.skip_special_tokens
        return self.tokenizer.decode(p.token_ids, skip_special_tokens=skip), skip

    async def _stream_completions(
        self, req: CompletionRequest, prompts: list[_Prompt]
    ) -> AsyncIterator[bytes]:
        rid = prompts[0].request_id.rsplit("-", 1)[0]
        created = int(time.time())
        params = prompts[0].params
        n = params.n
        hold = params.stop_holdback

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            return _sse_chunk(rid, "text_completion", created, self.model_name, choices, usage)

        # NOTE: the output that finishes the last prompt is written with [DONE] (SSEResponse):
        # the stream ends there, so holding it back delays nothing
        tail, unfinished = b"", len(prompts)
        try:
            async for i, p, out in merge_streams(
                [(i, p, self._run(p)) for i, p in enumerate(prompts)]
            ):
                if not p.choices:
                    p.choices = [_Choice() for _ in range(n)]
                    if req.echo:
                        prefix, echo_skip = self._echo(p)
                        for st in p.choices:
                            st.lp.offset = len(prefix)  # offsets count the echoed prompt
                        lp = None
                        if req.echo_logprobs:
                            lp = self.logprobs.prompt(out, prefix, echo_skip, req.logprobs)
                        echoed = [{"index": i * n + j, "text": prefix, "logprobs": lp,
                                   "finish_reason": None} for j in range(n)]  # fmt: skip
                        usage = _chunk_usage(p, None) if req.continuous_usage else None
                        yield chunk(echoed, usage)
                if req.echo_only:
                    choices = self._echo_only_ends(i * n, out, p.choices)
                else:
                    choices = [
                        d
                        for c in out.outputs
                        if (d := self._completion_delta(i * n, c, p.choices[c.index], hold, params))
                    ]
                unfinished -= out.finished
                if choices:
                    usage = None
                    if req.continuous_usage:
                        usage = _chunk_usage(p, None if req.echo_only else out)
                    data = chunk(choices, usage)
                    if unfinished:
                        yield data
                    else:
                        tail = data
            if req.include_usage:
                tail += chunk([], _usage(prompts, generated=not req.echo_only))
        except ClientDisconnected:
            logger.info("%s: the client disconnected; request aborted", rid)
            return
        except Exception as e:
            tail += _sse_error(e)
        yield tail + SSE_DONE

    # ------------------------------------------------------------------ chat

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_alive()
        tools = req.tool_use(self.chat_options.tool_call_parser, self.parser_tags_special)
        params = req.sampling_params(self.engine.sampling_defaults, tools)
        if self._splits_reasoning(params) and self.reasoning_tags_special:
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        prompt = await self._prompt_from_chat(req, params)
        if req.stream:
            return SSEResponse(self._stream_chat(req, prompt, tools), self._start([prompt]))
        (handle,) = self._start([prompt])
        try:
            await until_disconnect(raw, self._collect([prompt]))
        finally:
            handle.close()
        assert prompt.final is not None
        choices = []
        for c in prompt.final.outputs:
            lp = None
            if params.logprobs is not None and c.logprobs is not None:
                skip = params.skip_special_tokens
                end = len(c.token_ids)
                lp = self.logprobs.chat(c, end, LogprobCursor(), skip, params.logprobs)
            st = self._chat_choice(prompt, tools)
            reasoning, content, calls = st.read(c.text, finished=True)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if st.reasoning is not None:
                message["reasoning"] = message["reasoning_content"] = reasoning or None
                message["content"] = content or None  # the answer was all thinking
            if calls:
                message["tool_calls"] = whole_calls(calls)
                message["content"] = content if content.strip() else None
            finish = finish_reason(tools, st.tools, _finish_reason(c) or "stop")
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": prompt.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage([prompt]),
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(prompt.final, req.prompt_logprobs)
        return JSONResponse(body)

    async def _stream_chat(
        self, req: ChatCompletionRequest, p: _Prompt, tools: ToolUse | None
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        params = p.params
        hold = params.stop_holdback

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            return _sse_chunk(
                p.request_id, "chat.completion.chunk", created, self.model_name, choices, usage
            )

        # NOTE: the role chunk waits for the engine's first output (as vLLM's server does): a
        # client times the first chunk as TTFT, and one sent at once measured only the frontend.
        role: bytes | None = chunk(
            [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None} for j in range(params.n)],
            _chunk_usage(p, None) if req.continuous_usage else None,
        )  # fmt: skip
        tail = b""
        try:
            p.choices = [self._chat_choice(p, tools) for _ in range(params.n)]
            async for out in self._run(p):
                choices = [
                    d
                    for c in out.outputs
                    if (d := self._chat_delta(c, p.choices[c.index], hold, params, tools))
                ]
                usage = _chunk_usage(p, out) if req.continuous_usage else None
                data = chunk(choices, usage) if choices else b""
                if role is not None:
                    data, role = role + data, None  # one write: the role, then the first text
                if out.finished:
                    tail = data  # written with [DONE], as in _stream_completions
                elif data:
                    yield data
            if req.include_usage:
                tail += chunk([], _usage([p]))
        except ClientDisconnected:
            logger.info("%s: the client disconnected; request aborted", p.request_id)
            return
        except Exception as e:
            tail += _sse_error(e)
        yield tail + SSE_DONE

    # ------------------------------------------------------------------ tokenizer endpoints

    async def tokenize(self, req: TokenizeRequest) -> Response:
        """vLLM's /tokenize: a prompt's (or a rendered chat's) token ids, of any length (the
        count is what a client asks for). A long one is counted, and its answer built and
        encoded, in a worker thread: 8M tokens' JSON had held the event loop for seconds."""
        self.check_model(req.model)

        def answer() -> bytes:
            text = self._chat_text(req) if req.prompt is None else req.prompt
            tokens = self.tokenizer.encode_batch([text], add_special_tokens=req.special_tokens)[0]
            strs = None
            if req.return_token_strs:
                strs = [self.tokenizer.id_to_token(t) for t in tokens]
            return _json.encode({"count": len(tokens), "max_model_len": self.engine.max_model_len,
                                 "tokens": tokens, "token_strs": strs})  # fmt: skip

        small = req.template_chars() + len(req.prompt or "") <= INLINE_TOKENIZE_CHARS
        body = answer() if small else await asyncio.to_thread(answer)
        return Response(body, media_type="application/json")

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        """vLLM's /detokenize: the text of token ids, special tokens included; ids the
        tokenizer does not have (a model's padded vocabulary) are a 400, not dropped."""
        self.check_model(req.model)

        def answer() -> bytes:
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                message = f"token id {bad} is not in the tokenizer's vocabulary (size {vocab})"
                raise bad_request(message, "tokens")
            text = self.tokenizer.decode(req.tokens, skip_special_tokens=False)
            return _json.encode({"prompt": text})

        small = len(req.tokens) <= INLINE_TOKENIZE_CHARS
        body = answer() if small else await asyncio.to_thread(answer)
        return Response(body, media_type="application/json")

    # ------------------------------------------------------------------ misc endpoints

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "shm_engine",
                    "root": self.model_name,
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    async def render_metrics(self) -> bytes:
        stats = await self.engine.get_stats(timeout=1.0)
        self.metrics.update_stats(stats, alive=not self.engine.is_dead)
        self.metrics.frontend_inflight.set(self.engine.num_unfinished())
        return self.metrics.render()
