"""``shm-engine bench serve`` against a fake OpenAI server (no model, a few seconds): arrival
pacing, the JSON written run by run, prompt files, the per-invocation prompt nonce, server
error events, argument errors, the plot's inf point and the exit code."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shm_engine.benchmarks import prompts
from shm_engine.benchmarks import serve as bench
from shm_engine.entrypoints import cli

TOKEN_DELAY = 0.001


# --------------------------------------------------------------------------- fake server


@dataclass
class FakeServer:
    """What the fake server received; its behaviour is the first path segment of the URL:
    ok, http500, str_error (an SSE error event whose "error" is a string), dieN (503 after N
    requests)."""

    port: int
    paths: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)

    def url(self, mode: str = "ok") -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"


def _chunk(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _app(state: FakeServer) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake"}]})

    async def completions(request: Request) -> Response:
        mode = request.path_params["mode"]
        body = await request.json()
        state.paths.append(request.url.path)
        state.prompts.append(body.get("prompt") or body["messages"][-1]["content"])
        if mode == "http500":
            return Response("boom", status_code=500)
        if mode.startswith("die") and len(state.paths) > int(mode[3:]):
            return Response("gone", status_code=503)
        return StreamingResponse(_stream(mode, body["max_tokens"]), media_type="text/event-stream")

    async def _stream(mode: str, n: int):
        if mode == "str_error":
            yield _chunk({"error": "model overloaded"})
            yield b"data: [DONE]\n\n"
            return
        for i in range(n):
            await asyncio.sleep(TOKEN_DELAY)
            yield _chunk({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
        usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
        yield _chunk({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    return Starlette(
        routes=[
            Route("/{mode}/v1/models", models),
            Route("/{mode}/v1/completions", completions, methods=["POST"]),
            Route("/{mode}/v1/chat/completions", completions, methods=["POST"]),
        ]
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def _server():
    state = FakeServer(_free_port())
    config = uvicorn.Config(
        _app(state), host="127.0.0.1", port=state.port, log_level="warning", lifespan="off",
        loop="asyncio",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.01)
    yield state
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def fake(_server: FakeServer) -> FakeServer:
    _server.paths.clear()
    _server.prompts.clear()
    return _server


def _prompts_file(tmp_path: Path, name: str = "p.txt", text: str = "one\ntwo\n") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``bench serve`` as the CLI runs it: (exit code, stdout, stderr), argparse's exits too."""
    try:
        rc = bench.main(["--no-progress", "--output-len", "3", *argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)  # as the interpreter does
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


# --------------------------------------------------------------------------- 1. pacing


def test_request_rate_sleeps_only_between_arrivals(fake, tmp_path, capsys) -> None:
    """Two requests: the second leaves after the first gap; the second gap, drawn but not slept,
    must not be in the duration (it was: throughput under-reported)."""
    rate = 2.0

    def draws(seed: int) -> list[float]:
        rng = random.Random(seed)
        return [rng.expovariate(rate) for _ in range(2)]

    seed = next(s for s in range(1000) if draws(s)[0] < 0.2 and draws(s)[1] > 0.8)
    gap, unslept = draws(seed)
    out = tmp_path / "r.json"
    rc, _, _ = run(
        capsys, "--base-url", fake.url(), "--dataset-path", _prompts_file(tmp_path),
        "--num-prompts", "2", "--warmup", "0", "--request-rate", str(rate), "--seed", str(seed),
        "--json", str(out),
    )  # fmt: skip
    assert rc == 0
    duration = json.loads(out.read_text())["duration_s"]
    assert gap <= duration < gap + 0.5 < gap + unslept


# --------------------------------------------------------------------------- 2. JSON per run


def test_json_keeps_the_runs_a_failed_sweep_finished(fake, tmp_path, capsys) -> None:
    out = tmp_path / "sweep.json"
    rc, _, err = run(
        capsys, "--base-url", fake.url("die3"), "--dataset-path", _prompts_file(tmp_path),
        "--num-prompts", "2", "--sweep", "1,2,4", "--json", str(out),
    )  # fmt: skip
    assert rc == 1 and "warm-up request failed" in err  # run 2's warm-up met a dead server
    doc = json.loads(out.read_text())
    assert doc["sweep_values"] == [1, 2, 4] and len(doc["runs"]) == 1
    assert doc["completed"] == 2 and doc["concurrency"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "sweep.json"]  # no temp file


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_is_refused_before_running(fake, tmp_path, capsys, option) -> None:
    rc, _, err = run(
        capsys, "--base-url", fake.url(), "--dataset-path", _prompts_file(tmp_path),
        option, str(tmp_path / "missing" / "out"),
    )  # fmt: skip
    assert rc == 2 and f"{option} {tmp_path}/missing/out: cannot write" in err
    rc, _, err = run(capsys, "--base-url", fake.url(), option, str(tmp_path))
    assert rc == 2 and "is a directory" in err
    assert not fake.paths


def test_write_json_replaces_whole(tmp_path) -> None:
    out = tmp_path / "r.json"
    out.write_text("old")
    bench.write_json(str(out), {"a": 1})
    assert json.loads(out.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == [
        "r.json"
    ]
    with pytest.raises(TypeError):
        bench.write_json(str(out), {"a": object()})
    assert json.loads(out.read_text()) == {"a": 1} and len(list(tmp_path.iterdir())) == 1


# --------------------------------------------------------------------------- 3. prompt files


def test_text_prompt_file_is_verbatim(tmp_path) -> None:
    path = _prompts_file(tmp_path, "code.txt", "Explain this C code:\n{ int x = 1; }\n\n")
    assert prompts.load_prompt_file(path) == ["Explain this C code:", "{ int x = 1; }"]


def test_json_prompt_files(tmp_path, capsys) -> None:
    lines = '{"prompt": "a"}\n\n{"text": "b", "id": 3}\n'
    assert prompts.load_prompt_file(_prompts_file(tmp_path, "p.jsonl", lines)) == ["a", "b"]
    assert prompts.load_prompt_file(_prompts_file(tmp_path, "p.json", lines)) == ["a", "b"]
    share_gpt = [
        {"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]},
        {"id": "y", "conversations": []},  # as in ShareGPT: skipped, with a note
        {"id": "z", "conversations": [{"from": "system", "value": "s"},
                                      {"from": "human", "value": "ho"}]},
    ]  # fmt: skip
    path = _prompts_file(tmp_path, "sharegpt.json", json.dumps(share_gpt))
    assert prompts.load_prompt_file(path) == ["hi", "ho"]
    assert "skipped 1 conversations" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "a"}\n{"instruction": "q", "output": "o"}\n', ":2: expected an object with"),
        ('{"prompt": "a"}\n\n["a list"]\n', ":3: expected an object"),
        ('{"prompt": ""}\n', ":1: expected an object"),
        ('{"prompt": 5}\n', ":1: expected an object"),
        ("plain text line\n", ":1: not valid JSON"),
        ("", "no prompts in the file"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, text, message) -> None:
    path = _prompts_file(tmp_path, "bad.jsonl", text)
    with pytest.raises(prompts.DatasetError, match=message) as e:
        prompts.load_prompt_file(path)
    assert str(e.value).startswith(path)


def test_bad_prompt_file_stops_before_any_request(fake, tmp_path, capsys) -> None:
    path = _prompts_file(tmp_path, "alpaca.jsonl", '{"instruction": "Explain TCP."}\n')
    rc, _, err = run(capsys, "--base-url", fake.url(), "--dataset-path", path)
    assert rc == 2 and f"{path}:1: expected an object" in err and not fake.paths


# --------------------------------------------------------------------------- 4. prompt nonce


def test_invocations_send_prompts_of_their_own(fake, tmp_path, capsys) -> None:
    """Same seed, same file: a second invocation must not find the first's prompts cached."""
    sent = []
    for _ in range(2):
        fake.prompts.clear()
        argv = ["--base-url", fake.url(), "--dataset-path", _prompts_file(tmp_path),
                "--num-prompts", "2", "--warmup", "0"]  # fmt: skip
        assert run(capsys, *argv)[0] == 0
        sent.append(sorted(fake.prompts))
    first, second = sent
    assert [p.split(") ", 1)[1] for p in first] == [p.split(") ", 1)[1] for p in second]
    assert not {p.split(")")[0] for p in first} & {p.split(")")[0] for p in second}


class CharTokenizer:
    """One token a character: encode and decode are exact."""

    all_special_ids: list[int] = []
    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_random_prompts_differ_by_nonce_only(monkeypatch) -> None:
    monkeypatch.setattr(prompts, "_tokenizer", lambda path: CharTokenizer())
    a = prompts.random_prompts(3, 32, None, (7, 0), tag="aaaaaa.0")
    b = prompts.random_prompts(3, 32, None, (7, 0), tag="bbbbbb.0")
    assert [n for _, n in a] == [n for _, n in b] == [32] * 3
    assert all(p.startswith("(aaaaaa.0) ") for p, _ in a)
    assert [p[11:] for p, _ in a] == [p[11:] for p, _ in b]  # the seed's, after the tag
    assert len({p for p, _ in a}) == 3
    args = bench.parse_args(["--num-prompts", "2", "--input-len", "20"])
    again = bench.parse_args(["--num-prompts", "2", "--input-len", "20"])
    assert args.nonce != again.nonce
    assert bench.run_prompts(args, 0)[0][0].startswith(f"({args.nonce}.0) ")
    assert {p for p, _ in bench.run_prompts(args, 0)}.isdisjoint(
        p for p, _ in bench.run_prompts(again, 0)
    )


# --------------------------------------------------------------------------- 5. error events


def test_string_error_event_reports_the_servers_message(fake, tmp_path, capsys) -> None:
    out = tmp_path / "e.json"
    rc, _, _ = run(
        capsys, "--base-url", fake.url("str_error"), "--dataset-path", _prompts_file(tmp_path),
        "--num-prompts", "2", "--warmup", "0", "--json", str(out),
    )  # fmt: skip
    assert rc == 1 and json.loads(out.read_text())["errors"] == ["model overloaded"]
    assert bench._server_error({"message": "m", "type": "t"}) == "m"


# --------------------------------------------------------------------------- 6/7. usage errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sweep", "1,x"], "--sweep 1,x: concurrency 'x' is not an integer"),
        (["--sweep", "0.5,1"], "concurrency '0.5' is not an integer"),
        (["--sweep", "0,1"], "concurrency must be >= 1, got 0"),
        (["--sweep", ","], "no values"),
        (["--sweep", "0,2", "--sweep-param", "request_rate"], "request rate must be > 0"),
        (["--sweep", "nan", "--sweep-param", "request_rate"], "request rate must be > 0"),
        (["--concurrency", "0"], "argument --concurrency: must be >= 1, got 0"),
        (["--concurrency", "-1"], "argument --concurrency: must be >= 1, got -1"),
        (["--request-rate", "0"], "argument --request-rate: must be > 0 (inf: all at once)"),
        (["--request-rate", "-2"], "argument --request-rate: must be > 0"),
        (["--num-prompts", "0"], "argument --num-prompts: must be >= 1"),
        (["--dataset-path", "/nonexistent.txt"], "--dataset-path /nonexistent.txt: no such file"),
        (["--base-url", "127.0.0.1:8000"], "expected http://HOST:PORT"),
        (["--warmup", "-1"], "argument --warmup: must be >= 0"),
        (["--timeout", "0"], "argument --timeout: must be a positive number of seconds"),
    ],
)
def test_usage_errors(fake, capsys, argv, message) -> None:
    rc, _, err = run(capsys, "--base-url", fake.url(), *argv)
    assert rc == 2 and message in err and not fake.paths
    assert err.count("\n") == 1  # one line, not argparse's usage block above it


