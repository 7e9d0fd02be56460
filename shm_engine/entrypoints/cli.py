"""``shm-engine`` command line: generate, chat, serve (OpenAI-compatible HTTP), bench."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from pathlib import Path

from shm_engine.entrypoints.cli_parser import OneLineParser, fail, int_in
from shm_engine.entrypoints.reasoning import REASONING_PARSERS
from shm_engine.entrypoints.tool_calls import TOOL_CALL_PARSERS


def _engine_args(p: argparse.ArgumentParser) -> None:
    from shm_engine.engine.config import MAX_SPECULATIVE_TOKENS

    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    p.add_argument("--dtype", default="int8", choices=["int8", "float32"])
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache budget in MiB")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp16", "int8"],
        help="KV cache elements (auto: fp16 for int8 weights; int8 holds 1.88x the tokens)",
    )
    p.add_argument(
        "--activation-dtype",
        default="auto",
        choices=["auto", "int16", "int8"],
        help="the layers' activations (auto: 8-bit on 4-bit layers, as llama.cpp; int16: exact "
        "on 4-bit layers; int8: also on int8 layers, on kernel path vnni)",
    )
    p.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", "int8", "int4"],
        help="the layers' weights (auto: int4 for a GGUF's Q4_0/Q4_1/Q4_K matrices, on their "
        "own grids, but on AMX CPUs; int4 streams ~0.6 of int8's bytes a step)",
    )
    p.add_argument("--threads", type=int, default=0, help="kernel threads (0: all cores)")
    p.add_argument(
        "--num-speculative-tokens",
        type=int_in(0, MAX_SPECULATIVE_TOKENS),
        default=0,
        help="draft tokens a decode step guesses by n-gram lookup in its own context and "
        "checks in the same forward (0: off; pays where outputs copy their input)",
    )
    p.add_argument(
        "--prompt-lookup-min", type=int_in(1), default=2, help="shortest n-gram matched for drafts"
    )
    p.add_argument(
        "--prompt-lookup-max", type=int_in(1), default=4, help="longest n-gram matched for drafts"
    )
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='vLLM\'s spelling of the three above, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 2}\' (overrides them)',
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    # structured outputs, as llama.cpp's CLI takes them (one at a time)
    so = p.add_mutually_exclusive_group()
    so.add_argument(
        "--json-schema", type=_text_or_file, help="the output follows this JSON schema (or file)"
    )
    so.add_argument("--regex", help="the output matches this regex")
    so.add_argument(
        "--choice", action="append", help="the output is one of these (repeat the flag)"
    )
    so.add_argument(
        "--grammar",
        type=_text_or_file,
        help="the output follows this Lark or GBNF grammar (or file)",
    )


def _text_or_file(value: str) -> str:
    """The value, or the text of the file it names."""
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else value
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{value}: {e}") from None


def _template_or_file(value: str) -> str:
    """A chat template inline, or the file it names; a value that looks like a path of no
    file is refused (it would have become the template, every prompt that literal text)."""
    text = _text_or_file(value)
    if text is value and not any(c in value for c in "{}\n"):
        raise argparse.ArgumentTypeError(f"{value}: no such file, and not a Jinja template")
    return text


def _build_llm(args):
    from shm_engine import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mib << 20,
        kv_cache_dtype=args.kv_cache_dtype,
        activation_dtype=args.activation_dtype,
        weight_dtype=args.weight_dtype,
        num_threads=args.threads,
        **_speculative(args),
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _speculative(args) -> dict:
    from shm_engine.engine.config import speculative_args

    spec = dict(
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
    )
    spec.update(speculative_args(args.speculative_config))
    return spec


def _params(args):
    from shm_engine import SamplingParams, StructuredOutputsParams

    constraint = None
    if args.json_schema is not None:
        constraint = StructuredOutputsParams(json=args.json_schema)
    elif args.regex is not None:
        constraint = StructuredOutputsParams(regex=args.regex)
    elif args.choice:
        constraint = StructuredOutputsParams(choice=list(args.choice))
    elif args.grammar is not None:
        constraint = StructuredOutputsParams(grammar=args.grammar)
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        structured_outputs=constraint,
    )


def cmd_generate(args) -> int:
    prompts = list(args.prompts)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:  # one line, not a traceback
            reason = e.strerror if isinstance(e, OSError) else e
            return fail("shm-engine generate", f"--file {args.file}: {reason}")
    if not prompts:
        return fail("shm-engine generate", "give prompts as arguments or with --file")
    params = _params(args)
    failed = 0
    with _build_llm(args) as llm:
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            stream = llm.stream(prompt, params)
            try:
                first = next(stream, "")  # a prompt that cannot run fails here, before printing
            except ValueError as e:  # this prompt only: the others still run
                print(f"shm-engine generate: error: prompt {i + 1}: {e}", file=sys.stderr)
                failed += 1
                continue
            print(prompt + first, end="", flush=True)
            n = 1 if first else 0
            for delta in stream:
                print(delta, end="", flush=True)
                n += 1
            dt = time.perf_counter() - t0
            print(flush=True)  # ends the completion on stdout too (redirected, they ran together)
            print(f"[{n} chunks in {dt:.2f} s]", file=sys.stderr)
    return 1 if failed else 0


CHAT_HELP = "/reset starts a new conversation, /exit or /quit leaves (as Ctrl-D does)"


def cmd_chat(args) -> int:
    params = _params(args)
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages: list[dict[str, str]] = list(system)
    with _build_llm(args) as llm:
        if system:
            _check_system_prompt(llm, system)
        while True:
            try:
                line = _read_line("> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:  # at the prompt: leave, without a traceback
                print()
                return 130
            command = line.strip()
            if not command:
                continue
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                messages[:] = system
                print("[new conversation]", file=sys.stderr)
                continue
            if command == "/help":
                print(f"[{CHAT_HELP}]", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            reply = _chat_turn(llm, messages, params)
            if reply is None:
                messages.pop()
            else:
                messages.append({"role": "assistant", "content": reply})


def _check_system_prompt(llm, system: list[dict[str, str]]) -> None:
    """A chat template that refuses a system message (raise_exception, as Gemma's and early
    Mistral's do) is a one-line error before the first turn, not a traceback at it."""
    import jinja2

    try:
        _chat_prompt(llm, [*system, {"role": "user", "content": "Hello."}])
    except jinja2.TemplateError as e:
        raise ValueError(f"--system-prompt: the model's chat template refuses it: {e}") from None


def _read_line(prompt: str) -> str:
    """input(prompt), where a Ctrl-C pressed as the prompt appears still interrupts it.

    NOTE: input() blocks in read() once the prompt is out; a SIGINT that lands after Python's
    last signal check but before that read() is caught but raises nothing until a line comes
    (the chat hung at its prompt, mostly under load). Waiting first in select() on stdin and a
    signal wakeup pipe closes that window: a signal that came early leaves a byte in the pipe.
    """
    try:
        fd = sys.stdin.fileno()
    except (OSError, ValueError):  # no real stdin (a test's replacement): nothing to wait on
        return input(prompt)
    print(prompt, end="", flush=True)
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    old = signal.set_wakeup_fd(w)
    try:
        while fd not in select.select([fd, r], [], [])[0]:
            os.read(r, 64)  # a signal arrived; its handler runs as Python resumes
        return input()
    finally:
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)


