"""``shm-engine`` generate/chat/serve: ordinary mistakes get one line and an exit status, never a
traceback; one bad prompt does not end the others; Ctrl-C in chat stops cleanly."""

from __future__ import annotations

import builtins
from collections.abc import Iterator

import pytest

from shm_engine.entrypoints import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "hi", "--temperature", "-1"], "temperature must be in"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens must be at least 1"),
        (["generate", "hi", "--kv-cache-mib", "0"], "kv_cache_bytes must be positive"),
        (["generate", "hi", "--model", "/nonexistent"], "does not exist"),
        (["chat", "--top-p", "2"], "top_p must be in"),
        (["serve", "--max-num-seqs", "0"], "max_num_seqs must be at least 1"),
        (["generate", "hi", "--threads", "-1"], "num_threads must be 0"),
        # found before the engine starts (they had been a lifespan traceback and exit 3)
        (["serve", "--model", "/nonexistent"], "does not exist"),
        (["serve", "--max-model-len", "100000"], "exceeds the model's context length (8192"),
        (["serve", "-dp", "64"], "64 replicas need at least 64 cores"),
        (["serve", "--prompt-lookup-min", "5"], "prompt_lookup_min and prompt_lookup_max"),
        (
            ["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
            "only method 'ngram'",
        ),
    ],
)
def test_bad_values_get_one_line_and_status_2(argv, message, capsys) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shm-engine {argv[0]}: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "70000"],
        ["serve", "-dp", "0"],
        ["generate", "hi", "--max-tokens", "abc"],
        ["generate", "hi", "--dtype", "bf16"],
        ["chat", "--kv-cache-dtype", "fp8"],
        ["generate", "hi", "--activation-dtype", "fp8"],
        ["serve", "--num-speculative-tokens", "17"],
        ["serve", "--speculative-config", "{not json"],
        ["serve", "--speculative-config", "[1]"],
        ["bench", "nothing"],
    ],
)
def test_argument_errors_are_one_line_too(argv, capsys) -> None:
    """What argparse refuses reads as the commands' own checks: one line, not its usage block."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"shm-engine {argv[0]}: error: " if argv[0] != "bench" else "shm-engine")


def test_generate_without_prompts_says_so_in_one_line(capsys) -> None:
    assert cli.main(["generate"]) == 2
    assert capsys.readouterr().err == (
        "shm-engine generate: error: give prompts as arguments or with --file\n"
    )


def _inputs(monkeypatch, lines: list[str | type[BaseException]]) -> None:
    feed: Iterator = iter(lines)

    def fake_input(prompt: str = "") -> str:
        item = next(feed, EOFError)
        if isinstance(item, type):
            raise item
        return item

    monkeypatch.setattr(builtins, "input", fake_input)


def _record_turns(monkeypatch) -> list[list[tuple[str, str]]]:
    """The (role, content) of the messages of every chat turn, as _chat_turn receives them."""
    seen: list[list[tuple[str, str]]] = []
    turn = cli._chat_turn

    def recording_turn(llm, messages, params):
        seen.append([(m["role"], m["content"]) for m in messages])
        return turn(llm, messages, params)

    monkeypatch.setattr(cli, "_chat_turn", recording_turn)
    return seen


@pytest.mark.slow
def test_generate_reports_a_prompt_that_cannot_fit_and_runs_the_others(capsys) -> None:
    too_long = "hello " * 9000  # past the 8192-token context
    argv = ["generate", too_long, "The capital of France is", "1, 2, 3,", "--max-tokens", "4"]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "shm-engine generate: error: prompt 1: " in err and "context length" in err
    assert out.startswith("The capital of France is") and "Traceback" not in err
    # each completion ends its line on stdout, so a redirected run keeps them apart
    assert "\n1, 2, 3," in out and out.endswith("\n")


@pytest.mark.slow
def test_chat_starts_over_when_the_conversation_outgrows_the_context(monkeypatch, capsys) -> None:
    # 2 MiB of fp16 cache: 5 blocks, an 80-token context. The long message fits alone, not
    # after the first turn; an empty line is skipped; Ctrl-C at the prompt leaves with 130.
    long_message = "Please tell me about " + "the sea and " * 12 + "the sky."
    _inputs(monkeypatch, ["hi", "", long_message, KeyboardInterrupt])
    rc = cli.main(["chat", "--kv-cache-mib", "2", "--max-tokens", "6"])
    out, err = capsys.readouterr()
    assert rc == 130 and "Traceback" not in err
    assert "no longer fits the context: starting over" in err
    assert out.count("\n") >= 3  # two replies and the line after Ctrl-C


@pytest.mark.slow
def test_chat_keeps_the_conversation_when_a_message_cannot_fit_even_alone(
    monkeypatch, capsys
) -> None:
    # The refused message never joined the conversation: the earlier turns stay.
    turns = _record_turns(monkeypatch)
    _inputs(monkeypatch, ["My name is Zorblax.", "word " * 200, "What is my name?"])
    assert cli.main(["chat", "--kv-cache-mib", "2", "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "starting over" not in err and "Traceback" not in err
    assert "this message takes" in err and "context length is 80" in err
    seen = [[content for _, content in turn] for turn in turns]
    assert seen[-1][0] == "My name is Zorblax." and seen[-1][-1] == "What is my name?"


@pytest.mark.slow
def test_chat_commands_and_system_prompt(monkeypatch, capsys) -> None:
    # /help and /reset answer on stderr and reach no model; /reset keeps the system prompt and
    # forgets the rest; /quit leaves with 0 before the lines after it are read.
    seen = _record_turns(monkeypatch)
    _inputs(monkeypatch, ["/help", "My name is Zorblax.", " /reset ", "Hi.", "/quit", "Never."])
    argv = ["chat", "--kv-cache-mib", "8", "--max-tokens", "3", "--system-prompt", "Be brief."]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "/reset starts a new conversation" in err and "[new conversation]" in err
    assert "Traceback" not in err
    system = ("system", "Be brief.")
    assert seen == [[system, ("user", "My name is Zorblax.")], [system, ("user", "Hi.")]]


@pytest.mark.slow
def test_chat_keeps_the_system_prompt_when_it_starts_over(monkeypatch, capsys) -> None:
    # the 80-token context of test_chat_starts_over_...: the long message fits with the system
    # prompt alone, not after the first turn
    turns = _record_turns(monkeypatch)
    long_message = "Please tell me about " + "the sea and " * 14 + "the sky."
    _inputs(monkeypatch, ["hi", long_message])
    argv = ["chat", "--kv-cache-mib", "2", "--max-tokens", "6", "--system-prompt", "Be brief."]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "starting over" in err and "Traceback" not in err
    assert [role for role, _ in turns[-1]] == ["system", "user"]


def test_chat_reports_a_template_that_refuses_a_system_prompt() -> None:
    import jinja2

    class Template:
        def apply_chat_template(self, messages, **kw):
            raise jinja2.TemplateError("System role not supported")

    class Model:
        def get_tokenizer(self):
            return Template()

    with pytest.raises(ValueError, match="--system-prompt: .* System role not supported"):
        cli._check_system_prompt(Model(), [{"role": "system", "content": "Be brief."}])


@pytest.mark.slow
def test_serve_reports_an_engine_that_cannot_start_in_one_line() -> None:
    """A configuration only the engine can check (the KV cache cannot hold max_model_len) ends
    serve with its one line and exit 2, not uvicorn's lifespan tracebacks and exit 3."""
    import subprocess
    import sys

    argv = ["serve", "--port", "0", "--max-model-len", "2048", "--kv-cache-mib", "16"]
    done = subprocess.run(
        [sys.executable, "-m", "shm_engine.entrypoints.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shm-engine serve: error: engine failed to start: ValueError: ")
    assert "does not fit in the KV cache" in last


def test_serve_passes_the_speculative_settings_to_the_engine() -> None:
    args = cli.build_parser().parse_args(
        ["serve", "--num-speculative-tokens", "3", "--prompt-lookup-min", "1",
         "--prompt-lookup-max", "5"]
    )  # fmt: skip
    config = cli.serve_config(args)
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        3, 1, 5,
    )  # fmt: skip
    assert cli.serve_config(cli.build_parser().parse_args(["serve"])).num_speculative_tokens == 0
    vllm_style = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    args = cli.build_parser().parse_args(["serve", "--speculative-config", vllm_style])
    config = cli.serve_config(args)
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        4, 2, 3,
    )  # fmt: skip


