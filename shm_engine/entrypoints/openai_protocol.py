"""Request models of the OpenAI-compatible API (pydantic, validated by FastAPI).

Only what changes generation is modelled; unknown fields are ignored, as the OpenAI API tolerates
new client fields, except vLLM's that this server does not implement (beam search, structural
tags, logits_processors, ...): those are refused unless at their defaults. vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, ignore_eos, priority, cache_salt, ...) are accepted too, so
clients written for vLLM work unchanged. Range checks live in SamplingParams
(one place); its ValueError becomes an HTTP 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from shm_engine.entrypoints.tool_calls import ToolUse, template_tool
from shm_engine.model.tokenizer import template_kwargs, text_parts
from shm_engine.sampling_params import SamplingParams, StructuredOutputsParams

# NOTE: token ids are strict, non-negative integers (the schema says so too): pydantic's lax
# mode would read true, 2.0 or "7" in a token list as ids, and a client's mistake would come
# back as text instead of a 400.
TokenId = Annotated[int, Strict(), Field(ge=0)]


class _NullIsDefault(BaseModel):
    """OpenAI's schema makes fields nullable and its client sends ``null`` for a None
    argument: null means the default (as in vLLM), not a type error."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_NullIsDefault):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far too
    continuous_usage_stats: bool = False


# vLLM request fields this server does not implement, each with the values that change nothing
# (vLLM's defaults; null always means the default): any other value is refused with a 400, since
# ignoring it would change what the caller gets without saying so. Other unknown fields are
# ignored, as the OpenAI API tolerates new client fields.
_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "structural_tag": (),
    "guided_whitespace_pattern": (),
    "logits_processors": ([],),
    "prompt_embeds": (),
    "return_tokens_as_token_ids": (False,),
    "vllm_xargs": ({},),
}
# Fields of vLLM's StructuredOutputsParams that change nothing here (the backend is chosen by the
# server), and flags accepted only when false.
_IGNORED_CONSTRAINT_FIELDS = frozenset(
    {"backend", "_backend", "_backend_was_auto", "disable_fallback"}
)
_CONSTRAINT_FLAGS_OFF = frozenset({"disable_additional_properties"})
_UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    "chat_template": (),
    "echo": (False,),
    "add_special_tokens": (False,),
    "documents": ([],),
}


_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})