def _chat_turn(llm, messages: list[dict[str, str]], params) -> str | None:
    """Stream one reply; Ctrl-C stops it (what was said is kept). None if the turn cannot run.

    A conversation grown past the context starts over from its last message (after the system
    prompt, which stays), if that fits on its own (if not, the message is refused and the
    conversation kept).
    """
    keep = 1 if messages[0]["role"] == "system" else 0  # the system prompt
    text, ids = _chat_prompt(llm, messages)
    stream = llm.stream({"prompt": text, "prompt_token_ids": ids}, params)
    reply = ""
    try:
        for delta in stream:  # a prompt that cannot run raises before the first delta
            reply += delta
            print(delta, end="", flush=True)
    except ValueError as e:
        if reply or len(messages) == keep + 1:
            print(f"error: {e}", file=sys.stderr)
            return None
        alone = len(_chat_prompt(llm, messages[:keep] + messages[-1:])[1])
        if alone >= llm.max_model_len:
            print(
                f"error: this message takes {alone} tokens on its own"
                f"{' (with the system prompt)' if keep else ''}, and the model's maximum "
                f"context length is {llm.max_model_len} (with room for the reply)",
                file=sys.stderr,
            )
            return None
        print("[the conversation no longer fits the context: starting over]", file=sys.stderr)
        del messages[keep:-1]
        return _chat_turn(llm, messages, params)
    except KeyboardInterrupt:
        stream.close()  # aborts the request in the engine
        print(" [stopped]", end="")
    print()
    return reply


def _chat_prompt(llm, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tok.encode(text, add_special_tokens=False)


def serve_config(args):
    """The engine configuration ``shm-engine serve`` starts with."""
    from shm_engine.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mib << 20,
        kv_cache_dtype=args.kv_cache_dtype,
        activation_dtype=args.activation_dtype,
        weight_dtype=args.weight_dtype,
        num_threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        **_speculative(args),
    )


