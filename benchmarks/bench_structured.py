"""What structured outputs cost a decode step: constrained against plain requests, side by side.

    python -m benchmarks.bench_structured [--batch 1 8] [--tokens 96] [--rounds 3] [--json PATH]

One in-process EngineCore on the default model. Each round runs a batch of B requests three
times: plain (``ignore_eos``) and under two JSON schemas, an array of at least 200 strings
("json") and the same with the strings' length bounded ("json-bounded": llguidance's precomputed
token slices no longer apply, the costly case), so no request ends before ``--tokens``; same
prompt and length. Reports the decode tok/s of each (median over rounds), the ratio to plain,
and where the difference goes, per step: the scheduler's time (the masks are computed there)
and the model's (the masks are applied to the logits there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks.machine import describe, machine_info
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.core import EngineCore
from shm_engine.engine.protocol import EngineCoreRequest
from shm_engine.model.loader import load_model_info
from shm_engine.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMAS = {
    "json": {"type": "array", "items": {"type": "string"}, "minItems": 200},
    "json-bounded": {
        "type": "array",
        "items": {"type": "string", "maxLength": 12},
        "minItems": 200,
    },
}
QUESTION = "List many short English words as a JSON array of strings."


def run_batch(core: EngineCore, prompt: np.ndarray, batch: int, params: SamplingParams) -> dict:
    for i in range(batch):
        core.add_request(
            EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params)
        )
    core.step()  # the prefills: not timed
    sched0, model0, steps0 = core.sched_time, core.step_time, core.scheduler.step_count
    tokens = 0
    t0 = time.perf_counter()
    while core.has_work():
        out = core.step()
        tokens += len(out.new_token_ids) if out is not None else 0
        finished = out.finished if out is not None else {}
        if any(reason != "length" for reason in finished.values()):
            raise RuntimeError(f"a request ended early: {finished}")
    wall = time.perf_counter() - t0
    steps = core.scheduler.step_count - steps0
    return {
        "tok_s": tokens / wall,
        "sched_ms_per_step": 1e3 * (core.sched_time - sched0) / steps,
        "model_ms_per_step": 1e3 * (core.step_time - model0) / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    info = load_model_info(None)
    text = info.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt = np.array(info.tokenizer.encode(text), dtype=np.int32)
    core = EngineCore(EngineConfig(max_num_seqs=max(args.batch)))
    params = {"plain": SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)}
    for name, schema in SCHEMAS.items():
        so = StructuredOutputsParams(json=schema)
        params[name] = SamplingParams(
            temperature=0.0, max_tokens=args.tokens, structured_outputs=so
        )
        run_batch(core, prompt, 1, params[name])  # warm-up: the tokenizer's trie, the schema
    print(describe(machine_info()))
    results = []
    for batch in args.batch:
        runs: dict[str, list[dict]] = {kind: [] for kind in params}
        for _ in range(args.rounds):
            for kind, p in params.items():
                runs[kind].append(run_batch(core, prompt, batch, p))
        med = {
            kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for kind, rs in runs.items()
        }
        base = med["plain"]
        for kind, m in med.items():
            m["ratio"] = m["tok_s"] / base["tok_s"]
            print(
                f"batch {batch:3d} {kind:12s} {m['tok_s']:7.1f} tok/s (x{m['ratio']:.3f}); per "
                f"step: scheduler {m['sched_ms_per_step']:.3f} ms, model "
                f"{m['model_ms_per_step']:.2f} ms"
            )
        results.append({"batch": batch, **med})
    core.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
