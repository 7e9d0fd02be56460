"""Tool calls of the chat API (OpenAI's ``tools`` and ``tool_choice``), served as vLLM serves them.

- ``none``: the tools are shown to the chat template only; the answer is text.
- A named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained (structured outputs) to a JSON object of that function's parameters, and becomes
  one call of it.
- ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects,
  each naming one of the tools (one element only without ``parallel_tool_calls``); each element
  becomes a call.
- ``auto``: the model decides, in its own format, which a parser chosen at ``serve
  --tool-call-parser`` finds in the text: ``hermes`` reads ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, SmolLM3 and others).

A ``ToolCallReader`` turns one choice's text into the content and the calls to send, as the text
streams in (or whole: one call with ``finished``); text it cannot read as a call stays content,
so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from shm_engine.entrypoints.tags import partial_tag, tags_special
from shm_engine.sampling_params import StructuredOutputsParams

ToolChoiceMode = Literal["none", "auto", "required", "named"]
# The auto parsers, and the tags each reads (special tokens in some vocabularies).
PARSER_TAGS = {"hermes": ("<tool_call>", "</tool_call>"), "llama3_json": ("<|python_tag|>",)}
TOOL_CALL_PARSERS = tuple(PARSER_TAGS)


def parser_tags_special(tokenizer: Any, parser: str | None) -> bool:
    """Whether the parser's tags are special tokens of ``tokenizer``."""
    return parser is not None and tags_special(tokenizer, PARSER_TAGS[parser])


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """A piece of a tool call for the client: its first piece carries the id and the name,
    later ones more of the arguments (the JSON text, in order)."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
            function["name"] = self.name
        out["function"] = function
        return out


def whole_calls(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """The deltas of a whole answer joined into its calls (OpenAI's ``message.tool_calls``)."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if d.id is not None:
            calls.append({"id": d.id, "type": "function",
                          "function": {"name": d.name, "arguments": d.arguments}})  # fmt: skip
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    return calls


class ToolCallReader(Protocol):
    """Reads one choice's text, delta by delta."""

    calls: int  # tool calls started so far

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """The content to send and the call pieces read from ``delta`` (text may be held back
        until it is known not to start a call); ``finished`` flushes everything."""
        ...


@dataclass
class ToolUse:
    """What a chat request's tools ask of the server (``ChatCompletionRequest.tool_use``)."""

    mode: ToolChoiceMode
    tools: list[dict[str, Any]]  # OpenAI's tool objects: {"type": "function", "function": {...}}
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str | None = None  # the auto mode's
    special_tags: bool = False  # the parser's tags are special tokens (see parser_tags_special)

    def constraint(self) -> StructuredOutputsParams | None:
        """The output's constraint: the named function's parameters, or the array of calls."""
        if self.mode == "named":
            (function,) = (f for f in self._functions() if f["name"] == self.name)
            return StructuredOutputsParams(json=_parameters(function))
        if self.mode == "required":
            return StructuredOutputsParams(json=self._array_schema())
        return None

    def reader(self) -> ToolCallReader | None:
        """A new reader for one choice's text; None when the text is plain content."""
        if self.mode == "named":
            assert self.name is not None
            return NamedCallReader(self.name)
        if self.mode == "required":
            return CallArrayReader()
        if self.mode == "auto":
            reader = Llama3JsonReader() if self.parser == "llama3_json" else HermesReader()
            return reader if self.parallel else FirstCallOnly(reader)
        return None

    @property
    def keeps_special_tokens(self) -> bool:
        """The auto parser's tags are special tokens of the model: the text must keep them."""
        return self.mode == "auto" and self.special_tags

    def _functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]

    def _array_schema(self) -> dict[str, Any]:
        # NOTE: each tool's schema moves whole under the root's $defs, its local references
        # rewritten to point there: nested as the parameters, a "#" (recursion), "#/$defs/.."
        # or "#/definitions/.." would resolve against the array schema instead.
        defs: dict[str, Any] = {}
        variants = []
        for i, function in enumerate(self._functions()):
            key = f"tool_{i}"
            params = _rebased(_parameters(function), f"#/$defs/{key}")
            defs[key] = {k: v for k, v in params.items() if k not in ("$id", "$schema")}
            variants.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [function["name"]]},
                        "parameters": {"$ref": f"#/$defs/{key}"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not self.parallel:
            schema["maxItems"] = 1
        schema["$defs"] = defs
        return schema


def _rebased(node: Any, root: str) -> Any:
    """A copy of a schema whose local references ("#...") point under ``root`` instead."""
    if isinstance(node, dict):
        return {
            k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else _rebased(v, root)
            for k, v in node.items()
        }  # fmt: skip
    if isinstance(node, list):
        return [_rebased(v, root) for v in node]
    return node


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema. None means it takes no arguments: an empty object, with
    no room for made-up ones (a small model had filled an open object to the length limit)."""
    return function.get("parameters") or dict(_NO_PARAMETERS)


def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as chat templates read it: with the parameters it takes even when none were
    given (templates print ``function.parameters | tojson``)."""
    function = tool["function"]
    return {**tool, "function": {**function, "parameters": _parameters(function)}}


_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _arguments_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class NamedCallReader:
    """The whole output is the arguments of one call to the named function, streamed as is."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        if self.calls == 0:
            self.calls = 1
            return "", [ToolCallDelta(0, delta, self.name, _call_id())]
        return "", [ToolCallDelta(0, delta)] if delta else []


class _ObjectScanner:
    """Splits JSON text fed piece by piece into the objects that open at nesting ``level``
    and the text around them (strings and their escapes skipped: braces in them are text)."""

    def __init__(self, level: int) -> None:
        self.level = level
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._start = -1  # where the object being read starts
        self._outside = 0  # where the text around objects not yet returned starts

    def feed(self, delta: str) -> list[tuple[bool, str]]:
        """(is an object, text) pieces completed by ``delta``, in order."""
        self._text += delta
        out: list[tuple[bool, str]] = []
        for i in range(self._scanned, len(self._text)):
            ch = self._text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                if self._depth == self.level and ch == "{":
                    out.append((False, self._text[self._outside : i]))
                    self._start = i
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == self.level and self._start >= 0:
                    out.append((True, self._text[self._start : i + 1]))
                    self._start, self._outside = -1, i + 1
        self._scanned = len(self._text)
        return out

    def rest(self) -> str:
        """The text after the last complete object: an incomplete one, or what surrounds."""
        return self._text[self._start if self._start >= 0 else self._outside :]


class CallArrayReader:
    """A JSON array of ``{"name", "parameters"}`` objects (the ``required`` constraint's
    output): each element becomes a call once it is complete. The constraint holds the text to
    the array's grammar; an element a length limit cut short is sent as content."""

    def __init__(self) -> None:
        self.calls = 0
        self._scanner = _ObjectScanner(level=1)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        out = [self._element(text) for is_object, text in self._scanner.feed(delta) if is_object]
        if not finished:
            return "", out
        rest = self._scanner.rest()  # a cut element, as written, or the array's closing
        return rest if rest.startswith("{") else rest.strip(" \t\r\n,]"), out

    def _element(self, text: str) -> ToolCallDelta:
        element = json.loads(text)
        index, self.calls = self.calls, self.calls + 1
        return ToolCallDelta(
            index, _arguments_text(element["parameters"]), element["name"], _call_id()
        )


def _call_from_json(text: str, index: int) -> ToolCallDelta | None:
    """A ``{"name": ..., "arguments" (or "parameters"): {...}}`` object as a call, or None."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    # some models write the arguments' JSON as a string: kept, if it is JSON
    if not isinstance(arguments, str) or not _is_json(arguments):
        arguments = _arguments_text(arguments)
    return ToolCallDelta(index, arguments, call["name"], _call_id())


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonReader:
    """Llama 3.1-3.3's JSON calls: an answer that starts with ``{`` (or ``<|python_tag|>``)
    is ``{"name": ..., "parameters": {...}}`` objects, separated by ``;``; any other answer is
    content. Each object is sent as a call once complete; one that is not a call, and text
    around the objects, stays content.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._mode: Literal["undecided", "content", "calls"] = "undecided"
        self._head = ""  # the answer's start, until it decides the mode
        self._scanner = _ObjectScanner(level=0)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        if self._mode == "undecided":
            self._head += delta
            head = self._head.lstrip()
            if head.startswith(_PYTHON_TAG) or head.startswith("{"):
                self._mode, delta = "calls", head.removeprefix(_PYTHON_TAG)
            elif finished or (head and not _PYTHON_TAG.startswith(head)):
                self._mode, delta = "content", self._head
            else:
                return "", []
        if self._mode == "content":
            return delta, []
        content: list[str] = []
        out: list[ToolCallDelta] = []
        pieces = self._scanner.feed(delta)
        if finished:
            pieces.append((False, self._scanner.rest()))
        for is_object, text in pieces:
            call = _call_from_json(text, self.calls) if is_object else None
            if call is not None:
                self.calls += 1
                out.append(call)
            elif text.strip(" \t\r\n;"):
                content.append(text)
        return "".join(content), out


_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"


class HermesReader:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among the text.

    Content streams until a block starts (a tail that could begin ``<tool_call>`` waits for
    the next delta); a block is sent as one call once it closes, or at the end of the output
    (a model may stop before the closing tag). A block that is not such JSON stays content, as
    written. Whitespace before a call and at the end of an answer with calls is dropped.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._pending = ""
        self._in_call = False
        self._gap = ""  # trailing whitespace, sent only once more text follows

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        self._pending += delta
        content: list[str] = []
        out: list[ToolCallDelta] = []
        while True:
            if self._in_call:
                end = self._pending.find(_HERMES_END)
                if end < 0 and not finished:
                    break
                body = self._pending if end < 0 else self._pending[:end]
                self._pending = "" if end < 0 else self._pending[end + len(_HERMES_END) :]
                self._in_call = False
                call = self._call(body)
                if call is None:
                    closing = _HERMES_END if end >= 0 else ""
                    content.append(self._text(_HERMES_START + body + closing))
                else:
                    out.append(call)
                    self._gap = ""  # whitespace before a call is dropped
                continue
            start = self._pending.find(_HERMES_START)
            if start >= 0:
                content.append(self._text(self._pending[:start]))
                self._pending = self._pending[start + len(_HERMES_START) :]
                self._in_call = True
                continue
            keep = 0 if finished else partial_tag(self._pending, _HERMES_START)
            content.append(self._text(self._pending[: len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep :]
            break
        if finished and not self.calls:  # plain text keeps its trailing whitespace
            content.append(self._gap)
            self._gap = ""
        return "".join(content), out

    def _text(self, text: str) -> str:
        """Content to send: trailing whitespace waits until text follows it (so a stream sends
        what a whole answer has, whichever way the deltas split it)."""
        text = self._gap + text
        kept = text.rstrip()
        self._gap = text[len(kept) :]
        return kept

    def _call(self, body: str) -> ToolCallDelta | None:
        call = _call_from_json(body, self.calls)
        self.calls += call is not None
        return call


class FirstCallOnly:
    """``parallel_tool_calls: false`` in auto mode: calls after the first are dropped (vLLM)."""

    def __init__(self, reader: ToolCallReader) -> None:
        self.reader = reader

    @property
    def calls(self) -> int:
        return min(self.reader.calls, 1)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.reader.feed(delta, finished)
        return content, [d for d in deltas if d.index == 0]


def finish_reason(use: ToolUse | None, reader: ToolCallReader | None, reason: str) -> str:
    """``tool_calls`` where the model ended its answer with calls it chose to make (auto,
    required), as OpenAI and vLLM report it; a named call keeps ``stop``."""
    if use is None or reader is None or use.mode == "named" or not reader.calls:
        return reason
    return "tool_calls" if reason == "stop" else reason
