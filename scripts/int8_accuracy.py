"""How close is each int8 configuration of the real model to the fp32 reference?

What decides whether 8-bit activations could become the default, measured the way the tests
measure it and a little more: on the four evaluation texts, the mean KL divergence of the
next-token distributions from fp32's and the teacher-forced top-1 agreement (pooled, and on the
text the tests hold to 98 %); on chat inputs (questions no test uses, in the chat template,
each followed by fp32's greedy answer, teacher-forced), KL and top-1; and whether 16 greedy
tokens of the tests' three prompts match fp32's.

    python scripts/int8_accuracy.py              # W8 and W4 layers, int16 and int8 activations
    python scripts/int8_accuracy.py --portable-a8  # smoothed W8 x A8 on a CPU without VNNI

The configurations: W8 layers on int16 activations; the same smoothed on 8-bit ones (gemm_a8.c);
the layers a GGUF holds in 4 bits packed so (``weight_dtype="int4"``) on int16 activations, and
on 8-bit ones for o, gate_up and down (gemm_w4a8.c).

``--portable-a8`` packs the 8-bit layers whatever the kernel path (Int8Llama only does so on
path "vnni"): below VNNI they run on the portable twin, which gives the VNNI kernel's bits.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from shm_engine.model import kernels
from shm_engine.model.batch import BatchInputs
from shm_engine.model.eval_texts import EVAL_TEXTS
from shm_engine.model.int8_model import Int8Llama, calibration_ids
from shm_engine.model.kv_cache import allocate_kv
from shm_engine.model.loader import load_model
from shm_engine.model.reference import ReferenceModel

BLOCK = 16
CHAT_QUESTIONS = (
    "How do I sort a list of dictionaries by a key in Python?",
    "Explain the difference between a process and a thread.",
    "Write a haiku about the sea.",
    "What are the main causes of inflation?",
    "Give me three tips for a job interview.",
    "Translate 'good morning' into Spanish and French.",
)


def teacher_forced(model: Int8Llama, config, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Logits of every position, prefilled in chunks of 64 over a paged cache."""
    table = list(range(-(-len(ids) // BLOCK) + 1))
    kv = allocate_kv(config, len(table), BLOCK, model.kv_dtype)
    out, start = [], 0
    while start < len(ids):
        n = min(64, len(ids) - start)
        inputs = BatchInputs.build([(ids, start, n, table)], BLOCK, [True])
        inputs.logits_indices = torch.arange(inputs.num_tokens)
        out.append(model.forward(inputs, kv))
        start += n
    return torch.cat(out)


def greedy(model: Int8Llama, config, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    seq, start = list(ids), 0
    table = list(range(-(-(len(ids) + n) // BLOCK) + 1))
    kv = allocate_kv(config, len(table), BLOCK, model.kv_dtype)
    for _ in range(n):
        inputs = BatchInputs.build([(seq, start, len(seq) - start, table)], BLOCK, [True])
        start = len(seq)
        seq.append(int(model.forward(inputs, kv).argmax(-1)))
    return seq[len(ids) :]


def closeness(model, ref, config, seqs: list[list[int]]) -> tuple[float, float]:  # noqa: ANN001
    """(mean KL(fp32 || model), top-1 agreement) over every position of the sequences."""
    kl = agree = total = 0
    for ids in seqs:
        want, got = ref.forward(torch.tensor(ids)), teacher_forced(model, config, ids)
        kl += float(
            F.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="sum")
        )
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    return kl / total, agree / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    ap.add_argument("--portable-a8", action="store_true", help="8-bit layers on any kernel path")
    args = ap.parse_args()
    loaded = load_model(args.model)
    config, tok = loaded.config, loaded.tokenizer
    ref = ReferenceModel(config, loaded.weights)
    texts = [tok.encode(t) for t in EVAL_TEXTS]
    chats = []
    for q in CHAT_QUESTIONS:
        ids = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False
        )
        chats.append(ids + ref.generate_greedy(ids, 24))
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):"),
        tok.encode(chat, add_special_tokens=False),
    ]
    wanted = [ref.generate_greedy(p, 16) for p in prompts]
    print(
        f"kernel path {kernels.get_path()}; texts: {sum(map(len, texts))} tokens, chats: {sum(map(len, chats))}"
    )
    for name, act, weights, calib in (
        ("W8 x A16", "int16", "int8", None),
        ("W8 x A8 smoothed", "int8", "int8", calibration_ids(tok)),
        ("W4 x A16", "int16", "int4", None),
        ("W4 x A8", "int8", "int4", None),
    ):
        path = kernels.get_path
        if args.portable_a8 and weights == "int8":
            kernels.get_path = lambda: "vnni"
        try:
            model = Int8Llama(
                config,
                loaded.weights,
                activation_dtype=act,
                calibration_ids=calib,
                weight_dtype=weights,
            )
        finally:
            kernels.get_path = path
        kl, agree = closeness(model, ref, config, texts)
        _, first = closeness(model, ref, config, texts[:1])
        ckl, cagree = closeness(model, ref, config, chats)
        same = [
            "same" if greedy(model, config, p, 16) == w else "differs"
            for p, w in zip(prompts, wanted, strict=True)
        ]
        print(
            f"{name:17s} texts KL {kl:.5f} top-1 {agree:.4f} (tests' text {first:.4f}) | "
            f"chats KL {ckl:.5f} top-1 {cagree:.4f} | greedy {' '.join(same)}",
            flush=True,
        )
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
