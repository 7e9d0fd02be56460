"""Model benchmark, side by side in one run: the int8 model (native kernels) vs the fp32 torch path.

- GEMM GOP/s for the model's shapes at M = 1, 8, 32, 256 (ours, torch fp32, torch dynamic int8);
- prefill tokens/s of a 512-token prompt;
- decode tokens/s at batch 1, 8, 16, 32 with 128 tokens of context (batch over the median step);
  also for the opt-in int8 activations on kernel path "vnni" (`a8_` keys: W8, smoothed
  weights); where the model's 4-bit layers run on 8-bit activations (W4 x A8, the default
  ``--activation-dtype auto``), also for them on int16 ones (`a16_` keys, exact W4);
  where ``--weight-dtype auto`` (the engine's default) packs layers in 4 bits, also for the
  all-int8 model (`w8_` keys); where it packs W8 on a file's 4-bit layers (path amx, whose
  tiles run W8 only), also for W4 on int16 and on 8-bit activations (`w4_`, `w4a8_` keys);
- peak RSS of a fresh process that loads the model as measured (KV cache excluded).

    python -m benchmarks.bench_model [--json PATH] [--quick] [--kv-cache-dtype int8]
        [--activation-dtype auto|int16|int8] [--weight-dtype auto|int8|int4] [--gemm-ms 300]
        [--model PATH] [--skip-gemm]

``--model`` measures another model (a GGUF file or HF directory; e.g. one of
``benchmarks/random_model.py``'s shapes) instead of the embedded SmolLM2; the GEMM table is
SmolLM2's shapes either way (``--skip-gemm`` leaves it out).

The JSON also records the machine (CPU, kernel path, threads): runs on different days may have
run on different CPUs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from shm_engine.model.batch import BatchInputs
from shm_engine.model.kv_cache import allocate_kv

BLOCK = 16
CONTEXT = 128


def prefill_tok_s(model, config, n_tokens: int, repeats: int) -> float:
    kv = allocate_kv(config, -(-n_tokens // BLOCK), BLOCK, model.kv_dtype)
    tokens = list(range(100, 100 + n_tokens))
    batch = BatchInputs.build([(tokens, 0, n_tokens, list(range(len(kv[0][0]))))], BLOCK, [True])
    model.forward(batch, kv)  # warm-up: scratch buffers, page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.forward(batch, kv)
        times.append(time.perf_counter() - t0)
    return n_tokens / sorted(times)[len(times) // 2]


def decode_tok_s(model, config, batch_size: int, steps: int, context: int = CONTEXT) -> float:
    """Greedy decode of ``batch_size`` sequences, each with ``context`` tokens already cached.

    As in the engine (ModelRunner): each row's argmax comes out of the model call. One untimed
    step first (scratch sized for the batch); then ``batch_size`` over the median step, since
    on a shared 2-core VM a single descheduled step moves a mean by 10-30 %."""
    per_seq = -(-(context + steps + 2) // BLOCK)
    kv = allocate_kv(config, batch_size * per_seq, BLOCK, model.kv_dtype)
    seqs = [list(range(100 + i, 100 + i + context)) for i in range(batch_size)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch_size)]
    greedy = torch.empty(batch_size, dtype=torch.int64)

    def step(start_of: Callable[[list[int]], int]) -> None:
        batch = BatchInputs.build(
            [(s, start_of(s), len(s) - start_of(s), t) for s, t in zip(seqs, tables, strict=True)],
            BLOCK,
            [True] * batch_size,
        )
        model.forward(batch, kv, argmax_out=greedy)
        for s, tok in zip(seqs, greedy.tolist(), strict=True):
            s.append(tok)

    step(lambda s: 0)  # the prompts
    step(lambda s: len(s) - 1)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(lambda s: len(s) - 1)
        times.append(time.perf_counter() - t0)
    return batch_size / statistics.median(times)


def peak_rss_mb(model: str | None = None, weight_dtype: str = "int8") -> float:
    """Peak RSS of a fresh process that loads and packs the model (no KV cache)."""
    code = (
        "import resource\n"
        "from shm_engine.model.loader import load_model\n"
        "from shm_engine.model.int8_model import Int8Llama\n"
        f"m = load_model({model!r})\n"
        f"model = Int8Llama(m.config, m.weights, weight_dtype={weight_dtype!r})\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    ap.add_argument("--skip-fp32", action="store_true", help="only the int8 model")
    ap.add_argument(
        "--kv-cache-dtype", default="fp16", choices=["fp16", "int8"], help="the int8 model's cache"
    )
    ap.add_argument(
        "--activation-dtype",
        default="auto",
        choices=["auto", "int16", "int8"],
        help="the int8 model's activations in its layers, as the engine's option (auto: 8-bit on "
        "4-bit layers; int8: also on int8 layers, path vnni; the other measured beside it)",
    )
    ap.add_argument(
        "--gemm-ms", type=float, default=300.0, help="GEMM table: timing budget a point, ms"
    )
    ap.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", "int8", "int4"],
        help="the layers' weights, as the engine's option (auto: int4 for a GGUF's Q4_0/Q4_1/"
        "Q4_K matrices but on AMX); when auto gives int4, int8 is measured beside it (w8_ keys)",
    )
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    ap.add_argument("--skip-gemm", action="store_true", help="no GEMM table")
    args = ap.parse_args()
    steps = 8 if args.quick else 32
    repeats = 2 if args.quick else 5

    from benchmarks.bench_gemm import format_table, gemm_rows
    from benchmarks.machine import describe, machine_info
    from shm_engine.model.int8_model import Int8Llama, calibration_ids, smooths
    from shm_engine.model.loader import load_model
    from shm_engine.model.torch_model import TorchLlama

    machine = machine_info()
    print(describe(machine))
    results: dict = {
        "machine": machine,
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "peak_rss_mb": peak_rss_mb(args.model, args.weight_dtype),
        "kv_cache_dtype": args.kv_cache_dtype,
        "activation_dtype": args.activation_dtype,
        "weight_dtype": args.weight_dtype,
    }
    print(f"peak RSS holding the int8 model: {results['peak_rss_mb']:.0f} MB")

    # NOTE: not shorter in --quick: with ~7 ms windows our kernel measured about half its
    # standalone GOP/s next to torch's (whose OpenMP threads share the cores).
    if not args.skip_gemm:
        rows = gemm_rows(ms_per_point=args.gemm_ms)
        print(format_table(rows))
        results["gemm"] = [{k: r[k] for k in ("m", "n", "k", "name", "impl", "gops")} for r in rows]

    loaded = load_model(args.model)

    def int8_model(act: str, weight_dtype: str) -> Int8Llama:
        return Int8Llama(
            loaded.config,
            loaded.weights,
            kv_cache_dtype=args.kv_cache_dtype,
            activation_dtype=act,
            # as the engine builds it (model_runner.build_model)
            calibration_ids=(
                calibration_ids(loaded.tokenizer) if smooths(act, weight_dtype) else None
            ),
            weight_dtype=weight_dtype,
        )

    models = {"int8": int8_model(args.activation_dtype, args.weight_dtype)}
    results["weights"] = models["int8"].weight_summary
    print(f"weights: {results['weights']}")
    # 4-bit layers beside the all-int8 model, in the same run
    if any(models["int8"].w4_linears) and args.weight_dtype != "int4":
        models["w8"] = int8_model(args.activation_dtype, "int8")
    # the other activation formats side by side: the opt-in W8 x A8 where the kernel path runs
    # it, and the exact W4 x A16 where the model's 4-bit layers take 8-bit activations
    if args.activation_dtype != "int8" and machine["kernel_path"] == "vnni":
        models["a8"] = int8_model("int8", "int8")
    if args.activation_dtype != "int16" and any(models["int8"].w4_linears):
        models["a16"] = int8_model("int16", args.weight_dtype)
    # NOTE: where `auto` packs W8 on a file's 4-bit layers (path amx: W8 takes the AMX tiles,
    # W4 is not timed there), both 4-bit forms beside it (w4_, w4a8_)
    if (
        args.weight_dtype == "auto"
        and args.activation_dtype != "int8"
        and machine["kernel_path"] == "amx"
        and any(loaded.weights.stored_in_4bit_groups(n) for n in loaded.weights)
    ):
        models["w4"] = int8_model("int16", "int4")
        models["w4a8"] = int8_model("auto", "int4")
    if not args.skip_fp32:
        models["fp32"] = TorchLlama(loaded.config, loaded.weights)
    threads = torch.get_num_threads()
    for name, model in models.items():
        # as in the engine (ModelRunner): one torch thread beside the native pool for int8
        torch.set_num_threads(threads if name == "fp32" else 1)
        prefill = prefill_tok_s(model, loaded.config, 512, repeats)
        decode = {b: decode_tok_s(model, loaded.config, b, steps) for b in (1, 8, 16, 32)}
        key = "" if name == "int8" else f"{name}_"
        results[f"{key}prefill_tok_s"] = prefill
        results[f"{key}decode_tok_s"] = decode
        line = "  ".join(f"b{b} {v:7.1f}" for b, v in decode.items())
        # the engine's model (key "int8") is labelled by its layers' weights and activations
        label = name
        if name == "int8" and any(model.w4_linears):
            label = "w4a8" if model.act8_linears else "w4"
        print(f"{label:5s} prefill(512) {prefill:8.1f} tok/s   decode tok/s: {line}")
    results["bench_process_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