def test_unreachable_server_is_named(tmp_path, capsys) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    for extra in ([], ["--model", "m"]):
        rc, _, err = run(capsys, "--base-url", url, "--dataset-path", _prompts_file(tmp_path),
                         *extra)  # fmt: skip
        assert rc == 2 and f"error: cannot reach the server at {url}: " in err
        assert len(err.strip().splitlines()) == 1


def test_base_url_ending_in_v1_is_accepted(fake, tmp_path, capsys) -> None:
    argv = ["--dataset-path", _prompts_file(tmp_path), "--num-prompts", "1", "--warmup", "0"]
    assert run(capsys, "--base-url", fake.url() + "/v1/", *argv)[0] == 0
    assert fake.paths == ["/ok/v1/completions"]


def test_sweeps_that_are_valid(fake, tmp_path, capsys) -> None:
    out = tmp_path / "s.json"
    rc, stdout, _ = run(
        capsys, "--base-url", fake.url(), "--dataset-path", _prompts_file(tmp_path),
        "--num-prompts", "2", "--sweep", "50,inf", "--sweep-param", "request_rate",
        "--json", str(out),
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0 and stdout.count("Serving benchmark") == 2
    assert doc["sweep_values"] == [50.0, "inf"] and [r["request_rate"] for r in doc["runs"]] == [
        50.0,
        "inf",
    ]


def test_generate_missing_file(capsys) -> None:
    assert cli.main(["generate", "--file", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err == "shm-engine generate: error: --file /nonexistent: No such file or directory\n"


# --------------------------------------------------------------------------- 8. plot


def test_plot_keeps_the_inf_point(tmp_path, monkeypatch) -> None:
    assert bench.plot_positions([1.0, 4.0, "inf"]) == ([1.0, 4.0, 7.0], ["1", "4", "inf"])
    assert bench.plot_positions([2, 8]) == ([2.0, 8.0], ["2", "8"])
    assert bench.plot_positions(["inf"]) == ([1.0], ["inf"])
    assert bench.plot_positions([None]) == ([1.0], ["inf"])  # unlimited concurrency

    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure,
        "savefig",
        lambda f, *a, **k: (figures.append(f), save(f, *a, **k)),
    )

    def stat(v: float) -> dict[str, float]:
        return {"mean": v, "std": 0.0, "p50": v, "p90": v, "p99": v}

    runs = [{"model": "m", "request_rate": r, "concurrency": None, "ttft_ms": stat(t),
             "tpot_ms": stat(10), "itl_ms": stat(10), "output_tok_s": o}
            for r, t, o in ((1.0, 50, 100), (4.0, 80, 300), ("inf", 900, 420))]  # fmt: skip
    png = tmp_path / "p.png"
    bench.plot(runs, "request_rate", str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    ax = figures[0].axes[0]
    assert all(list(line.get_xdata()) == [1.0, 4.0, 7.0] for line in ax.get_lines())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "inf"]


# --------------------------------------------------------------------------- 9. exit code


def test_failed_requests_exit_1_after_the_report(fake, tmp_path, capsys) -> None:
    out = tmp_path / "f.json"
    rc, stdout, err = run(
        capsys, "--base-url", fake.url("http500"), "--dataset-path", _prompts_file(tmp_path),
        "--num-prompts", "3", "--warmup", "0", "--json", str(out),
    )  # fmt: skip
    assert rc == 1 and "Successful requests" in stdout and "HTTP 500: boom" in stdout
    assert "3 of 3 requests failed" in err
    assert json.loads(out.read_text())["failed"] == 3


def test_all_ok_exits_0(fake, tmp_path, capsys) -> None:
    out = tmp_path / "ok.json"
    rc, _, err = run(
        capsys, "--base-url", fake.url(), "--dataset-path", _prompts_file(tmp_path),
        "--num-prompts", "2", "--sweep", "1,2", "--json", str(out),
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == 0 and not err and doc["completed"] == 2 and len(doc["runs"]) == 2
    assert doc["total_output_tokens"] == 2 * 3 and doc["concurrency"] == 2
