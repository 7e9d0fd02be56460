"""Tokenizer: a thin layer over the `tokenizers` library, built from tokenizer.json or from GGUF.

GGUF files carry the vocabulary, merges, token types and a pre-tokenizer *name*; we rebuild the
equivalent `tokenizers` pipeline from those (byte-level BPE for `gpt2`-model files such as SmolLM2,
Llama 3 and Qwen2; SentencePiece-style BPE with byte fallback for `llama`-model files such as
Llama 2 and Mistral), so that both load paths tokenize exactly like the Hugging Face tokenizer.
Chat templates are rendered with a sandboxed jinja2 environment configured like transformers'.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(
    1, 7
)

# Pre-tokenizer split patterns for the `tokenizer.ggml.pre` names we know (same regexes as the
# models' own tokenizer.json files).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"gpt-2", "gpt2", "default", "olmo", "jais", "poro-chat", "viking"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "dbrx", "smaug-bpe"}
_QWEN2_PRE = {"qwen2", "qwen"}


class Tokenizer:
    """Encode/decode, special ids and chat templating for one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._template: jinja2.Template | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_file(cls, tokenizer_json: str | Path, **kwargs: Any) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(tokenizer_json)), **kwargs)

    @classmethod
    def from_hf_dir(cls, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json)."""
        path = Path(path)
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tcfg = _read_json(path / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if template is None:
            template = _read_json(path / "chat_template.json").get("chat_template")

        def token_id(entry: Any) -> int | None:
            if isinstance(entry, dict):
                entry = entry.get("content")
            return None if entry is None else backend.token_to_id(entry)

        eos = list(extra_eos_ids)
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if gen_eos is not None:
            eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos_tok = token_id(tcfg.get("eos_token"))
        if eos_tok is not None:
            eos.insert(0, eos_tok)
        return cls(
            backend,
            bos_token_id=token_id(tcfg.get("bos_token")),
            eos_token_ids=eos,
            chat_template=template,
            # the post-processor in tokenizer.json already adds BOS where the model wants it
            add_bos_token=bool(tcfg.get("add_bos_token", False)),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer from GGUF `tokenizer.ggml.*` keys (values already decoded)."""
        kind = meta.get("tokenizer.ggml.model", "gpt2")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(
            meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        )
        if kind == "gpt2":
            backend = _gguf_bpe(tokens, list(meta.get("tokenizer.ggml.merges") or []), meta)
        elif kind == "llama":
            backend = _gguf_spm(tokens, list(meta.get("tokenizer.ggml.scores") or []), types, meta)
        else:
            raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported")

        # control / user-defined tokens are matched whole before the model runs (as in HF)
        added = [
            AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False, rstrip=False)
            for i in range(len(tokens))
            if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        ]
        if added:
            backend.add_tokens(added)

        bos = meta.get("tokenizer.ggml.bos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        if add_bos and bos is not None:
            bos_tok = tokens[int(bos)]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_tok}:0 $A:0",
                pair=f"{bos_tok}:0 $A:0 {bos_tok}:1 $B:1",
                special_tokens=[(bos_tok, int(bos))],
            )
        eos: list[int] = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            if meta.get(key) is not None:
                eos.append(int(meta[key]))
        return cls(
            backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=add_bos,
        )

    def save_hf(self, path: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json so `from_hf_dir` gives this tokenizer back."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {"add_bos_token": self.add_bos_token}
        if self.bos_token_id is not None:
            cfg["bos_token"] = self.backend.id_to_token(self.bos_token_id)
        if self.eos_token_ids:
            cfg["eos_token"] = self.backend.id_to_token(self.eos_token_ids[0])
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        if len(self.eos_token_ids) > 1:
            gen = {"eos_token_id": list(self.eos_token_ids)}
            (path / "generation_config.json").write_text(json.dumps(gen, indent=2))

    # ------------------------------------------------------------------ encode / decode
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids.update(self.eos_token_ids)
        if self.bos_token_id is not None:
            ids.add(self.bos_token_id)
        return frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS where the model's tokenizer does.

        Chat-templated prompts already contain their special tokens, so pass False for those."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encs = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the model's own chat template (as text; encode with add_special_tokens=False)."""
        template = self._compiled(chat_template)
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def _compiled(self, override: str | None) -> jinja2.Template:
        if override is not None:
            return _chat_env().from_string(override)
        if self._template is None:
            if not self.chat_template:
                raise ValueError("this model has no chat template; pass chat_template explicitly")
            self._template = _chat_env().from_string(self.chat_template)
        return self._template


class IncrementalDetokenizer:
    """Streams text for one request: feed new token ids, get the newly completed text.

    Decodes a small window [prefix_offset, end) and emits what it adds over the window's already
    emitted part [prefix_offset, read_offset); a delta that ends in U+FFFD (an incomplete UTF-8
    sequence split across byte-level tokens) is held back until the next token completes it.
    Decoding a window (not the single token) also keeps SentencePiece leading spaces right.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a few prompt tokens give the first output token its left context (spaces in SPM)
        self.ids: list[int] = list(prompt_ids[-6:])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - 5, 0)
        self.output_text = ""

    def add(self, new_ids: Sequence[int]) -> str:
        """Append token ids; return the text delta they complete (may be "")."""
        self.ids.extend(int(i) for i in new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._trim()
            self.output_text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a request: emit held-back text even if it ends in U+FFFD."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.output_text += delta
        return delta

    def _trim(self) -> None:
        # drop ids before the window so a long generation costs O(1) per token
        if self.prefix_offset > 64:
            cut = self.prefix_offset
            del self.ids[:cut]
            self.prefix_offset -= cut
            self.read_offset -= cut


# ---------------------------------------------------------------------- helpers
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _gguf_bpe(tokens: list[str], merges: list[str], meta: Mapping[str, Any]) -> HFTokenizer:
    """Byte-level BPE (GPT-2 family): vocab + merges, pre-tokenizer chosen by tokenizer.ggml.pre."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    backend = HFTokenizer(
        models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE)  # type: ignore[arg-type]
    )
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level_regex]
        )
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        pattern = _LLAMA3_PATTERN if pre in _LLAMA3_PRE else _QWEN2_PATTERN
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level_plain]
        )
        if pre in _QWEN2_PRE:
            backend.normalizer = normalizers.NFC()
    else:
        if pre not in _GPT2_PRE:
            log.warning("unknown GGUF pre-tokenizer %r; using the GPT-2 split", pre)
        backend.pre_tokenizer = byte_level_regex
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_spm(
    tokens: list[str], scores: list[float], types: list[int], meta: Mapping[str, Any]
) -> HFTokenizer:
    """SentencePiece BPE (Llama 2, Mistral) as a `tokenizers` BPE with byte fallback.

    SentencePiece merges by piece score; the equivalent merge list is every (left, right) split of
    a vocabulary piece into two vocabulary pieces, ranked by the merged piece's score.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if not scores:
        scores = [-float(i) for i in range(len(tokens))]
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        if types[pid] != TOKEN_NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(r[3], r[4]) for r in ranked]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    backend = HFTokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)  # type: ignore[arg-type]
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    norm: list[normalizers.Normalizer] = [normalizers.Replace(" ", "\u2581")]
    if add_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(norm)
    dec: list[decoders.Decoder] = [
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


_ENV: ImmutableSandboxedEnvironment | None = None


def _chat_env() -> ImmutableSandboxedEnvironment:
    """Sandboxed env with the options and helpers transformers gives chat templates."""
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV
