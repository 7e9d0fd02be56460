"""Tokenizer built from GGUF metadata: round trips, known ids, chat template, streaming detokenizer."""

from __future__ import annotations

import json
import logging
import random
import unicodedata
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

from shm_engine.model.loader import LoadedModel
from shm_engine.model.tokenizer import _DEEPSEEK_LLM_PATTERNS, IncrementalDetokenizer, Tokenizer

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
    # <|im_end|> is EOS; <|endoftext|> also ends generation, as llama.cpp reads the file
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0) and tok.eos_token == "<|im_end|>"
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


def test_chat_content_parts_render_as_vllm_renders_them(tok: Tokenizer) -> None:
    """A template that takes a string gets the parts joined by newlines; one that loops over
    message content gets the parts (vLLM's "string" and "openai" content formats); absent
    content renders as no text."""
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    as_parts = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert as_parts == tok.apply_chat_template([{"role": "user", "content": "Hi\nthere"}])
    # Lists become parts, strings stay strings (as transformers passes them): Mistral Small
    # 3.x's template loops over user content but adds system and assistant content as strings.
    loops = (
        "{% for m in messages %}[{{ m.role }}]{% if m['content'] is string %}{{ m.content }}"
        "{% else %}{% for p in m['content'] %}({{ p.text }}){% endfor %}{% endif %}{% endfor %}"
    )
    msgs = [{"role": "user", "content": parts}, {"role": "user", "content": "Yo"},
            {"role": "assistant", "content": None}]  # fmt: skip
    rendered = tok.apply_chat_template(msgs, chat_template=loops)
    assert rendered == "[user](Hi)(there)[user]Yo[assistant]"
    no_text = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    assert tok.apply_chat_template(no_text, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<|im_end|>\n"
    )
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


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


def test_chat_template_tojson_takes_transformers_arguments(tok: Tokenizer) -> None:
    template = "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}"
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], chat_template=template)
    assert out == '{"content":"é","role":"user"}'


def test_an_hf_dir_without_tokenizer_json_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


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


# ---------------------------------------------------------------- GGUF pre-tokenizers (llama.cpp)
PRE_TEXT = "Total: 12345 items\n\n  HELLO'S world, it's camelCase x[y\r\nÉté 北京"
LLAMA3_PIECES = ["Total", ":", " ", "123", "45", " items", "\n\n", " ", " HELLO", "'S", " world"]
LLAMA3_PIECES += [",", " it", "'s", " camelCase", " x", "[y", "\r\n", "Été", " 北京"]
QWEN2_PIECES = LLAMA3_PIECES[:3] + ["1", "2", "3", "4", "5"] + LLAMA3_PIECES[5:]


def _tiny_tok(pre: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata(pre))


def _pre_pieces(pre: str, text: str = PRE_TEXT) -> list[str]:
    """The pre-tokenizer's pieces of `text` (as text, before the byte-level mapping)."""
    tok = _tiny_tok(pre)
    assert tok.backend.pre_tokenizer is not None
    return [text[a:b] for _, (a, b) in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("deepseek-r1-qwen", "qwen2"),
        ("megrez", "qwen2"),
        ("kormo", "qwen2"),
        ("llama3", "llama-bpe"),
        ("midm-2.0", "llama-bpe"),
        ("phi-2", "gpt-2"),
        ("mellum", "gpt-2"),
        ("llama-v3", "llama-bpe"),
        ("falcon3", "llama-bpe"),
        ("pixtral", "llama-bpe"),
        ("minerva-7b", "smollm"),
    ],
)
def test_pre_tokenizer_alias_matches_canonical(alias: str, canonical: str) -> None:
    """llama.cpp's aliases build the very pipeline of their canonical name, not the GPT-2 split."""
    pieces = _pre_pieces(alias)
    assert pieces == _pre_pieces(canonical)
    if canonical != "gpt-2":
        assert pieces != _pre_pieces("gpt-2")
    expected = {"qwen2": QWEN2_PIECES, "llama-bpe": LLAMA3_PIECES}.get(canonical)
    if expected is not None:
        assert pieces == expected
    # normalizer, BPE options (ignore_merges) and pre-tokenizer all identical
    a, c = _tiny_tok(alias), _tiny_tok(canonical)
    assert a.backend.to_str() == c.backend.to_str()
    assert a.encode(PRE_TEXT) == c.encode(PRE_TEXT)


