"""Start-up benchmark: how long until a fresh `LLM()` on the default model can answer.

Each run is a fresh Python process (as a CLI call, a restarted appliance or a test is), the
files in the page cache after the first: it times importing the API, `LLM()` (the frontend's
config and tokenizer, the engine process's spawn, imports, weight loading and packing, KV cache
allocation, handshake), the first `generate` of 8 tokens and `shutdown()`, and records the
frontend's peak RSS. Medians over the runs, and every run, go to the report.

    python -m benchmarks.bench_startup [--runs 5] [--serve] [--json PATH]

``--serve`` also times, in each run, a fresh ``shm-engine serve`` from its launch to the first
``/health`` answering 200 (``serve_ready_s``; the server is stopped again).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

from benchmarks.machine import cpu_model

# NOTE: a -c script, not this module, so a run measures whichever shm_engine PYTHONPATH names
# (an A/B of two checkouts) and imports nothing but the API it times.
_CHILD = """
import json, sys, time
def peak_rss_mb():
    # NOTE: VmHWM, not ru_maxrss, which keeps the forking parent's peak across exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
t0 = time.perf_counter()
from shm_engine import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(**json.loads(sys.argv[1]))
t2 = time.perf_counter()
llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
             use_tqdm=False)
t3 = time.perf_counter()
llm.shutdown()
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "llm_init_s": t2 - t1, "first_generate_s": t3 - t2,
                  "shutdown_s": t4 - t3, "torch_in_frontend": "torch" in sys.modules,
                  "frontend_peak_rss_mb": peak_rss_mb()}))
"""

_KEYS = ("import_s", "llm_init_s", "first_generate_s", "shutdown_s", "frontend_peak_rss_mb")


def one_run(engine_args: dict) -> dict:
    # NOTE: run from "/": a -c script puts its working directory first on sys.path, where a
    # checkout would shadow the shm_engine that PYTHONPATH or the installation names.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(engine_args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    if done.returncode != 0:
        raise RuntimeError(f"start-up run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def serve_ready_s(engine_args: dict, timeout: float = 300.0) -> float:
    """Launch to the first 200 from /health of a fresh ``shm-engine serve`` (stopped after)."""
    with socket.socket() as sock:  # a free port (released again just before serve binds it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = [f"--weight-dtype={engine_args['weight_dtype']}"] if engine_args else []
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shm_engine.entrypoints.cli", "serve", "--port", str(port),
         "--log-level", "warning", *flags],
        cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"serve did not come up: {proc.stderr.read()[-2000:]!r}")
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--weight-dtype", default=None, choices=["auto", "int8", "int4"], help="LLM(weight_dtype=)"
    )
    ap.add_argument("--serve", action="store_true", help="also time `shm-engine serve`")
    args = ap.parse_args()
    engine_args = {"weight_dtype": args.weight_dtype} if args.weight_dtype else {}
    print(f"# {cpu_model()}, {len(os.sched_getaffinity(0))} cores, {args.runs} runs")
    one_run(engine_args)  # the files into the page cache
    runs = []
    for _ in range(args.runs):
        runs.append(one_run(engine_args))
        if args.serve:  # alternated with LLM(): the machine's phases hit both alike
            runs[-1]["serve_ready_s"] = serve_ready_s(engine_args)
    keys = _KEYS + (("serve_ready_s",) if args.serve else ())
    medians = {k: statistics.median(r[k] for r in runs) for k in keys}
    for k in keys:
        unit = "MB" if k.endswith("_mb") else "s"
        every = " ".join(f"{r[k]:.2f}" for r in runs)
        print(f"{k:22s} median {medians[k]:7.2f} {unit}   runs: {every}")
    print(f"torch imported in the frontend: {runs[-1]['torch_in_frontend']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": {"cpu": cpu_model()}, "median": medians, "runs": runs}, f, indent=1
            )


if __name__ == "__main__":
    main()
