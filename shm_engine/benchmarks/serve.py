"""``shm-engine bench serve``: a load generator for any OpenAI-compatible endpoint.

    shm-engine bench serve --base-url http://127.0.0.1:8000 --concurrency 16 --num-prompts 64 \\
        --input-len 128 --output-len 128 --json out.json [--plot out.png] [--sweep 1,4,16]

Each request streams (SSE) and is timed as vLLM's benchmark does: TTFT is send -> the first chunk
with ``choices``, ITL the gaps between later such chunks, latency send -> the last one, TPOT
(latency - TTFT) / (output tokens - 1). A request succeeds when its 200 stream ends with
``data: [DONE]``. Output tokens come from the ``usage`` the server sends when asked
(``stream_options.include_usage``); a server that sends none has the chunks that carried text
counted instead, and the report says for how many requests. Arrivals are Poisson at
``--request-rate`` (default: all at once), at most ``--concurrency`` in flight. Prompts are random
token strings of ``--input-len`` tokens (the embedded model's tokenizer, or ``--tokenizer``), or
the prompts of ``--dataset-path`` (.jsonl/.json: JSON objects with "prompt" or "text", or ShareGPT
"conversations"; any other name: one prompt a line). Every prompt starts with a tag holding a
random nonce drawn per invocation and the run's index in the sweep, so no run, of this invocation
or of an earlier one against the same server, finds another's prompts in the prefix cache;
what follows the tag (and so the lengths) is reproducible from ``--seed``.
``ignore_eos`` is sent so every request generates exactly ``--output-len`` tokens on servers
that honour it (vLLM, ours); pass ``--no-ignore-eos`` for strict OpenAI servers.

The report is printed after every run; ``--json`` is rewritten after every run, so a sweep that
fails part-way keeps the runs it finished. The exit code is 1 when any request failed, 2 for a
usage error (bad argument, unreadable prompts file, unreachable server).

The generator shares the machine with the server it measures, so its own CPU per token is kept
low: aiohttp (C HTTP parser) on uvloop, SSE split by hand on bytes, msgspec JSON: 0.05 ms of CPU
per streamed token, against 0.16 ms with httpx on the stdlib loop, which a 2-core engine felt in
TPOT (29 instead of 22 ms at 16 streams from the same server).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import math
import os
import random
import secrets
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from shm_engine.benchmarks.prompts import (
    DatasetError,
    file_prompts,
    load_prompt_file,
    random_prompts,
)
from shm_engine.entrypoints.cli_parser import OneLineParser, int_in, number

PERCENTILES = (50, 90, 99)
PROG = "shm-engine bench serve"


class BenchError(Exception):
    """A problem the user can fix (argument, server address): one line, exit 2."""


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False  # False: output_tokens counts the chunks that carried text
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where reported
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- prompts


def run_tag(args: argparse.Namespace, run: int) -> str:
    """``nonce.run``: the tag that starts every prompt of run ``run`` of this invocation.

    Why the nonce (drawn per invocation by parse_args): the runs of a sweep, and invocations one
    after another, share one server, and reused prompts hit its prefix cache: a second run
    measured TTFT 44 ms where the first measured 417 ms. Without one (``args`` made by hand), the
    seed stands in: distinct runs, but the same prompts every time.
    """
    return f"{getattr(args, 'nonce', None) or args.seed}.{run}"


def run_prompts(
    args: argparse.Namespace, run: int, items: list[str] | None = None
) -> list[tuple[str, int]]:
    """The prompts of run ``run`` of a sweep: distinct from every other run's (``items``: the
    dataset file, read already)."""
    tag = run_tag(args, run)
    if args.dataset_path:
        return file_prompts(args.dataset_path, args.num_prompts, nonce=tag, items=items)
    return random_prompts(args.num_prompts, args.input_len, args.tokenizer, (args.seed, run), tag)


# --------------------------------------------------------------------------- one request


_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
_JSON = {"Content-Type": "application/json"}


def request_headers(api_key: str | None) -> dict[str, str]:
    """JSON, and the bearer key where one is given (a server run with --api-key wants it)."""
    return _JSON if not api_key else {**_JSON, "Authorization": f"Bearer {api_key}"}


async def send_request(
    client,
    url: str,
    payload: dict[str, Any],
    chat: bool,
    prompt_tokens: int,
    headers: dict[str, str] = _JSON,
) -> RequestResult:
    """Stream one request; timestamps are taken as each SSE read arrives.

    As vLLM's benchmark: every chunk with ``choices`` counts, even one without text (a request
    may finish on its first token with no text at all), TTFT is the first of them and latency the
    last. Unlike it, a 200 stream that ends without ``data: [DONE]`` is a failure.
    """
    res = RequestResult(prompt_tokens=prompt_tokens)
    chunks = text_chunks = 0
    done = False
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.post(url, data=_json_encode(payload), headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                res.error = f"HTTP {resp.status}: {body[:300]}"
                return res
            buf = b""
            # Bytes as they arrive, split by hand: a line reader decodes and re-splits in Python,
            # which costs the client (sharing the machine with the server) more CPU per token.
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                *events, buf = buf.split(b"\n")
                for line in events:
                    if not line.startswith(b"data:"):
                        continue
                    payload_ = line[5:].strip()
                    if payload_ == b"[DONE]":
                        done = True
                        continue
                    obj = _json_decode(payload_)
                    if "error" in obj:
                        res.error = _server_error(obj["error"])
                        return res
                    if usage := obj.get("usage"):
                        _read_usage(res, usage)
                    choices = obj.get("choices")
                    if not choices:
                        continue
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    c = choices[0]
                    text_chunks += bool(
                        (c.get("delta") or {}).get("content") if chat else c.get("text")
                    )
    except Exception as e:  # network errors count as failed requests, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    return _finish(res, done, chunks, text_chunks, last - t0)


def _server_error(err: Any) -> str:
    """The message of an SSE error event: OpenAI sends {"message": ...}, some servers a string."""
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def _read_usage(res: RequestResult, usage: dict[str, Any]) -> None:
    if usage.get("completion_tokens") is not None:
        res.output_tokens = usage["completion_tokens"]
        res.usage_reported = True
    res.prompt_tokens = usage.get("prompt_tokens") or res.prompt_tokens
    details = usage.get("prompt_tokens_details") or {}
    res.cached_tokens = details.get("cached_tokens") or 0


def _finish(
    res: RequestResult, done: bool, chunks: int, text_chunks: int, latency: float
) -> RequestResult:
    """Success or failure of a stream that was read to its end."""
    if not done:
        res.error = "stream ended early (no data: [DONE])"
    elif not chunks:
        res.error = "the stream had no chunk with choices"
    else:
        res.ok = True
        res.latency = latency
        if not res.usage_reported:
            res.output_tokens = text_chunks  # one token a chunk: reported as an estimate
    return res


# --------------------------------------------------------------------------- one run


def _stats(values: list[float]) -> dict[str, float]:
    """mean/std/percentiles in milliseconds (zeros when there is nothing to measure)."""
    if not values:
        return {"mean": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    a = np.asarray(values) * 1e3
    out = {"mean": float(a.mean()), "std": float(a.std())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


async def run_load(
    args: argparse.Namespace,
    prompts: list[tuple[str, int]],
    model: str,
    concurrency: int | None,
    request_rate: float,
) -> dict[str, Any]:
    """Send every prompt with the given arrival rate and concurrency cap; return the report."""
    import aiohttp
    from tqdm import tqdm

    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    url = args.base_url.rstrip("/") + args.endpoint
    limit = concurrency or len(prompts)
    connector = aiohttp.TCPConnector(limit=limit + 4)
    # Like httpx's read timeout: the longest silence allowed on a stream, not a total.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=args.timeout)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(args.seed)
    headers = request_headers(args.api_key)
    bar = tqdm(
        total=len(prompts),
        desc=f"c={concurrency or 'inf'} rate={request_rate:g}",
        disable=args.no_progress,
        file=sys.stderr,
    )

    def payload(text: str, max_tokens: int = args.output_len) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not args.no_ignore_eos:
            body["ignore_eos"] = True
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        for i in range(args.warmup):
            # Not one of the measured prompts: those must not find their prefix cached.
            warm = payload(f"Warm-up {i}: count to ten.", 4)
            w = await send_request(client, url, warm, chat, 0, headers)
            if not w.ok:
                raise SystemExit(f"warm-up request failed: {w.error}")

        async def one(text: str, n: int) -> RequestResult:
            async with sem:
                r = await send_request(client, url, payload(text), chat, n, headers)
            bar.update(1)
            return r

        tasks = []
        start = time.perf_counter()
        for i, (text, n) in enumerate(prompts):
            # Gaps between arrivals only: one after the last would idle inside the duration.
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(text, n)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return report(results, duration, args, model, concurrency, request_rate)


def report(
    results: list[RequestResult],
    duration: float,
    args: argparse.Namespace,
    model: str,
    concurrency: int | None,
    request_rate: float,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "concurrency": concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "input_len": args.input_len,
        "output_len": args.output_len,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # Requests whose output tokens are counted chunks: the server sent no usage.
        "output_tokens_estimated": sum(not r.usage_reported for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "total_tok_s": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
    }


def print_report(rep: dict[str, Any]) -> None:
    line = "=" * 60
    print(line)
    print(f" Serving benchmark: {rep['model']} at {rep['base_url']}{rep['endpoint']}")
    print(f"   concurrency {rep['concurrency'] or 'unlimited'}, request rate {rep['request_rate']}")
    print(line)
    rows = [
        ("Successful requests", f"{rep['completed']} / {rep['num_prompts']}"),
        ("Duration (s)", f"{rep['duration_s']:.2f}"),
        ("Input tokens", rep["total_input_tokens"]),
        ("Output tokens", rep["total_output_tokens"]),
        ("Cached prompt tokens (server)", rep["cached_prompt_tokens"]),
        ("Request throughput (req/s)", f"{rep['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{rep['output_tok_s']:.1f}"),
        ("Total token throughput (tok/s)", f"{rep['total_tok_s']:.1f}"),
    ]
    for k, v in rows:
        print(f" {k:<34}{v:>24}")
    if rep["output_tokens_estimated"]:
        print(
            f" NOTE: {rep['output_tokens_estimated']} requests had no usage from the server: their"
            " output tokens are the chunks that carried text"
        )
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2E latency"),
    ):
        s = rep[key]
        print(
            f" {name + ' (ms)':<20} mean {s['mean']:8.2f}  p50 {s['p50']:8.2f}  p99 {s['p99']:8.2f}"
        )
    if rep["errors"]:
        print(" errors:", *rep["errors"], sep="\n   ")
    print(line)


def _is_unbounded(value: Any) -> bool:
    return value is None or value == "inf" or (isinstance(value, float) and math.isinf(value))


def plot_positions(values: list[Any]) -> tuple[list[float], list[str]]:
    """x positions and tick labels of a sweep's points; an unbounded point (rate inf, unlimited
    concurrency) goes one step right of the largest finite value, labelled "inf".

    Why: as NaN it was dropped, and the inf point of a rate sweep is the saturated throughput.
    """
    finite = [float(v) for v in values if not _is_unbounded(v)]
    step = (max(finite) - min(finite)) / (len(finite) - 1) if len(finite) > 1 else 1.0
    right = (max(finite) if finite else 0.0) + (step or 1.0)
    xs = [right if _is_unbounded(v) else float(v) for v in values]
    return xs, ["inf" if _is_unbounded(v) else f"{float(v):g}" for v in values]


def plot(runs: list[dict[str, Any]], x_key: str, path: str) -> None:
    """Latency percentiles and output throughput against the swept load parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, labels = plot_positions([r[x_key] for r in runs])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (
        ("ttft_ms", "TTFT", "o-"),
        ("tpot_ms", "TPOT", "s-"),
        ("itl_ms", "ITL", "^-"),
    ):
        (line,) = ax.plot(xs, [r[key]["p50"] for r in runs], style, label=f"{label} p50")
        ax.plot(
            xs, [r[key]["p99"] for r in runs], style, color=line.get_color(), alpha=0.4,
            label=f"{label} p99",
        )  # fmt: skip
    ax.set_xticks(xs, labels)
    ax.set_xlabel(x_key.replace("_", " "))
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(xs, [r["output_tok_s"] for r in runs], "k--", label="output tok/s")
    ax2.set_ylabel("output tokens/s")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.set_title(f"{runs[0]['model']}: latency and throughput vs {x_key.replace('_', ' ')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


_positive_int = int_in(1)
_count = int_in(0)  # warm-up requests may be none


def _seconds(text: str) -> float:
    value = number(float, text)
    if not 0 < value < math.inf:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _rate(text: str) -> float:
    """Requests per second: > 0, or inf for all at once (0 was sent unpaced but reported as 0)."""
    value = number(float, text)
    if not value > 0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)"
    )
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    # NOTE: no OPENAI_API_KEY default (as the openai client has): it would send a user's
    # OpenAI key in clear to whatever --base-url names
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=_positive_int, default=64)
    p.add_argument(
        "--input-len", type=_positive_int, default=128, help="prompt tokens (random prompts)"
    )
    p.add_argument(
        "--output-len", type=_positive_int, default=128, help="max_tokens of every request"
    )
    p.add_argument(
        "--dataset-path",
        default=None,
        help="prompts file: .jsonl/.json of {'prompt'|'text': ...} objects (or ShareGPT "
        "'conversations'); any other name: one prompt a line",
    )
    p.add_argument("--tokenizer", default=None, help="model path whose tokenizer sizes prompts")
    p.add_argument("--concurrency", type=_positive_int, default=None, help="max requests in flight")
    p.add_argument(
        "--request-rate",
        type=_rate,
        default=float("inf"),
        help="Poisson arrivals per second (inf: all at once)",
    )
    p.add_argument("--sweep", default=None, help="comma-separated values of --sweep-param")
    p.add_argument("--sweep-param", default="concurrency", choices=["concurrency", "request_rate"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--warmup", type=_count, default=1, help="warm-up requests before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=_seconds, default=600.0, help="per-request timeout (s)")
    p.add_argument("--json", default=None, help="write the report here (after every run)")
    p.add_argument("--plot", default=None, help="write a PNG of latency against load")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, checked before anything runs; ``nonce`` is this invocation's prompt tag."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.base_url = _base_url(args.base_url, args.endpoint)
        args.sweep_values = _sweep_values(args.sweep, args.sweep_param) if args.sweep else [None]
        if args.dataset_path and not os.path.isfile(args.dataset_path):
            raise BenchError(f"--dataset-path {args.dataset_path}: no such file")
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise BenchError("--plot needs matplotlib (pip install matplotlib)")
        for option, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                _check_writable(option, path)
    except BenchError as e:
        p.error(str(e))
    args.nonce = secrets.token_hex(3)
    return args


def _base_url(url: str, endpoint: str) -> str:
    """``url`` without a trailing slash, or a trailing /v1 where the endpoint starts with one
    (the OpenAI client's base URLs end in /v1)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchError(f"--base-url {url}: expected http://HOST:PORT")
    url = url.rstrip("/")
    if url.endswith("/v1") and endpoint.startswith("/v1/"):
        url = url[: -len("/v1")]
    return url


def _sweep_values(text: str, param: str) -> list[Any]:
    """The values of ``--sweep``, each valid for ``param`` (a concurrency of 0.5 was int() to 0:
    unlimited, reported as 0)."""
    parse = _positive_int if param == "concurrency" else _rate
    values = []
    for v in text.split(","):
        if not v.strip():
            continue
        try:
            values.append(parse(v.strip()))
        except argparse.ArgumentTypeError as e:
            raise BenchError(f"--sweep {text}: {param.replace('_', ' ')} {e}") from None
    if not values:
        raise BenchError(f"--sweep {text!r}: no values")
    return values


def _check_writable(option: str, path: str) -> None:
    """Fail before the benchmark, not after it: a mistyped directory used to lose the run."""
    if os.path.isdir(path):
        raise BenchError(f"{option} {path} is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise BenchError(f"{option} {path}: cannot write in {directory}: {e.strerror}") from None


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Replace ``path`` whole (temporary file + rename): a failure mid-write, or a reader, never
    meets half a report."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def json_doc(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The last finished run's figures at the top level; with --sweep, every finished run under
    "runs" and the planned values under "sweep_values" (fewer runs: the sweep stopped early)."""
    doc = dict(runs[-1])
    if args.sweep:
        doc["sweep_param"] = args.sweep_param
        doc["sweep_values"] = [v if math.isfinite(v) else "inf" for v in args.sweep_values]
        doc["runs"] = runs
    return doc


async def server_model(base_url: str, model: str | None, api_key: str | None = None) -> str:
    """The model id to send (``model``, or the first of /v1/models), once the server answers.

    Why ask even with ``model``: an unreachable server would otherwise show up as every request
    failing (or a warm-up traceback) instead of one line naming the URL.
    """
    import aiohttp

    url = base_url + "/v1/models"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30.0)) as c,
            c.get(url, headers=request_headers(api_key)) as r,
        ):
            if r.status == 401:  # every request would fail the same way
                raise BenchError(f"GET {url} answered HTTP 401: pass the server's --api-key")
            if model:
                return model
            if r.status != 200:
                raise BenchError(f"GET {url} answered HTTP {r.status}: pass --model")
            return (await r.json(content_type=None))["data"][0]["id"]
    except (aiohttp.ClientError, TimeoutError) as e:
        raise BenchError(f"cannot reach the server at {base_url}: {e}") from None
    except (ValueError, LookupError, TypeError):
        raise BenchError(f"GET {url}: no model id in the answer: pass --model") from None


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    items = load_prompt_file(args.dataset_path) if args.dataset_path else None
    model = await server_model(args.base_url, args.model, args.api_key)
    prompts = [run_prompts(args, run, items) for run in range(len(args.sweep_values))]
    # NOTE: as in the server: a full collection over the startup heap would stall every
    # stream's timestamps at once (a fake latency spike); only the run's own objects are walked.
    # Hence the prompts of every run are made first, the tokenizer with them.
    gc.collect()
    gc.freeze()
    runs = []
    for run, v in enumerate(args.sweep_values):
        conc, rate = args.concurrency, args.request_rate
        if v is not None and args.sweep_param == "concurrency":
            conc = v
        elif v is not None:
            rate = v
        rep = await run_load(args, prompts[run], model, conc, rate)
        print_report(rep)
        runs.append(rep)
        if args.json:  # after every run: a later failure must not lose the finished ones
            write_json(args.json, json_doc(args, runs))
    return runs


def run_async(coro: Any) -> Any:
    """asyncio.run on uvloop (less loop overhead per SSE chunk than the stdlib loop)."""
    import uvloop

    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    """0: every request succeeded; 1: some failed (the report and JSON are written first);
    2: a usage error, reported in one line."""
    args = parse_args(argv)
    try:
        runs = run_async(amain(args))
    except (BenchError, DatasetError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        plot(runs, args.sweep_param if args.sweep else "concurrency", args.plot)
    failed = sum(r["failed"] for r in runs)
    if failed:
        total = sum(r["num_prompts"] for r in runs)
        print(f"{PROG}: {failed} of {total} requests failed (errors above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