def test_tekken_pre_tokenizer() -> None:
    # Mistral-Nemo: Qwen2-like digits, but a case change inside a word starts a new piece
    i = QWEN2_PIECES.index(" camelCase")
    assert _pre_pieces("tekken") == [*QWEN2_PIECES[:i], " camel", "Case", *QWEN2_PIECES[i + 1 :]]
    # llama.cpp runs a rewrite of the tokenizer.json regex (its engine lacks \p{Lu} etc.); on
    # text without non-ASCII cased letters or combining marks the two split alike
    llama_cpp = (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    split = pre_tokenizers.Split(Regex(llama_cpp), behavior="isolated")
    text = PRE_TEXT.replace("Été", "Ete")
    assert _pre_pieces("tekken", text) == [text[a:b] for _, (a, b) in split.pre_tokenize_str(text)]
    assert json.loads(_tiny_tok("tekken").backend.to_str())["model"]["ignore_merges"] is True


def test_deepseek_pre_tokenizers() -> None:
    """llama.cpp's DEEPSEEK_LLM / DEEPSEEK_CODER: several regexes, each splitting every piece."""
    assert _pre_pieces("deepseek-llm") == [
        *["Total", ":", " ", "12345", " items", "\n", "\n", " ", " HELLO", "'", "S", " world"],
        *[",", " it", "'", "s", " camelCase", " x", "[", "y", "\r", "\n"],
        # the punctuation class ":-~" spans the ASCII letters too, so it splits "Été" at "t"
        *["É", "t", "é", " ", "北京"],
    ]
    assert _pre_pieces("deepseek-coder") == [
        *["Total", ":", " ", "1", "2", "3", "4", "5", " items", "\n", "\n", " ", " HELLO", "'"],
        *["S", " world", ",", " it", "'", "s", " camelCase", " x", "[", "y", "\r", "\n", "Été"],
        *[" ", "北京"],
    ]
    # the letter class keeps code points that Unicode normalization would replace: U+212A KELVIN
    # SIGN starts the range U+212A-U+212D, which as "K-\u212d" would also take "[" (so " a[b"
    # would stay one piece)
    letters = _DEEPSEEK_LLM_PATTERNS[1]
    assert "\u2124\u2126\u2128\u212a-\u212d" in letters
    assert unicodedata.normalize("NFC", letters) != letters
    assert _pre_pieces("deepseek-llm", " a[b") == [" a", "[", "b"]
    # (and its "CJK" class U+0800-U+4E00 spans the letterlike symbols, so these lose their space)
    assert _pre_pieces("deepseek-llm", " \u212a\u2126 a") == [" ", "\u212a\u2126", " a"]


# llama.cpp calls Minerva's "minerva-7b"; gpt-4o and chameleon are llama.cpp names we lack
@pytest.mark.parametrize("pre", ["minerva", "no-such-pre", "gpt-4o", "chameleon"])
def test_unknown_pre_tokenizer_raises(pre: str) -> None:
    """An unknown tokenizer.ggml.pre is refused (as llama.cpp does), not split like GPT-2."""
    with pytest.raises(NotImplementedError, match=f"pre-tokenizer '{pre}'"):
        Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata(pre))


