"""Start-up benchmark: how long until a fresh `LLM()` on the default model can answer.

Each run is a fresh Python process (as a CLI call, a restarted appliance or a test is), the
files in the page cache after the first: it times importing the API, `LLM()` (the frontend's
config and tokenizer, the engine process's spawn, imports, weight loading and packing, KV cache
allocation, handshake), the first `generate` of 8 tokens and `shutdown()`, and records the
frontend's peak RSS. Medians over the runs, and every run, go to the report.

    python -m benchmarks.bench_startup [--runs 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--weight-dtype", default=None, choices=["auto", "int8", "int4"], help="LLM(weight_dtype=)"
    )
    args = ap.parse_args()
    engine_args = {"weight_dtype": args.weight_dtype} if args.weight_dtype else {}
    print(f"# {cpu_model()}, {len(os.sched_getaffinity(0))} cores, {args.runs} runs")
    one_run(engine_args)  # the files into the page cache
    runs = [one_run(engine_args) for _ in range(args.runs)]
    medians = {k: statistics.median(r[k] for r in runs) for k in _KEYS}
    for k in _KEYS:
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
