"""Tool calls: the readers that turn a choice's text into calls (streamed in any pieces), the
constraints a tool_choice puts on the output, and how a chat request's tools are checked."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shm_engine.entrypoints.openai_protocol import ChatCompletionRequest
from shm_engine.entrypoints.tool_calls import (
    CallArrayReader,
    HermesReader,
    Llama3JsonReader,
    NamedCallReader,
    ToolCallReader,
    ToolUse,
    finish_reason,
    whole_calls,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
USER = [{"role": "user", "content": "Weather in Paris?"}]


def read(reader: ToolCallReader, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed the pieces (the last one finishing) and join what comes out, as a client would."""
    content, deltas = [], []
    for i, piece in enumerate(pieces):
        text, calls = reader.feed(piece, finished=i == len(pieces) - 1)
        content.append(text)
        deltas += calls
    return "".join(content), whole_calls(deltas)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)] or [""]


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---------------------------------------------------------------------------- readers


def test_a_named_call_streams_its_arguments_as_written() -> None:
    reader = NamedCallReader("get_weather")
    first = reader.feed('{"city": ', finished=False)
    assert first[0] == "" and first[1][0].to_openai() == {
        "index": 0,
        "id": first[1][0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": '},
    }
    assert first[1][0].id.startswith("chatcmpl-tool-")
    assert reader.feed("", finished=False) == ("", [])
    rest = reader.feed('"Paris"}', finished=True)[1][0].to_openai()
    assert rest == {"index": 0, "function": {"arguments": '"Paris"}'}}


ARRAY = (
    '[{"name": "get_weather", "parameters": {"city": "Pa}ri\\"s{", "unit": "C"}},\n'
    ' {"name": "get_time", "parameters": {}}]'
)


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_an_array_of_calls_reads_the_same_in_any_pieces(cuts: list[int]) -> None:
    content, calls = read(CallArrayReader(), split(ARRAY, cuts))
    assert content == ""
    assert calls_of(calls) == [
        ("get_weather", {"city": 'Pa}ri"s{', "unit": "C"}),
        ("get_time", {}),
    ]
    assert len({c["id"] for c in calls}) == 2


def test_an_array_cut_short_keeps_its_complete_calls_and_the_rest_as_content() -> None:
    cut = ARRAY[: ARRAY.index("get_time") + 12]
    content, calls = read(CallArrayReader(), [cut])
    assert calls_of(calls) == [("get_weather", {"city": 'Pa}ri"s{', "unit": "C"})]
    assert content == cut[cut.rindex("{") :] == '{"name": "get_time", "'
    inside = ARRAY[: ARRAY.index('"unit"')]  # ends with ", " within the first element
    assert read(CallArrayReader(), [inside]) == (inside[1:], [])


HERMES = (
    "Let me look that up. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
)


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_hermes_calls_read_the_same_in_any_pieces(cuts: list[int]) -> None:
    content, calls = read(HermesReader(), split(HERMES, cuts))
    assert content == "Let me look that up."  # whitespace before a call is dropped
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("No tools needed: 3 < 4 <toolbox>", "No tools needed: 3 < 4 <toolbox>", []),
        ("ends with <tool_", "ends with <tool_", []),
        # not a call: kept as written
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
        # the model stopped before the closing tag
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1})]),
        # arguments written as a string that is not JSON: made a JSON string
        ('<tool_call>{"name": "f", "arguments": "hi"}</tool_call>', "", [("f", "hi")]),
        # arguments written as a JSON string
        (
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
            "",
            [("f", {"a": 1})],
        ),
    ],
)
def test_hermes_text_that_is_not_a_call_stays_content(text: str, content: str, calls) -> None:
    for pieces in ([text], list(text)):
        got_content, got_calls = read(HermesReader(), pieces)
        assert got_content == content and calls_of(got_calls) == calls


LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa;ris}"}}; '
    '{"name": "get_time", "parameters": {}}'
)


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_llama3_json_calls_read_the_same_in_any_pieces(cuts: list[int]) -> None:
    content, calls = read(Llama3JsonReader(), split(" " + LLAMA3, cuts))
    assert content == ""
    assert calls_of(calls) == [("get_weather", {"city": "Pa;ris}"}), ("get_time", {})]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("The weather is {fine}.", "The weather is {fine}.", []),
        ("<|python", "<|python", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, not a call
        ('{"name": "f", "arguments": {"a": 1}} and then', " and then", [("f", {"a": 1})]),
        ('{"name": "f", "parameters": {"a": [1,', '{"name": "f", "parameters": {"a": [1,', []),
    ],
)
def test_llama3_json_text_that_is_not_a_call_stays_content(text: str, content: str, calls) -> None:
    for pieces in ([text], list(text)):
        got_content, got_calls = read(Llama3JsonReader(), pieces)
        assert got_content == content and calls_of(got_calls) == calls


def test_the_auto_reader_is_the_servers_parser() -> None:
    assert isinstance(ToolUse("auto", [WEATHER], parser="hermes").reader(), HermesReader)
    assert isinstance(ToolUse("auto", [WEATHER], parser="llama3_json").reader(), Llama3JsonReader)
    assert ToolUse("none", [WEATHER]).reader() is None


CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    "text, content",
    [
        (f"Sure. {CALL}\n\n{CALL}\nDone.\n", "Sure.\nDone."),
        (f"\n\n{CALL}\n", ""),
        ("plain text \n", "plain text \n"),
    ],
)
@given(cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_hermes_whitespace_is_the_same_streamed_or_whole(text: str, content: str, cuts) -> None:
    """Whitespace before a call and after the last one is dropped; a stream sends what the
    whole answer has however it is split."""
    assert read(HermesReader(), split(text, cuts))[0] == content


def test_without_parallel_calls_auto_keeps_the_first() -> None:
    reader = ToolUse("auto", [WEATHER], parallel=False, parser="hermes").reader()
    assert reader is not None
    content, calls = read(reader, [CALL + CALL, CALL])
    assert len(calls) == 1 and reader.calls == 1 and content == ""


def test_special_tokens_are_kept_only_where_the_parsers_tags_are_special() -> None:
    from tokenizers import AddedToken, models
    from tokenizers import Tokenizer as HFTokenizer

    from shm_engine.entrypoints.tool_calls import parser_tags_special
    from shm_engine.model.tokenizer import Tokenizer

    def tokenizer(special: bool) -> Tokenizer:
        backend = HFTokenizer(models.BPE({"a": 0}, []))
        backend.add_tokens([AddedToken("<tool_call>", special=special)])
        return Tokenizer(backend, eos_token_ids=[0])

    assert parser_tags_special(tokenizer(True), "hermes")
    assert not parser_tags_special(tokenizer(False), "hermes")
    assert not parser_tags_special(tokenizer(True), "llama3_json")
    assert not parser_tags_special(tokenizer(True), None)
    auto = chat(tools=[WEATHER])
    kept = auto.sampling_params(tools=auto.tool_use("hermes", special_tags=True))
    skipped = auto.sampling_params(tools=auto.tool_use("hermes", special_tags=False))
    assert kept.skip_special_tokens is False and skipped.skip_special_tokens is True


def test_only_chosen_calls_that_ended_the_answer_finish_as_tool_calls() -> None:
    tools = [WEATHER]
    named, auto = ToolUse("named", tools, name="get_weather"), ToolUse("auto", tools)
    called = HermesReader()
    called.feed('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', True)
    assert finish_reason(auto, called, "stop") == "tool_calls"
    assert finish_reason(auto, called, "length") == "length"
    assert finish_reason(auto, HermesReader(), "stop") == "stop"
    assert finish_reason(named, NamedCallReader("get_weather"), "stop") == "stop"
    assert finish_reason(None, None, "stop") == "stop"


# ---------------------------------------------------------------------------- constraints


def test_a_named_choice_constrains_to_its_parameters_and_required_to_an_array() -> None:
    named = ToolUse("named", [WEATHER, TIME], name="get_weather").constraint()
    assert named is not None and named.json == WEATHER["function"]["parameters"]
    no_params = ToolUse("named", [WEATHER, TIME], name="get_time").constraint()
    assert no_params is not None and no_params.json == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    schema = ToolUse("required", [WEATHER, TIME]).constraint().json  # type: ignore[union-attr]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    single = ToolUse("required", [WEATHER], parallel=False).constraint().json  # type: ignore[union-attr]
    assert single["maxItems"] == 1
    assert ToolUse("auto", [WEATHER]).constraint() is None
    assert ToolUse("none", [WEATHER]).constraint() is None


def test_required_nests_each_tools_schema_with_its_references_rebased() -> None:
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "me": {"$ref": "#"}},
              "$defs": {"P": {"type": "integer"}}, "$schema": "x"}  # fmt: skip
    tool = {"type": "function", "function": {"name": "a", "parameters": params}}
    schema = ToolUse("required", [tool]).constraint().json  # type: ignore[union-attr]
    (variant,) = schema["items"]["anyOf"]
    assert variant["properties"]["parameters"] == {"$ref": "#/$defs/tool_0"}
    nested = schema["$defs"]["tool_0"]
    assert nested["properties"] == {
        "p": {"$ref": "#/$defs/tool_0/$defs/P"},
        "me": {"$ref": "#/$defs/tool_0"},
    }
    assert "$schema" not in nested and params["properties"]["me"] == {"$ref": "#"}  # a copy


