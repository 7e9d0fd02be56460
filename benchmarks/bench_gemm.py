"""GEMM throughput for the SmolLM2-135M shapes: our int8 kernel vs torch fp32 vs torch dynamic int8.

    python -m benchmarks.bench_gemm [--threads N] [--ms 300] [--json PATH]
    python -m benchmarks.bench_gemm --w4 [--threads 1]   # W8 against W4 on int16 and 8-bit acts

GOP/s counts 2*m*n*k operations per call (multiply + add), including per-call activation
quantisation for the int8 paths.  All implementations run side by side, interleaved, in one process;
each figure is the median over repeated timing windows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable

import torch

from benchmarks.machine import describe, machine_info
from shm_engine.model import kernels

# (name, n, k) for SmolLM2-135M: hidden 576, 9 q / 3 kv heads of 64, FFN 1536, vocab 49152.
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]
MS = [1, 8, 32, 256]
# "ours": the default weight (bf16 activations on AMX from 64 rows); "ours_int16": act_bf16=False,
# the model's down projection (int16 activations everywhere; exact int8 tiles on AMX)
# "ours_a8": act8 weights (8-bit activations, each 32 k rotated), timed only where the VNNI kernel
# runs (paths vnni, amx): elsewhere the portable twin is ~50x slower than int16 and the engine never
# packs act8 weights there
# "ours_w4a8": a 4-bit weight on 8-bit activations (gemm_w4a8.c), what the layers of a GGUF's
# 4-bit matrices run by default (o, gate_up, down; not the LM head); from path avx2 up
IMPLS = ["ours", "ours_int16", "ours_a8", "ours_w4a8", "torch_fp32", "torch_int8_dyn"]
# --w4: the W4 weight on int16 activations and on 8-bit ones (gemm_w4a8.c), beside W8
W4_IMPLS = ["ours", "ours_w4", "ours_w4a8"]


def _make_impls(n: int, k: int, m: int) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    packed = kernels.PackedLinear.from_float(w)
    exact = kernels.PackedLinear.from_float(w, act_bf16=False)
    a8 = kernels.PackedLinear.from_float(w, act8=True)
    w4 = kernels.PackedLinear.from_float(w, w4=True)
    w4a8 = kernels.PackedLinear.from_float(w, w4=True, act8=True)
    out = torch.empty(m, n)
    wt = w.t().contiguous()  # torch fp32: x @ W^T with a pre-transposed weight (its best case)
    fp_out = torch.empty(m, n)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    qlin = torch.ao.nn.quantized.dynamic.Linear(k, n, bias_=False, dtype=torch.qint8)
    qlin.set_weight_bias(torch.quantize_per_channel(w, w.abs().amax(1) / 127, torch.zeros(n, dtype=torch.long), 0, torch.qint8), None)  # fmt: skip
    return {
        "ours": lambda: kernels.linear(x, packed, out),
        "ours_int16": lambda: kernels.linear(x, exact, out),
        "ours_a8": lambda: kernels.linear(x, a8, out),
        "ours_w4": lambda: kernels.linear(x, w4, out),
        "ours_w4a8": lambda: kernels.linear(x, w4a8, out),
        "torch_fp32": lambda: torch.matmul(x, wt, out=fp_out),
        "torch_int8_dyn": lambda: qlin(x),
    }


def _time(fn: Callable[[], object], window_s: float) -> float:
    """Seconds per call over one window (calls repeated until window_s has elapsed)."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if el >= window_s:
            return el / n


