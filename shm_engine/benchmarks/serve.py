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
lines of ``--dataset-path`` (text, or JSONL with a "prompt" field); every run of a sweep sends
prompts of its own, so no run finds another's in the server's prefix cache.
``ignore_eos`` is sent so every request generates exactly ``--output-len`` tokens on servers
that honour it (vLLM, ours); pass ``--no-ignore-eos`` for strict OpenAI servers.

The generator shares the machine with the server it measures, so its own CPU per token is kept
low: aiohttp (C HTTP parser) on uvloop, SSE split by hand on bytes, msgspec JSON: 0.05 ms of CPU
per streamed token, against 0.16 ms with httpx on the stdlib loop, which a 2-core engine felt in
TPOT (29 instead of 22 ms at 16 streams from the same server).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

PERCENTILES = (50, 90, 99)


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


@functools.cache
def _tokenizer(path: str | None) -> Any:
    from shm_engine.model.loader import load_model

    return load_model(path).tokenizer


def random_prompts(
    n: int, input_len: int, tokenizer_path: str | None, seed: int | tuple[int, ...]
) -> list[tuple[str, int]]:
    """``n`` distinct prompts of about ``input_len`` tokens (random tokens, re-encoded to fit)."""
    tok = _tokenizer(tokenizer_path)
    rng = np.random.default_rng(seed)
    special = set(tok.all_special_ids)
    lo, hi = 300, max(301, tok.vocab_size - 300)  # skip bytes/specials at the ends
    prompts = []
    for _ in range(n):
        ids = [int(t) for t in rng.integers(lo, hi, input_len) if int(t) not in special]
        text = tok.decode(ids)
        # Decoding and re-encoding changes the count; trim or pad until it is exact-ish.
        for _ in range(4):
            enc = tok.encode(text, add_special_tokens=False)
            if len(enc) > input_len:
                text = tok.decode(enc[:input_len])
            elif len(enc) < input_len:
                extra = [int(t) for t in rng.integers(lo, hi, input_len - len(enc))]
                text = text + tok.decode(extra)
            else:
                break
        prompts.append((text, len(tok.encode(text, add_special_tokens=False))))
    return prompts


def file_prompts(path: str, n: int, nonce: str | None = None) -> list[tuple[str, int]]:
    """Prompts from a text file (one a line) or JSONL ({"prompt": ...}), cycled to ``n``.

    With ``nonce``, each prompt starts with ``(nonce.cycle) ``: a run's prompts, and the repeats
    of a short file within one run, then share no prefix the server may have cached, while the
    prompts of one pass over the file still share the prefixes the dataset gives them.
    """
    items: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                obj = json.loads(line)
                line = obj.get("prompt") or obj.get("text") or ""
            items.append(line)
    if not items:
        raise SystemExit(f"no prompts in {path}")
    if nonce is None:
        return [(items[i % len(items)], 0) for i in range(n)]
    return [(f"({nonce}.{i // len(items)}) {items[i % len(items)]}", 0) for i in range(n)]


def run_prompts(args: argparse.Namespace, run: int) -> list[tuple[str, int]]:
    """The prompts of run ``run`` of a sweep: distinct from every other run's.

    Why: the runs of a sweep share one server, and reused prompts hit its prefix cache: a
    second run measured TTFT 44 ms where the first measured 417 ms.
    """
    if args.dataset_path:
        return file_prompts(args.dataset_path, args.num_prompts, nonce=f"{args.seed}.{run}")
    return random_prompts(args.num_prompts, args.input_len, args.tokenizer, (args.seed, run))


# --------------------------------------------------------------------------- one request


_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
_JSON = {"Content-Type": "application/json"}


async def send_request(
    client, url: str, payload: dict[str, Any], chat: bool, prompt_tokens: int
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
        async with client.post(url, data=_json_encode(payload), headers=_JSON) as resp:
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
                        res.error = str(obj["error"].get("message", obj["error"]))
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
            w = await send_request(client, url, payload(f"Warm-up {i}: count to ten.", 4), chat, 0)
            if not w.ok:
                raise SystemExit(f"warm-up request failed: {w.error}")

        async def one(text: str, n: int) -> RequestResult:
            async with sem:
                r = await send_request(client, url, payload(text), chat, n)
            bar.update(1)
            return r

        tasks = []
        start = time.perf_counter()
        for text, n in prompts:
            tasks.append(asyncio.create_task(one(text, n)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
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


def plot(runs: list[dict[str, Any]], x_key: str, path: str) -> None:
    """Latency percentiles and output throughput against the swept load parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r[x_key] if r[x_key] not in (None, "inf") else float("nan") for r in runs]
    if all(isinstance(x, float) and math.isnan(x) for x in xs):
        xs = list(range(1, len(runs) + 1))
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="shm-engine bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random prompts)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--dataset-path", default=None, help="prompts file (text lines or JSONL)")
    p.add_argument("--tokenizer", default=None, help="model path whose tokenizer sizes prompts")
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second"
    )
    p.add_argument("--sweep", default=None, help="comma-separated values of --sweep-param")
    p.add_argument("--sweep-param", default="concurrency", choices=["concurrency", "request_rate"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write a PNG of latency against load")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


async def _model_id(base_url: str) -> str:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=30.0)
    async with (
        aiohttp.ClientSession(timeout=timeout) as c,
        c.get(base_url.rstrip("/") + "/v1/models") as r,
    ):
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = args.model or await _model_id(args.base_url)
    values: list[float | None] = [None]
    if args.sweep:
        values = [float(v) for v in args.sweep.split(",") if v.strip()]
    prompts = [run_prompts(args, run) for run in range(len(values))]
    # NOTE: as in the server: a full collection over the startup heap would stall every
    # stream's timestamps at once (a fake latency spike); only the run's own objects are walked.
    # Hence the prompts of every run are made first, the tokenizer with them.
    gc.collect()
    gc.freeze()
    runs = []
    for run, v in enumerate(values):
        conc, rate = args.concurrency, args.request_rate
        if v is not None and args.sweep_param == "concurrency":
            conc = int(v)
        elif v is not None:
            rate = v
        rep = await run_load(args, prompts[run], model, conc, rate)
        print_report(rep)
        runs.append(rep)
    return runs


def run_async(coro: Any) -> Any:
    """asyncio.run on uvloop (less loop overhead per SSE chunk than the stdlib loop)."""
    import uvloop

    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = run_async(amain(args))
    if args.json:
        # The last (highest-load) run's figures at the top level; every run under "runs".
        doc = dict(runs[-1])
        if len(runs) > 1:
            doc["sweep_param"] = args.sweep_param
            doc["runs"] = runs
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        plot(runs, args.sweep_param if args.sweep else "concurrency", args.plot)
    return 0 if all(r["completed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
