"""Engine benchmark: the multi-process engine (client <-> rings <-> engine) on the default model.

Measures, in one run:
- TTFT of a 35-token prompt on an idle engine (client add_request -> first token received);
- aggregate decode throughput and TPOT at 16 concurrent requests, next to the model runner alone
  (Int8Llama forward + greedy sampling on the same batch shape, in this process);
- offline throughput: 64 requests of 128 prompt + 128 output tokens;
- the share of engine step time spent in IPC (encode + ring + decode of the step's real output
  messages, replayed through a channel) and in scheduling + output processing (engine timers).

    python -m benchmarks.bench_engine [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks.machine import describe, machine_info
from shm_engine.engine.client import SyncMPClient
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.protocol import EngineCoreRequest
from shm_engine.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int, seed: int) -> EngineCoreRequest:
    rng = np.random.default_rng(seed)
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=rng.integers(100, 40000, prompt_len, dtype=np.int32),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        arrival_time=time.time(),
    )


def run_batch(client: SyncMPClient, reqs: list[EngineCoreRequest], keep_outputs: bool = False):
    """Submit all, wait for all; returns (wall seconds, per-request token times, raw outputs)."""
    times: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    submitted = time.perf_counter()
    for r in reqs:
        client.add_request(r)
    left = len(reqs)
    kept = []
    while left:
        out = client.get_output(timeout=60)
        if out is None:
            raise RuntimeError("engine stalled")
        now = time.perf_counter()
        if keep_outputs:
            kept.append(out)
        for row, rid in enumerate(out.request_ids):
            times[rid].append(now)
            if row in out.finished:
                left -= 1
    return time.perf_counter() - submitted, submitted, times, kept


def tpot_ms(times: dict[str, list[float]]) -> list[float]:
    return [1e3 * (t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]


def ipc_cost_per_message(outputs) -> float:
    """Seconds to encode, pass through a ring and decode one real step output (median)."""
    from shm_engine.engine.protocol import EngineMessage
    from shm_engine.ipc import channel_pair

    a, b = channel_pair(recv_type_b=EngineMessage)
    costs = []
    for _ in range(5):
        for out in outputs:
            t0 = time.perf_counter()
            a.send(out)
            b.recv(timeout=5)
            costs.append(time.perf_counter() - t0)
    a.close()
    b.close()
    return statistics.median(costs)


def runner_alone_tok_s(batch: int, context: int, steps: int) -> float:
    """Int8Llama decode on a fixed batch in this process: the ceiling for the engine."""
    from benchmarks.bench_model import decode_tok_s
    from shm_engine.model.int8_model import Int8Llama
    from shm_engine.model.loader import load_model

    loaded = load_model(None)
    model = Int8Llama(loaded.config, loaded.weights, weight_dtype="auto")  # as the engine
    return decode_tok_s(model, loaded.config, batch, steps, context)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--quick", action="store_true", help="smaller workloads")
    args = ap.parse_args()
    n_out = 32 if args.quick else 128
    n_offline = 16 if args.quick else 64

    config = EngineConfig(kv_cache_bytes=1 << 30, max_num_seqs=64, max_num_batched_tokens=1024)
    results: dict[str, float] = {}
    with SyncMPClient(config) as client:
        # Warm-up (page in weights, grow scratch buffers).
        run_batch(client, [make_request("w", 64, 4, 0)])

        ttfts = []
        for i in range(10):
            wall, submitted, times, _ = run_batch(client, [make_request(f"t{i}", 35, 1, i)])
            ttfts.append(1e3 * (times[f"t{i}"][0] - submitted))
        results["ttft_ms_p50"] = statistics.median(ttfts)

        reqs = [make_request(f"d{i}", 32, n_out, 100 + i) for i in range(16)]
        wall, _, times, outs16 = run_batch(client, reqs, keep_outputs=True)
        results["decode16_tok_s"] = 16 * n_out / wall
        results["tpot_ms_p50"] = statistics.median(tpot_ms(times))

        client.call_utility("reset_prefix_cache")
        t0 = client.call_utility("get_timing")
        reqs = [make_request(f"o{i}", 128, n_out, 1000 + i) for i in range(n_offline)]
        wall, _, times, _ = run_batch(client, reqs)
        t1 = client.call_utility("get_timing")
        results["throughput_tok_s"] = n_offline * n_out / wall

        # Shares of engine step time, at 32 concurrent decodes.
        reqs = [make_request(f"s{i}", 32, n_out, 2000 + i) for i in range(32)]
        t2 = client.call_utility("get_timing")
        wall, _, times, outs32 = run_batch(client, reqs, keep_outputs=True)
        t3 = client.call_utility("get_timing")
    steps = max(1, t3["steps"] - t2["steps"])
    step_s = (t3["model_s"] - t2["model_s"] + t3["sched_s"] - t2["sched_s"]) / steps
    decode_outs = [o for o in outs32 if len(o.request_ids) == 32]
    ipc_s = ipc_cost_per_message(decode_outs or outs32)
    results["ipc_us_per_step"] = ipc_s * 1e6
    results["step_ms"] = step_s * 1e3
    results["ipc_share"] = ipc_s / step_s
    results["sched_share"] = (t3["sched_s"] - t2["sched_s"]) / (
        t3["model_s"] - t2["model_s"] + t3["sched_s"] - t2["sched_s"]
    )
    results["offline_sched_share"] = (t1["sched_s"] - t0["sched_s"]) / max(
        1e-9, t1["model_s"] - t0["model_s"] + t1["sched_s"] - t0["sched_s"]
    )
    results["runner_alone_decode16_tok_s"] = runner_alone_tok_s(16, 32, min(n_out, 64))
    results["engine_vs_runner_decode16"] = (
        results["decode16_tok_s"] / results["runner_alone_decode16_tok_s"]
    )

    width = max(map(len, results))
    for k, v in results.items():
        print(f"{k:<{width}}  {v:10.3f}")
    machine = machine_info()
    print(describe(machine))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
