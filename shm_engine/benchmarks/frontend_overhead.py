"""What the HTTP frontend costs: the same work through ``shm-engine serve`` and without it.

    python -m shm_engine.benchmarks.frontend_overhead [--repeats 30] [--streams 16] [--json PATH]

1. TTFT at low load: one short prompt, one request at a time, streamed over HTTP (SSE, keep-alive)
   vs the engine driven directly over the rings (SyncMPClient) vs the engine in this process
   (InprocClient). HTTP minus in-process is the frontend's share (target: <= 2 ms p50).
2. TPOT at ``--streams`` concurrent streams: ``bench serve`` against the server vs the same
   requests straight through the rings (target: HTTP path <= 5 % of TPOT).

The server, the direct client and this process share the machine, so run it on a quiet one.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from shm_engine.entrypoints.cli_parser import OneLineParser

PROMPT = "The capital of France is"


def _p50(xs: list[float]) -> float:
    return float(np.percentile(xs, 50))


# Idle time before each TTFT request, on both paths (--gap-ms): back-to-back requests find the
# engine's input thread still spinning on the ring, a faster wake than an idle engine's.
GAP_S = 0.0


def http_ttft(url: str, model: str, repeats: int) -> list[float]:
    """TTFT over HTTP/1.1 keep-alive with a bare socket client.

    NOTE: not httpx: its per-request cost (~1 ms here) is the client's, not the server's.
    """
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url)
    body = json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
    ).encode()
    req = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    out = []
    with socket.create_connection((host.hostname, host.port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(repeats + 2):
            time.sleep(GAP_S)
            t0 = time.perf_counter()
            s.sendall(req)
            buf, ttft = b"", None
            while not buf.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of the response
                buf += s.recv(65536)
                if ttft is None and b'"text":"' in buf.replace(b'"text":""', b""):
                    ttft = time.perf_counter() - t0
            if i >= 2:  # warm-up
                out.append(ttft)
    return out


def client_ttft(client, tokens: list[int], repeats: int, inproc: bool) -> list[float]:
    from shm_engine.engine.protocol import EngineCoreRequest
    from shm_engine.sampling_params import SamplingParams

    out = []
    for i in range(repeats + 2):
        req = EngineCoreRequest(
            request_id=f"t{i}",
            prompt_token_ids=np.asarray(tokens, dtype=np.int32),
            sampling_params=SamplingParams(temperature=0, max_tokens=2),
            arrival_time=time.time(),
        )
        time.sleep(GAP_S)
        t0 = time.perf_counter()
        client.add_request(req)
        first = None
        done = False
        while not done:
            o = client.get_output(timeout=30) if not inproc else client.get_output()
            if o is None:
                continue
            if first is None and o.request_ids:
                first = time.perf_counter() - t0
            done = bool(o.finished)
        if i >= 2:
            out.append(first)
    return out


def client_tpot(client, prompts: list[list[int]], output_len: int) -> list[float]:
    """TPOT of each of len(prompts) concurrent requests driven straight through the client."""
    from shm_engine.engine.protocol import EngineCoreRequest
    from shm_engine.sampling_params import SamplingParams

    times: dict[str, list[float]] = {}
    for i, p in enumerate(prompts):
        rid = f"c{i}"
        times[rid] = []
        client.add_request(
            EngineCoreRequest(
                request_id=rid,
                prompt_token_ids=np.asarray(p, dtype=np.int32),
                sampling_params=SamplingParams(
                    temperature=0, max_tokens=output_len, ignore_eos=True
                ),
                arrival_time=time.time(),
            )
        )
    left = len(prompts)
    while left:
        o = client.get_output(timeout=60)
        now = time.perf_counter()
        for row, rid in enumerate(o.request_ids):
            times[rid].append(now)
            left -= row in o.finished
    return [(t[-1] - t[0]) / (output_len - 1) for t in times.values()]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=18765)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of HTTP and rings")
    ap.add_argument("--threads", type=int, default=0, help="engine kernel threads (0: all)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each request")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    global GAP_S
    GAP_S = args.gap_ms / 1e3

    from shm_engine.benchmarks import serve as bench
    from shm_engine.benchmarks.prompts import random_prompts
    from shm_engine.engine.client import InprocClient, SyncMPClient
    from shm_engine.engine.config import EngineConfig
    from shm_engine.model.loader import load_model

    tok = load_model(None).tokenizer
    tokens = tok.encode(PROMPT)
    prompts = random_prompts(args.streams, args.input_len, None, seed=1)
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p, _ in prompts]
    res: dict = {}

    import httpx

    url = f"http://127.0.0.1:{args.port}"
    srv = subprocess.Popen(
        [sys.executable, "-m", "shm_engine.entrypoints.cli", "serve", "--port", str(args.port),
         "--kv-cache-mib", str(args.kv_cache_mib), "--threads", str(args.threads),
         "--log-level", "warning"],
    )  # fmt: skip
    mp = ip = None
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or srv.poll() is not None:
                raise SystemExit("server did not start")
            time.sleep(0.3)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        # A second, idle-when-unused engine driven directly; the two paths alternate so that
        # background load on a shared machine hits both alike.
        cfg = EngineConfig(kv_cache_bytes=args.kv_cache_mib << 20, num_threads=args.threads)
        mp = SyncMPClient(cfg)
        client_tpot(mp, prompt_ids[:2], 4)  # warm-up
        # The in-process engine too, measured in every round: the machine drifts within minutes.
        ip = InprocClient(cfg)
        # NOTE: no full collection over the models and clients loaded above during the timing
        # (one took 75-135 ms in a server-sized heap): every path's figures would take the stall.
        gc.collect()
        gc.freeze()
        bargs = bench.parse_args(
            ["--base-url", url, "--input-len", str(args.input_len),
             "--output-len", str(args.output_len), "--no-progress", "--warmup", "1"]
        )  # fmt: skip
        for k in ("http_ttft_ms", "rings_ttft_ms", "inproc_ttft_ms", "http_tpot_ms",
                  "rings_tpot_ms", "http_tok_s"):  # fmt: skip
            res[k] = []
        res["ttft_overhead_by_round"] = []
        for _ in range(args.rounds):
            http = [1e3 * x for x in http_ttft(url, model, args.repeats)]
            res["http_ttft_ms"] += http
            res["rings_ttft_ms"] += [1e3 * x for x in client_ttft(mp, tokens, args.repeats, False)]
            inproc = [1e3 * x for x in client_ttft(ip, tokens, args.repeats, True)]
            res["inproc_ttft_ms"] += inproc
            res["ttft_overhead_by_round"].append(_p50(http) - _p50(inproc))
            rep = bench.run_async(bench.run_load(bargs, prompts, model, args.streams, float("inf")))
            res["http_tpot_ms"].append(rep["tpot_ms"]["p50"])
            res["http_tok_s"].append(rep["output_tok_s"])
            res["rings_tpot_ms"].append(1e3 * _p50(client_tpot(mp, prompt_ids, args.output_len)))
    finally:
        if ip is not None:
            ip.shutdown()
        if mp is not None:
            mp.shutdown()
        srv.terminate()
        srv.wait(60)
    res["http_tpot_ms_p50"] = statistics.median(res["http_tpot_ms"])
    res["rings_tpot_ms_p50"] = statistics.median(res["rings_tpot_ms"])
    res["http_output_tok_s"] = statistics.median(res["http_tok_s"])
    # Each round's HTTP and rings TPOT (and TTFT) ran seconds apart: their ratio (difference)
    # drifts less than that of the medians over all rounds.
    res["tpot_share_by_round"] = [
        (h - r) / h for h, r in zip(res["http_tpot_ms"], res["rings_tpot_ms"], strict=True)
    ]

    summary = {
        "http_ttft_ms_p50": _p50(res["http_ttft_ms"]),
        "rings_ttft_ms_p50": _p50(res["rings_ttft_ms"]),
        "inproc_ttft_ms_p50": _p50(res["inproc_ttft_ms"]),
        "http_tpot_ms_p50": res["http_tpot_ms_p50"],
        "rings_tpot_ms_p50": res["rings_tpot_ms_p50"],
        "http_output_tok_s": res["http_output_tok_s"],
    }
    summary["frontend_ttft_overhead_ms"] = (
        summary["http_ttft_ms_p50"] - summary["inproc_ttft_ms_p50"]
    )
    summary["frontend_ttft_overhead_ms_paired"] = statistics.median(res["ttft_overhead_by_round"])
    summary["http_vs_rings_ttft_ms"] = summary["http_ttft_ms_p50"] - summary["rings_ttft_ms_p50"]
    summary["http_tpot_share"] = (
        summary["http_tpot_ms_p50"] - summary["rings_tpot_ms_p50"]
    ) / summary["http_tpot_ms_p50"]
    summary["http_tpot_share_paired"] = statistics.median(res["tpot_share_by_round"])
    for k, v in summary.items():
        print(f"{k:<34} {v:10.3f}")
    sd = [statistics.pstdev(res[k]) for k in ("http_ttft_ms", "rings_ttft_ms", "inproc_ttft_ms")]
    print(f"ttft stdev (ms): http {sd[0]:.2f} rings {sd[1]:.2f} inproc {sd[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "raw": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