def gemm_rows(
    ms: Iterable[int] = MS,
    shapes: Iterable[tuple[str, int, int]] = SHAPES,
    impls: Iterable[str] | None = None,
    ms_per_point: float = 300.0,
    windows: int = 5,
) -> list[dict]:
    """Benchmark every (shape, m, impl); returns [{m, n, k, name, impl, gops, us}]. impls
    (default IMPLS, less the 8-bit kernels whose path here is the slow portable twin)."""
    level = kernels.PATHS[kernels.get_path()]
    if impls is None:
        impls = [i for i in IMPLS if i != "ours_w4a8" or level >= kernels.PATHS["avx2"]]
    impls = list(impls)
    if level < kernels.PATHS["vnni"]:
        impls = [i for i in impls if i != "ours_a8"]
    rows = []
    for name, n, k in shapes:
        for m in ms:
            fns = {i: f for i, f in _make_impls(n, k, m).items() if i in impls}
            for f in fns.values():  # warm-up (page faults, pool start, fbgemm packing)
                for _ in range(3):
                    f()
            samples = {i: [] for i in fns}
            win = ms_per_point / 1000.0 / windows / len(fns)
            with torch.no_grad():
                for _ in range(windows):  # interleave the implementations
                    for i, f in fns.items():
                        # NOTE: torch's libgomp workers spin for milliseconds after a parallel
                        # op; a pause lets them park so no window starts on contended cores.
                        time.sleep(0.02)
                        samples[i].append(_time(f, win))
            for i in fns:
                s = statistics.median(samples[i])
                rows.append(
                    {"m": m, "n": n, "k": k, "name": name, "impl": i,
                     "gops": 2.0 * m * n * k / s / 1e9, "us": s * 1e6}
                )  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    by = {(r["name"], r["m"], r["impl"]): r for r in rows}
    keys = sorted(
        {(r["name"], r["n"], r["k"], r["m"]) for r in rows},
        key=lambda x: (SHAPES_ORDER.get(x[0], 99), x[3]),
    )
    head = f"{'shape':<8} {'n':>6} {'k':>5} {'m':>4} | {'ours':>8} {'int16':>8} {'a8':>8} {'w4a8':>8} {'fp32':>8} {'int8dyn':>8} | {'vs int8':>7} {'a8 vs':>7} {'w4a8 vs':>7} {'vs fp32':>7} | {'ours us':>8}"
    lines = [head, "-" * len(head)]
    for name, n, k, m in keys:
        o = by.get((name, m, "ours"))
        e = by.get((name, m, "ours_int16"))
        a = by.get((name, m, "ours_a8"))
        w4 = by.get((name, m, "ours_w4a8"))
        f = by.get((name, m, "torch_fp32"))
        q = by.get((name, m, "torch_int8_dyn"))

        def g(r):
            return f"{r['gops']:8.1f}" if r else f"{'-':>8}"

        rq = f"{o['gops'] / q['gops']:6.2f}x" if o and q else f"{'-':>7}"
        rf = f"{o['gops'] / f['gops']:6.2f}x" if o and f else f"{'-':>7}"
        ra = f"{a['gops'] / q['gops']:6.2f}x" if a and q else f"{'-':>7}"
        rw = f"{w4['gops'] / q['gops']:6.2f}x" if w4 and q else f"{'-':>7}"
        us = f"{o['us']:8.1f}" if o else f"{'-':>8}"
        lines.append(
            f"{name:<8} {n:>6} {k:>5} {m:>4} | {g(o)} {g(e)} {g(a)} {g(w4)} {g(f)} {g(q)} | {rq} {ra} {rw} {rf} | {us}"
        )
    return "\n".join(lines)


SHAPES_ORDER = {s[0]: i for i, s in enumerate(SHAPES)}


def format_w4_table(rows: list[dict]) -> str:
    """GOP/s of W8, W4 on int16 activations and W4 x A8, and the last over the second."""
    by = {(r["name"], r["m"], r["impl"]): r["gops"] for r in rows}
    keys = sorted({(r["name"], r["n"], r["k"], r["m"]) for r in rows}, key=lambda x: (SHAPES_ORDER.get(x[0], 99), x[3]))  # fmt: skip
    head = f"{'shape':<8} {'n':>6} {'k':>5} {'m':>4} | {'W8':>7} {'W4':>7} {'W4xA8':>7} | {'W4xA8/W4':>8}"
    lines = [head, "-" * len(head)]
    for name, n, k, m in keys:
        w8, w4, a8 = (by[(name, m, i)] for i in W4_IMPLS)
        lines.append(
            f"{name:<8} {n:>6} {k:>5} {m:>4} | {w8:7.1f} {w4:7.1f} {a8:7.1f} | {a8 / w4:7.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="threads for ours and torch (default: all)"
    )
    ap.add_argument(
        "--ms", type=float, default=300.0, help="timing budget per (shape, m) point, ms"
    )
    ap.add_argument("--m", type=int, nargs="*", default=MS, help="batch sizes (rows)")
    ap.add_argument("--json", type=str, default=None, help="write [{m, n, k, impl, gops}] here")
    ap.add_argument(
        "--w4", action="store_true", help="W8 against W4 on int16 and on 8-bit activations"
    )
    args = ap.parse_args(argv)
    if args.threads:
        kernels.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    print(describe(machine_info()))
    if args.w4:
        shapes = [s for s in SHAPES if s[0] != "lm_head"]  # the LM head stays W8
        rows = gemm_rows(ms=args.m, shapes=shapes, impls=W4_IMPLS, ms_per_point=args.ms)
        print(format_w4_table(rows))
    else:
        rows = gemm_rows(ms=args.m, ms_per_point=args.ms)
        print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [{k: r[k] for k in ("m", "n", "k", "impl", "gops")} for r in rows], f, indent=1
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
