"""Speculative decoding by n-gram lookup against plain decoding, batch 1, side by side.

    python -m benchmarks.bench_speculative [--configs 0 2 4:3:5] [--temperature T] [--json PATH]

Each config (k, or k:min:max for num_speculative_tokens:prompt_lookup_min:prompt_lookup_max;
the first is the baseline) gets an engine process of its own, all started at once; every prompt
then runs on each engine in turn, round after round, so a slow phase of the machine hits all of
them alike. Reports each prompt's tok/s (median over rounds, prefill included), the whole set's,
its ratio to the baseline, drafts accepted, and whether the tokens equal the baseline's (they
must: greedy, or with `--temperature`, sampled with a seed per prompt). The prompts are chat
turns, four whose answers copy the prompt (the case the method is for) and two that do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.machine import describe, machine_info
from shm_engine import LLM, SamplingParams

PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the next fiscal year. After a long "
    "discussion, the members agreed to increase funding for public libraries and to reduce "
    "spending on administrative travel. The final report will be published next month."
)
CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
"""
PROMPTS = [
    f"Repeat the following paragraph word for word:\n\n{PARAGRAPH}",
    "Fix the spelling in this paragraph and return it in full:\n\n"
    + PARAGRAPH.replace("committee", "comittee").replace("libraries", "libaries"),
    f"Add a docstring to each function and return the whole code:\n\n{CODE}",
    f"Rename the variable total to acc in this code and return all of it:\n\n{CODE}",
    "What is the capital of France?",
    "Write a short poem about the sea.",
]


def parse_config(text: str) -> tuple[int, int, int]:
    """ "k", "k:min" or "k:min:max" (EngineConfig's defaults for what is left out)."""
    parts = [int(x) for x in text.split(":")]
    if not 1 <= len(parts) <= 3:
        raise argparse.ArgumentTypeError(f"expected k[:min[:max]], got {text!r}")
    k, lo, hi = parts + [2, 4][len(parts) - 1 :]
    return k, lo, hi


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", type=parse_config, default=["0", "2", "4"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seeded")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    configs = [c if isinstance(c, tuple) else parse_config(c) for c in args.configs]
    print(describe(machine_info()))
    llms = {
        c: LLM(num_speculative_tokens=c[0], prompt_lookup_min=c[1], prompt_lookup_max=c[2])
        for c in configs
    }
    try:
        tok = next(iter(llms.values())).get_tokenizer()
        chats = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in PROMPTS
        ]
        params = [
            SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens)
            for i in range(len(chats))
        ]
        for llm in llms.values():  # warm-up
            llm.generate(chats[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        times = {c: [[] for _ in PROMPTS] for c in configs}
        tokens: dict = {c: [[] for _ in PROMPTS] for c in configs}
        for _ in range(args.rounds):
            for i, chat in enumerate(chats):
                for c, llm in llms.items():
                    t0 = time.perf_counter()
                    out = llm.generate([chat], params[i], use_tqdm=False)[0]
                    times[c][i].append(time.perf_counter() - t0)
                    tokens[c][i] = out.outputs[0].token_ids
        stats = {c: llm.get_stats() for c, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.shutdown()
    base = configs[0]
    rows = []
    for c in configs:
        med = [statistics.median(t) for t in times[c]]
        total = sum(map(len, tokens[c])) / sum(med)
        rows.append(
            {
                "num_speculative_tokens": c[0], "prompt_lookup_min": c[1],
                "prompt_lookup_max": c[2],
                "tok_s": [len(t) / m for t, m in zip(tokens[c], med, strict=True)],
                "all_tok_s": total,
                "draft_tokens": stats[c].spec_draft_tokens,
                "accepted_tokens": stats[c].spec_accepted_tokens,
                "same_tokens": tokens[c] == tokens[base],
            }
        )  # fmt: skip
    ref = rows[0]["all_tok_s"]
    print(f"tokens per prompt: {[len(t) for t in tokens[base]]}")
    for r in rows:
        per = " ".join(f"{x:6.1f}" for x in r["tok_s"])
        acc = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
        print(
            f"k={r['num_speculative_tokens']} n={r['prompt_lookup_min']}..{r['prompt_lookup_max']}"
            f": tok/s {per} | all {r['all_tok_s']:6.1f} x{r['all_tok_s'] / ref:.2f}"
            f" | drafts right {acc:.0%} | same tokens {r['same_tokens']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "rows": rows}, f, indent=2)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