class _SamplingFields(_NullIsDefault):
    """Fields shared by completions and chat completions."""

    # NOTE: "allow" keeps unknown fields in model_extra, where unsupported vLLM ones are found.
    model_config = ConfigDict(extra="allow")
    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED_FIELDS

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # OpenAI's: {"token id": bias in [-100, 100]}
    logit_bias: dict[str, float] | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs (and its older
    # guided_* fields); one of them per request.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM extensions
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: the prompt tokens' logprobs (own token and top-n), in the non-streamed response
    prompt_logprobs: int | None = None
    # vLLM's: keep the prompt's last k tokens (-1: as many as fit with max_tokens)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0  # lower runs first under --scheduling-policy priority
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    # Accepted as vLLM does with fast tokenizers, which leave special tokens' spacing as is.
    spaces_between_special_tokens: bool = True

    def _check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            harmless = self._unsupported.get(name)
            if harmless is not None and value not in harmless:
                raise ValueError(f"{name} is not supported by this server")
        if self.cache_salt == "":
            raise ValueError("cache_salt must be a non-empty string if given")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")

    def _sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: Mapping[str, Any],
        tools: ToolUse | None = None,
    ) -> SamplingParams:
        """Build SamplingParams; raises ValueError (-> 400) for out-of-range values.

        ``defaults``: the model's values (generation_config.json) for temperature, top_p,
        top_k, min_p and repetition_penalty, taken where the request leaves them unset (vLLM).
        ``tools``: a chat request's tool use, which may constrain the output."""
        self._check_unsupported()
        constraint = self._structured_outputs()
        if tools is not None and (tool_constraint := tools.constraint()) is not None:
            if constraint is not None:
                raise ValueError(
                    "a required or named tool_choice constrains the output itself: it excludes "
                    "response_format and structured_outputs"
                )
            constraint = tool_constraint
        # NOTE: where the auto parser's tags are special tokens it must see them (vLLM skips
        # no special token then; here only where the model has the tags as such).
        skip_special = self.skip_special_tokens and not (tools and tools.keeps_special_tokens)

        def pick(name: str, value: Any, fallback: Any) -> Any:
            return value if value is not None else defaults.get(name, fallback)

        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kw: dict[str, Any] = dict(
            n=self.n,
            temperature=pick("temperature", self.temperature, 1.0),
            top_p=pick("top_p", self.top_p, 1.0),
            top_k=pick("top_k", self.top_k, 0),
            min_p=pick("min_p", self.min_p, 0.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty, 1.0),
            skip_special_tokens=skip_special,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=constraint,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids or None,  # [] limits nothing
            bad_words=list(self.bad_words or []),
        )
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as vLLM)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.n > 128:
            raise ValueError(f"n must be at most 128, got {self.n}")
        return SamplingParams(**kw)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one constraint the request gives, in whichever spelling; ValueError (-> 400)
        for two, or a malformed one."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format json_schema needs json_schema.schema")
                found.append(("response_format", {"json": schema}))
            elif kind != "text":
                raise ValueError(
                    f"response_format type must be text, json_object or json_schema, got {kind!r}"
                )
        if self.structured_outputs is not None:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        for name, field in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {field: value}))
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(
                "give one structured output constraint, got " + ", ".join(n for n, _ in found)
            )
        name, fields = found[0]
        # vLLM's client sends every field of its StructuredOutputsParams: null ones, the backend
        # (any value: this server has one), and flags at their defaults change nothing.
        fields = {
            k: v
            for k, v in fields.items()
            if v is not None
            and k not in _IGNORED_CONSTRAINT_FIELDS
            and not (k in _CONSTRAINT_FLAGS_OFF and v is False)
        }
        unknown = set(fields) - set(StructuredOutputsParams.__struct_fields__)
        if unknown:
            raise ValueError(f"{name}: unsupported field(s) {', '.join(sorted(unknown))}")
        params = StructuredOutputsParams(**fields)
        params.validate()
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)  # type: ignore[union-attr]