def test_missing_pre_tokenizer_uses_gpt2_split(caplog: pytest.LogCaptureFixture) -> None:
    meta = tiny_tokenizer_metadata()
    del meta["tokenizer.ggml.pre"]
    with caplog.at_level(logging.WARNING, logger="shm_engine.model.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(meta)
    assert "no tokenizer.ggml.pre" in caplog.text
    assert tok.backend.to_str() == _tiny_tok("gpt-2").backend.to_str()


@pytest.mark.parametrize(
    ("pre", "add_bos"),
    [
        ("llama-bpe", True),
        ("llama3", True),
        ("llama-v3", True),
        ("falcon3", True),
        ("pixtral", True),
        ("midm-2.0", True),
        ("tekken", True),
        ("dbrx", False),
        ("qwen2", False),
        ("smollm", False),
        ("deepseek-llm", False),
    ],
)
def test_add_bos_default_without_key(pre: str, add_bos: bool) -> None:
    """Without tokenizer.ggml.add_bos_token, BOS is added as llama.cpp does for the family."""
    meta = tiny_tokenizer_metadata(pre)
    del meta["tokenizer.ggml.add_bos_token"]
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.add_bos_token is add_bos
    body = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == ([1] if add_bos else []) + body
    # the key, when present, wins either way
    meta["tokenizer.ggml.add_bos_token"] = not add_bos
    assert Tokenizer.from_gguf_metadata(meta).encode("hi") == ([] if add_bos else [1]) + body


@pytest.mark.parametrize("add_bos", [False, True])
def test_add_eos_token_appends_eos_as_llama_cpp_does(add_bos: bool) -> None:
    meta = tiny_tokenizer_metadata()
    meta["tokenizer.ggml.add_bos_token"] = add_bos
    meta["tokenizer.ggml.add_eos_token"] = True
    tok = Tokenizer.from_gguf_metadata(meta)
    body = tok.encode("hi", add_special_tokens=False)
    bos, eos = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    assert tok.encode("hi") == ([bos] if add_bos else []) + body + [eos]


def test_chat_template_generation_tag_renders_its_body() -> None:
    # transformers' {% generation %} marks assistant turns (training masks): the text stays.
    meta = tiny_tokenizer_metadata()
    meta["tokenizer.chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}|{% endif %}{% endfor %}"
    )
    tok = Tokenizer.from_gguf_metadata(meta)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "hi|yo"


def _hf_dir(path: Path, tok: Tokenizer, config_template: object, files: dict[str, str]) -> Path:
    tok.save_hf(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = config_template
    cfg["pad_token"] = tok.backend.id_to_token(0)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def test_chat_templates_are_chosen_as_transformers_chooses_them(tmp_path: Path) -> None:
    """chat_template.jinja over tokenizer_config.json's; the named "tool_use" template (a
    tokenizer_config list, additional_chat_templates/tool_use.jinja, or GGUF's
    tokenizer.chat_template.tool_use) for requests with tools; tools and documents always
    defined, and the special tokens the model has."""
    base = Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata())
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    show = "{{ messages[0].content }} {{ tools|tojson }} {{ documents is none }} {{ pad_token }}"

    tok = Tokenizer.from_hf_dir(
        _hf_dir(tmp_path / "a", base, "CONFIG", {"chat_template.jinja": "JINJA " + show})
    )
    assert tok.apply_chat_template(msgs) == f"JINJA hi null True {base.backend.id_to_token(0)}"

    named = [{"name": "default", "template": "DEFAULT"}, {"name": "tool_use", "template": "TOOL"}]
    tok = Tokenizer.from_hf_dir(_hf_dir(tmp_path / "b", base, named, {}))
    assert tok.apply_chat_template(msgs) == "DEFAULT"
    assert tok.apply_chat_template(msgs, tools=tools) == "TOOL"
    assert tok.apply_chat_template(msgs, tools=tools, chat_template="MINE") == "MINE"
    tok.save_hf(tmp_path / "b2")  # and back: both templates, named
    again = Tokenizer.from_hf_dir(tmp_path / "b2")
    assert again.chat_template == "DEFAULT" and again.tool_chat_template == "TOOL"

    extra = {"additional_chat_templates/tool_use.jinja": "EXTRA {{ tools|length }}"}
    tok = Tokenizer.from_hf_dir(_hf_dir(tmp_path / "c", base, "CONFIG", extra))
    assert tok.apply_chat_template(msgs) == "CONFIG"
    assert tok.apply_chat_template(msgs, tools=tools) == "EXTRA 1"

    meta = tiny_tokenizer_metadata()
    meta["tokenizer.chat_template"] = "PLAIN"
    meta["tokenizer.chat_template.tool_use"] = "GGUF TOOLS"
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.apply_chat_template(msgs) == "PLAIN"
    assert tok.apply_chat_template(msgs, tools=tools) == "GGUF TOOLS"


def test_end_of_generation_tokens_stop_as_in_llama_cpp() -> None:
    # EOS first (the template's eos_token), then the file's EOM and the tokens llama.cpp
    # treats as end of generation by their text, whatever the EOS key says.
    meta = tiny_tokenizer_metadata()
    base = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] += ["<|eot_id|>", "<|eom_id|>"]
    meta["tokenizer.ggml.token_type"] += [3, 3]
    meta["tokenizer.ggml.eom_token_id"] = base + 1
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.eos_token_ids == (2, base + 1, 0, base)
    assert tok.eos_token == "<|im_end|>"