# ---------------------------------------------------------------------------- requests


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=USER, **fields)


@pytest.mark.parametrize(
    "fields, parser, message",
    [
        ({"tool_choice": "required"}, None, "tool_choice needs tools"),
        ({"tools": [WEATHER]}, None, "--enable-auto-tool-choice"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, None, "--enable-auto-tool-choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "hermes",
            "'x', not in tools",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, None, "different names"),
    ],
)
def test_tool_choices_that_cannot_be_served_are_refused(fields, parser, message) -> None:
    with pytest.raises(ValueError, match=message):
        chat(**fields).tool_use(parser)


def test_a_constraining_tool_choice_excludes_response_format() -> None:
    req = chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ValueError, match="excludes response_format"):
        req.sampling_params(tools=req.tool_use())


def test_tool_use_sets_the_constraint_and_what_the_parser_must_see() -> None:
    req = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    use = req.tool_use()
    assert use is not None and use.mode == "required" and not use.parallel
    params = req.sampling_params(tools=use)
    assert params.structured_outputs is not None
    assert params.structured_outputs.json["maxItems"] == 1  # type: ignore[index]
    auto = chat(tools=[WEATHER])
    params = auto.sampling_params(tools=auto.tool_use("hermes"))
    assert params.structured_outputs is None and params.skip_special_tokens is True
    assert chat(tools=[WEATHER], tool_choice="none").tool_use() is not None
    assert chat().tool_use() is None and chat(tool_choice="none").tool_use() is None


def test_messages_with_calls_reach_the_template_as_transformers_passes_them() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    req = ChatCompletionRequest(
        messages=[
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        ],
        tools=[WEATHER],
    )
    conv = req.conversation()
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert conv[1]["content"] == "" and conv[2]["tool_call_id"] == "c1"
    assert req.template_tools() == [WEATHER]
    # arguments that are not JSON (a call cut by max_tokens) reach the template as a string
    cut = {**call, "function": {"name": "f", "arguments": '{"city": "Pa'}}
    req = ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [cut]}])
    assert req.conversation()[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'
    # a tool without parameters is shown with the empty object it takes
    (shown,) = chat(tools=[TIME]).template_tools()  # type: ignore[misc]
    assert shown["function"]["parameters"]["properties"] == {}


def test_continuing_the_final_message_drops_the_generation_prompt_unless_asked() -> None:
    assert chat().generation_prompt is True
    assert chat(continue_final_message=True).generation_prompt is False
    assert chat(continue_final_message=True, add_generation_prompt=True).generation_prompt