class CompletionRequest(_SamplingFields):
    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_UNSUPPORTED_FIELDS,
        "add_special_tokens": (True,),
    }

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the prompt (and its logprobs) back, nothing generated; how
        log-likelihood scorers (lm-eval) ask for a prompt's logprobs."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: Mapping[str, Any] = _NO_DEFAULTS) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo_only and self.min_tokens:
            raise ValueError("min_tokens must be 0 when max_tokens is 0")
        # NOTE: the engine samples at least one token; for echo_only the server drops it (vLLM too).
        max_tokens = self.max_tokens
        if self.max_tokens_unset:  # the model's default, else OpenAI's 16
            max_tokens = defaults.get("max_tokens", max_tokens)
        max_tokens = 1 if self.echo_only else max_tokens
        params = self._sampling(max_tokens, self.logprobs, defaults)
        if self.echo_logprobs:
            # The echoed prompt's tokens come with their logprobs too (log-likelihood scoring
            # reads them); the engine then computes the whole prompt.
            params.prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        return params

    @property
    def max_tokens_unset(self) -> bool:
        """The request left max_tokens to the server (a model default may then apply)."""
        return "max_tokens" not in self.model_fields_set

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt's tokens carry logprobs (in the OpenAI ``logprobs`` shape)."""
        return self.echo and self.logprobs is not None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(BaseModel):
    """A call an earlier assistant turn made (sent back with the tool's answer)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers
    # an assistant's thinking, as this server returns it (vLLM's and DeepSeek's names)
    reasoning: str | None = None
    reasoning_content: str | None = None

    def template_content(self) -> str | list[dict[str, str]]:
        """The content as the chat template takes it: a string or checked text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return text_parts([p.model_dump() for p in self.content])

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' conventions): "developer" is
        "system", and a call's arguments are an object, as templates print them with tojson
        (vLLM parses them the same way)."""
        # "developer" is the newer name of "system"; chat templates know only the latter.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.template_content()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thinking is not None:  # templates read either name (Qwen3: reasoning_content)
            message["reasoning"] = message["reasoning_content"] = thinking
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                 "arguments": _json_arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        return message


def _json_arguments(text: str) -> Any:
    """The arguments as an object; text that is not JSON (a call cut by max_tokens) stays a
    string, which templates test for (``arguments is string``)."""
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        return text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the arguments always follow the schema here


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _FunctionName


# OpenAI's limit of tools a request.
MAX_TOOLS = 128


class ChatTemplateFields(BaseModel):
    """What the chat template renders (chat completions and /tokenize share it)."""

    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    # Unset: true, unless the final message is continued (vLLM needs false set then).
    add_generation_prompt: bool | None = None
    # vLLM's: the answer goes on with the final message (an assistant's prefill) instead of
    # starting a new one.
    continue_final_message: bool = False
    # vLLM's: extra variables for the chat template (e.g. Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, refusing names the server sets itself."""
        return template_kwargs(self.chat_template_kwargs)

    @property
    def generation_prompt(self) -> bool:
        """Whether the template adds the header that starts the assistant's answer."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages or ()]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (OpenAI's objects, as transformers passes)."""
        if not self.tools:
            return None
        return [template_tool(t.model_dump(exclude_none=True)) for t in self.tools]

    def template_chars(self) -> int:
        """About how much text the chat template renders: a long render leaves the event loop.

        NOTE: every message costs template work, empty or not (300k empty ones: 2 s inline).
        """
        chars = 0
        for m in self.messages or ():
            chars += 32 + sum(len(c.function.arguments) for c in m.tool_calls or ())
            chars += sum(len(s or "") for s in (m.reasoning, m.reasoning_content, m.name))
            if isinstance(m.content, str):
                chars += len(m.content)
            elif m.content:
                chars += sum(len(p.text or "") for p in m.content)
        return chars + sum(len(t.model_dump_json()) for t in self.tools or ())


