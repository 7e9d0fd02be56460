"""Tokenizer built from GGUF metadata: round trips, known ids, chat template, streaming detokenizer."""

from __future__ import annotations

import random

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm_engine.model.loader import LoadedModel
from shm_engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

from .conftest import tiny_tokenizer_metadata

TEXTS = [
    "The capital of France is Paris.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\tindented\r\n",
    "digits 1234567890 and 3.14159",
    "unicode: héllo wörld, 日本語のテキスト, emoji 🎉👩‍👩‍👧, ∑∫√",
    "code: def f(x):\n    return x**2  # comment",
    "",
]


@pytest.fixture(scope="module")
def tok(smollm: LoadedModel) -> Tokenizer:
    return smollm.tokenizer


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_token_ids_match_vocab(tok: Tokenizer) -> None:
    # ids 0-2 of SmolLM2's vocabulary are its control tokens (GGUF token list, token_type 3)
    assert tok.vocab_size == 49152
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
    ]
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [
        1,
        tok.token_to_id("user"),
        tok.token_to_id("Ċ"),  # byte-level "\n"
        tok.token_to_id("hi"),
        2,
    ]
    assert tok.decode([1, 2]) == ""  # special tokens skipped by default
    assert tok.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"


def test_known_pieces(tok: Tokenizer) -> None:
    # GPT-2 byte-level BPE: a leading space becomes "Ġ" and is glued to the next word
    ids = tok.encode("The capital of France is")
    assert [tok.id_to_token(i) for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    assert ids == [504, 3575, 282, 4649, 314]
    # SmolLM's pre-tokenizer splits digits one by one (tokenizer.ggml.pre = "smollm")
    assert [tok.id_to_token(i) for i in tok.encode("x 2024")] == ["x", "Ġ", "2", "0", "2", "4"]
    assert tok.add_bos_token is False and tok.encode("hi")[0] != tok.bos_token_id


def test_chat_template_injects_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_chat_template_keeps_given_system_prompt(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_is_sandboxed(tok: Tokenizer) -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="nope"):
        tok.apply_chat_template([], chat_template="{{ raise_exception('nope') }}")


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], prompt: list[int]) -> str:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out, pos, k = [], 0, 0
    while pos < len(ids):
        n = chunks[k % len(chunks)]
        out.append(detok.add(ids[pos : pos + n]))
        pos += n
        k += 1
        assert "".join(out) == detok.output_text
    out.append(detok.flush())
    return "".join(out)


@settings(max_examples=60, deadline=None)
@given(
    # SmolLM2's vocabulary lacks a few control bytes (e.g. 0x1d), which BPE then drops: no Cc
    text=st.text(
        alphabet=st.one_of(
            st.characters(blacklist_categories=("Cs", "Cc"), max_codepoint=0x1FAFF),
            st.sampled_from("\n\t "),
        ),
        max_size=40,
    ),
    chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_incremental_detokenizer_matches_full_decode(
    tok: Tokenizer, text: str, chunks: list[int]
) -> None:
    ids = tok.encode(text)
    assert _stream(tok, ids, chunks, prompt=tok.encode("Hello")) == tok.decode(ids) == text


def test_incremental_detokenizer_random_ids(tok: Tokenizer) -> None:
    # random ids include lone UTF-8 continuation / lead bytes and special tokens
    rng = random.Random(0)
    byte_ids = [i for i in range(tok.vocab_size) if len(tok.id_to_token(i) or "") == 1]
    for _ in range(30):
        ids = [
            rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randrange(1, 40))
        ]
        assert _stream(tok, ids, [rng.randrange(1, 4)], prompt=[]) == tok.decode(ids)


def test_incremental_detokenizer_holds_partial_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1  # the emoji's 4 bytes span several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"


def test_tiny_gguf_tokenizer_and_hf_round_trip(tmp_path) -> None:  # noqa: ANN001
    tok = Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata())
    ids = tok.encode(" the an 42<|im_end|>")
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces == ["Ġthe", "Ġan", "Ġ", "4", "2", "<|im_end|>"]
    tok.save_hf(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
    assert back.eos_token_ids == tok.eos_token_ids and back.bos_token_id == tok.bos_token_id
    assert back.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sentencepiece_gguf_tokenizer() -> None:
    """Llama-2 style (tokenizer.ggml.model = llama): scores drive merges, bytes fall back."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "a", "b", "ab", "▁a", "▁ab"]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    types = [2, 3, 3] + [6] * 256 + [1] * 6
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode("ab ab")
    assert ids == [1, pieces.index("▁ab"), pieces.index("▁ab")]
    assert tok.decode(ids) == "ab ab"
    ids = tok.encode("a\n")  # "\n" is not a piece: byte fallback
    assert ids == [1, pieces.index("▁a"), pieces.index("<0x0A>")]
    assert tok.decode(ids) == "a\n"
    assert tok.encode("b", add_special_tokens=False) == [pieces.index("▁"), pieces.index("b")]