def cmd_serve(args) -> int:
    from shm_engine.engine.client import close_launches, launch_engines
    from shm_engine.model.loader import resolve_model_path

    config = serve_config(args)
    resolve_model_path(config.model)  # a missing model path fails before any spawn (as in LLM)
    # NOTE: the engines (one a replica; too many replicas fail before any spawn) start before
    # the web stack is imported and the model's metadata read (~1.5 s): their own imports run
    # meanwhile on the other core, and the server is up that much sooner.  Anything that fails
    # before the server adopts them stops them.
    launches = launch_engines(args.data_parallel_size)
    try:
        from shm_engine.engine.config import check_max_model_len
        from shm_engine.entrypoints.api_server import serve
        from shm_engine.model.loader import load_model_info

        chat = chat_options(args)
        # NOTE: mistakes the engine would find only once loaded, behind uvicorn's lifespan
        # traceback (exit 3), are one line and exit 2 here: a missing or unreadable model, a
        # context longer than the model's.
        model = load_model_info(config.model)  # config and tokenizer: no weights, no torch
        check_max_model_len(config.max_model_len, model.config.max_position_embeddings)
        serve(
            config,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            log_level=args.log_level,
            access_log=args.access_log,
            data_parallel_size=args.data_parallel_size,
            model_info=model,
            chat_options=chat,
            # NOTE: an explicit --api-key "" is checked (an error); an empty variable is unset
            api_key=args.api_key if args.api_key is not None else api_key_from_env(),
            launches=launches,
        )
    finally:
        close_launches(launches)  # nothing, once the server adopted them
    return 0


def api_key_from_env() -> str | None:
    return os.environ.get("SHM_ENGINE_API_KEY") or None


def chat_options(args):
    """serve's chat flags, checked: a template that does not compile fails here, in one line."""
    from shm_engine.entrypoints.openai_server import ChatOptions
    from shm_engine.model.tokenizer import check_chat_template

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.chat_template is not None:
        check_chat_template(args.chat_template)
    parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    return ChatOptions(
        chat_template=args.chat_template,
        tool_call_parser=parser,
        reasoning_parser=args.reasoning_parser,
    )


def cmd_bench(args) -> int:
    if args.what == "serve":
        from shm_engine.benchmarks import serve

        return serve.main(args.rest)
    if args.what == "ipc":
        from shm_engine.benchmarks import ipc

        return ipc.main(args.rest)
    print(f"unknown benchmark {args.what!r}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    from shm_engine.engine.config import EngineConfig

    engine_defaults = EngineConfig()
    parser = OneLineParser(prog="shm-engine", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for prompts, streaming to the terminal")
    g.add_argument("prompts", nargs="*")
    g.add_argument("--file", help="a file with one prompt per line")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser(
        "chat", help=f"interactive chat with the model's chat template ({CHAT_HELP})"
    )
    c.add_argument("--system-prompt", default=None, help="the conversation's system message")
    _engine_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int_in(0, 65535), default=8000)
    s.add_argument("--served-model-name", default=None, help="model id in the API")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 requests (default: the "
        "SHM_ENGINE_API_KEY environment variable; /health and /metrics stay open)",
    )
    s.add_argument(
        "--max-num-seqs",
        type=int,
        default=engine_defaults.max_num_seqs,
        help="largest running batch",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=engine_defaults.max_num_batched_tokens,
        help="tokens a step (decodes + prefill chunks): smaller steps cut the decode stall a "
        "long prompt causes, at some prefill throughput",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=engine_defaults.long_prefill_token_threshold,
        help="largest prefill chunk of one request a step (0: the whole step budget)",
    )
    s.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="priority: requests' `priority` field orders admission and preemption (lower first)",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int_in(1),
        default=1,
        help="engine replicas, each pinned to its share of the cores",
    )
    s.add_argument(
        "--chat-template",
        type=_template_or_file,
        help="a Jinja chat template (or its file) instead of the model's own",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides to call tools, in the format of '
        "--tool-call-parser",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes its tool calls (hermes: <tool_call>{json}</tool_call>, "
        "Qwen2.5 and Hermes; llama3_json: {json}; {json} ..., Llama 3.1-3.3)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="the <think>...</think> part of answers goes to the chat API's `reasoning` "
        "(deepseek_r1: answers start thinking; qwen3: where they open <think>)",
    )
    _engine_args(s)
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser(
        "bench", help="benchmarks: serve (load generator for an OpenAI endpoint), ipc"
    )
    b.add_argument("what", choices=["serve", "ipc"])
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shm_engine.engine.client import EngineDeadError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # a bad value or path: one line, as argparse's errors
        return fail(f"shm-engine {args.cmd}", str(e))
    except EngineDeadError as e:
        return fail(f"shm-engine {args.cmd}", str(e), status=1)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