class ChatCompletionRequest(_SamplingFields, ChatTemplateFields):
    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_UNSUPPORTED_FIELDS,
        **_UNSUPPORTED_CHAT_FIELDS,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def max_tokens_unset(self) -> bool:
        """The request left max_tokens to the server (a model default may then apply)."""
        return self.max_tokens is None and self.max_completion_tokens is None

    def tool_use(
        self, auto_parser: str | None = None, special_tags: bool = False
    ) -> ToolUse | None:
        """What the tools ask for (None: no tools); ValueError (-> 400) for a choice that
        cannot be served. ``auto_parser``: the server's parser of the model's own calls (serve
        --tool-call-parser); without one, "auto" is refused, as vLLM refuses it.
        ``special_tags``: its tags are special tokens of the model."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise ValueError("tool_choice needs tools")
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools must have different names")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ValueError(f"tool_choice names {choice.function.name!r}, not in tools")
            return ToolUse("named", tools, name=choice.function.name)
        mode = choice or "auto"
        if mode == "auto" and auto_parser is None:
            raise ValueError(
                'tool_choice "auto" (the default with tools) needs a server started with '
                "--enable-auto-tool-choice --tool-call-parser; "
                'use "required", "none" or a named function'
            )
        return ToolUse(mode, tools, parallel=self.parallel_tool_calls, parser=auto_parser,
                       special_tags=special_tags)  # fmt: skip

    def sampling_params(
        self, defaults: Mapping[str, Any] = _NO_DEFAULTS, tools: ToolUse | None = None
    ) -> SamplingParams:
        """``tools``: this request's tool_use(), whose constraint applies to the output."""
        self.template_kwargs()  # refused names: a 400 before any work
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = (
                self.max_tokens if self.max_tokens is not None else defaults.get("max_tokens")
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, defaults, tools)


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a ``prompt``, or chat ``messages`` rendered by the template first."""

    # NOTE: "allow" keeps unknown fields in model_extra, where refused chat fields are found.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    # Unset: true for a prompt, false for messages (the template writes the specials), as vLLM.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        for name, value in (self.model_extra or {}).items():
            harmless = _UNSUPPORTED_CHAT_FIELDS.get(name)
            if harmless is not None and value not in harmless and value is not None:
                raise ValueError(f"{name} is not supported by this server")
        return self

    @property
    def special_tokens(self) -> bool:
        if self.add_special_tokens is None:
            return self.messages is None
        return self.add_special_tokens


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text (special tokens included)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


class _AnyObject(msgspec.Struct):
    """A JSON object, its fields skipped unread."""


class _BodyShape(msgspec.Struct):
    """The lists of a request body whose length alone can refuse it."""

    messages: list[_AnyObject] | None = None
    tools: list[_AnyObject] | None = None
    stop: str | list[msgspec.Raw] | None = None
    stop_token_ids: list[msgspec.Raw] | None = None
    allowed_token_ids: list[msgspec.Raw] | None = None
    bad_words: list[msgspec.Raw] | None = None
    logit_bias: dict[str, msgspec.Raw] | None = None
    truncate_prompt_tokens: msgspec.Raw | None = None


_BODY_SHAPE = msgspec.json.Decoder(_BodyShape)


def screen_counts(body: bytes) -> dict[str, int] | None:
    """The lengths of a request body's lists (``messages``, ``tools``, ``stop``, ``stop_token_ids``,
    ``allowed_token_ids``, ``bad_words``, ``logit_bias``), counted without validating it: 300k
    messages took 60 ms here where pydantic took 2 s, and 2.5M stop strings 15 s, all of it
    holding the event loop (and the GIL, so a thread would not help). None when the body has
    another shape: validation says what is wrong.
    """
    try:
        shape = _BODY_SHAPE.decode(body)
    except (msgspec.DecodeError, RecursionError):  # ValidationError included; deep nesting
        return None
    counts = {
        name: len(getattr(shape, name) or ())
        for name in (
            "messages", "tools", "stop_token_ids", "allowed_token_ids", "bad_words", "logit_bias"
        )
    }  # fmt: skip
    counts["stop"] = 1 if isinstance(shape.stop, str) else len(shape.stop or ())
    counts["truncating"] = int(shape.truncate_prompt_tokens not in (None, b"null"))
    return counts


# --------------------------------------------------------------------------- error responses


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The body of every error answer, as OpenAI's; documents the OpenAPI schema only (the
    server builds these bodies directly)."""

    error: ErrorInfo


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# The answers of the two generation routes, for the OpenAPI schema.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with `stream`, server-sent events ending in `[DONE]`",
        "content": {"text/event-stream": {}},
    },
    400: _error("Invalid parameters, a prompt longer than the context, or a body not JSON"),
    404: _error("The model is not served here"),
    413: _error("The request body is too large"),
    503: _error("The engine is not running"),
}

# The answers of /tokenize and /detokenize.
TOKENIZER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The token ids and their count, or the text"},
    400: _error("Invalid parameters, or token ids out of the vocabulary"),
    404: _error("The model is not served here"),
    413: _error("The request body is too large"),
}

HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine is running"},
    503: _error("The engine is not running"),
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
}


def without_validation_422(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI documents a 422 for every route with a body; this server answers 400 instead
    (OpenAI's status for an invalid request), so the schema drops the 422 and its models."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    models = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        models.pop(name, None)
    return schema
