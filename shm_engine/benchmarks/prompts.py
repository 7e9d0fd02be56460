"""The prompts a benchmark sends: random token strings of a given length, or a dataset file.

A dataset is read by its file name: .jsonl/.json hold JSON records ({"prompt"|"text": ...}, or
ShareGPT's "conversations"), any other name one prompt a line, verbatim.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import numpy as np


class DatasetError(ValueError):
    """A prompts file that cannot be used, said in one line naming the file (and line)."""


@functools.cache
def _tokenizer(path: str | None) -> Any:
    from shm_engine.model.loader import load_model

    return load_model(path).tokenizer


def random_prompts(
    n: int,
    input_len: int,
    tokenizer_path: str | None,
    seed: int | tuple[int, ...],
    tag: str = "",
) -> list[tuple[str, int]]:
    """``n`` distinct prompts of about ``input_len`` tokens (random tokens, re-encoded to fit).

    With ``tag`` each starts with ``(tag) ``, counted in ``input_len``. Each prompt draws from
    its own generator, all ``input_len`` tokens whatever the tag's size: what follows a tag of
    the same length is then the seed's, whichever nonce the tag holds.
    """
    tok = _tokenizer(tokenizer_path)
    seeds = seed if isinstance(seed, tuple) else (seed,)
    special = set(tok.all_special_ids)
    lo, hi = 300, max(301, tok.vocab_size - 300)  # skip bytes/specials at the ends
    head = f"({tag}) " if tag else ""
    body_len = max(1, input_len - len(tok.encode(head, add_special_tokens=False)))
    prompts = []
    for i in range(n):
        rng = np.random.default_rng((*seeds, i))
        drawn = rng.integers(lo, hi, input_len)[:body_len]
        text = head + tok.decode([int(t) for t in drawn if int(t) not in special])
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


JSON_SUFFIXES = (".jsonl", ".json")


def load_prompt_file(path: str) -> list[str]:
    """The prompts of a dataset file, read by its extension: .jsonl/.json hold JSON, any other
    name one prompt a line, verbatim.

    By name, not by a line's first character: a text prompt may well start with "{" (code), and
    a JSON line without a prompt must be an error, not an empty prompt.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read --dataset-path {path}: {e}") from None
    if path.lower().endswith(JSON_SUFFIXES):
        items = _json_prompts(path, text)
    else:
        items = [line for line in text.split("\n") if line.strip()]
    if not items:
        raise DatasetError(f"{path}: no prompts in the file")
    return items


def _json_prompts(path: str, text: str) -> list[str]:
    """JSON lines, or (ShareGPT's layout) one JSON array of records."""
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON: {e}") from None
        where = [f"{path}: item {i}" for i in range(len(records))]
    else:
        records, where = [], []
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); {'/'.join(JSON_SUFFIXES)} files "
                    "hold one JSON object a line: name a file of text prompts otherwise"
                ) from None
            where.append(f"{path}:{lineno}")
    items, skipped = [], 0
    for record, at in zip(records, where, strict=True):
        prompt = _record_prompt(record, at)
        if prompt is None:
            skipped += 1
        else:
            items.append(prompt)
    if skipped:
        print(f"{path}: skipped {skipped} conversations without a human turn", file=sys.stderr)
    return items


def _record_prompt(record: Any, at: str) -> str | None:
    """A record's prompt: "prompt" or "text", or a ShareGPT record's first human turn (None:
    the conversation has none, as some of ShareGPT's have; vLLM skips those too)."""
    if isinstance(record, dict):
        prompt = record.get("prompt", record.get("text"))
        if isinstance(prompt, str) and prompt.strip():
            return prompt
        if prompt is None and isinstance(record.get("conversations"), list):
            return _first_human_turn(record["conversations"])
    shown = json.dumps(record)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise DatasetError(
        f'{at}: expected an object with a non-empty string "prompt" or "text" (or ShareGPT '
        f'"conversations"), got {shown}'
    )


def _first_human_turn(turns: list[Any]) -> str | None:
    for t in turns:
        if not isinstance(t, dict) or t.get("from") not in ("human", "user"):
            continue
        if isinstance(t.get("value"), str) and t["value"].strip():
            return t["value"]
    return None


def file_prompts(
    path: str, n: int, nonce: str | None = None, items: list[str] | None = None
) -> list[tuple[str, int]]:
    """The prompts of ``path`` (or ``items`` read from it), cycled to ``n``.

    With ``nonce``, each prompt starts with ``(nonce.cycle) ``: a run's prompts, and the repeats
    of a short file within one run, then share no prefix the server may have cached, while the
    prompts of one pass over the file still share the prefixes the dataset gives them.
    """
    if items is None:
        items = load_prompt_file(path)
    if nonce is None:
        return [(items[i % len(items)], 0) for i in range(n)]
    return [(f"({nonce}.{i // len(items)}) {items[i % len(items)]}", 0) for i in range(n)]