def test_serve_chat_flags_are_checked_before_the_engine_starts(tmp_path) -> None:
    parser = cli.build_parser()

    def options(*argv: str):
        return cli.chat_options(parser.parse_args(["serve", *argv]))

    assert options() == cli_chat_options()
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    auto = options("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                   "--chat-template", str(template))  # fmt: skip
    assert auto == cli_chat_options("{{ messages[0].content }}", "hermes")
    # a parser alone reads nothing: "auto" stays refused, as in vLLM
    assert options("--tool-call-parser", "hermes").tool_call_parser is None
    assert options("--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        options("--enable-auto-tool-choice")
    with pytest.raises(ValueError, match="does not compile"):
        options("--chat-template", "{% for m in messages %}")
    with pytest.raises(SystemExit):  # argparse's one-line error: a path of no file
        parser.parse_args(["serve", "--chat-template", str(tmp_path / "missing.jinja")])


def cli_chat_options(template: str | None = None, parser: str | None = None):
    from shm_engine.entrypoints.openai_server import ChatOptions

    return ChatOptions(chat_template=template, tool_call_parser=parser)


def test_structured_output_flags_become_the_requests_constraint(tmp_path) -> None:
    from shm_engine.sampling_params import StructuredOutputsParams as S

    parser = cli.build_parser()
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    cases = [
        (["--json-schema", str(schema)], S(json='{"type": "object"}')),
        (["--json-schema", '{"type": "integer"}'], S(json='{"type": "integer"}')),
        (["--regex", "[0-9]+"], S(regex="[0-9]+")),
        (["--choice", "yes", "--choice", "no"], S(choice=["yes", "no"])),
        (["--grammar", 'root ::= "a"'], S(grammar='root ::= "a"')),
        ([], None),
    ]
    for flags, want in cases:
        args = parser.parse_args(["generate", "hi", *flags])
        assert cli._params(args).structured_outputs == want, flags


def test_two_structured_output_flags_are_one_line_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--regex", "a", "--choice", "b"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "not allowed with" in err


@pytest.mark.slow
def test_generate_with_a_choice_writes_one_of_them(capsys) -> None:
    argv = ["generate", "Is the sky blue? Answer:", "--choice", " yes", "--choice", " no"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n").endswith((" yes", " no"))
