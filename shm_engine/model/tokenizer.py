"""Tokenizer: a thin layer over the `tokenizers` library, built from tokenizer.json or from GGUF.

GGUF files carry the vocabulary, merges, token types and a pre-tokenizer *name*; we rebuild the
equivalent `tokenizers` pipeline from those (byte-level BPE for `gpt2`-model files such as SmolLM2,
Llama 3 and Qwen2; SentencePiece-style BPE with byte fallback for `llama`-model files such as
Llama 2 and Mistral), so that both load paths tokenize exactly like the Hugging Face tokenizer.
Chat templates are rendered with a sandboxed jinja2 environment configured like transformers'.
"""

from __future__ import annotations

import functools
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

# Split regexes of the byte-level BPE pre-tokenizers, transcribed from llama.cpp's
# src/llama-vocab.cpp (llm_tokenizer_bpe, LLAMA_VOCAB_PRE_TYPE_*): each is applied in turn as an
# isolated Split (as llama.cpp's unicode_regex_split and the models' own tokenizer.json do), then
# the byte-level mapping. Where llama.cpp rewrites a tokenizer.json regex for its own regex engine
# (the case-insensitive contraction group of Llama 3 / Qwen2, Tekken's \p{Lu}.. classes), we use
# the original it records beside the rewrite, which `tokenizers` runs natively like the model's own
# tokenizer.json does.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# LLAMA_VOCAB_PRE_TYPE_TEKKEN (Mistral-Nemo), the "original regex from tokenizer.json"
_TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM. Non-ASCII code points are written as escapes: several of them
# (U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126, U+212A) have canonical equivalents that an editor's
# Unicode normalization would silently substitute (turning "\u212A-\u212D" into "K-\u212D").
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_PATTERNS = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    _DEEPSEEK_CJK,
    "\\p{N}+",
)
# LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_CODER
_DEEPSEEK_CODER_PATTERNS = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _DEEPSEEK_CJK, "\\p{N}")

# the Llama 3 split's names for which llama.cpp also adds BOS (see _ADD_BOS_PRE)
_LLAMA3_BOS_NAMES = (
    "llama-bpe",
    "llama3",
    "llama-v3",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
)

# `tokenizer.ggml.pre` name -> pre-tokenizer family, for the names llama.cpp's
# llama_vocab::impl::load maps to a split we reproduce (plus our historical "gpt2" and "qwen").
# Any other name is refused, as llama.cpp refuses names it does not know: a wrong split tokenizes
# plausibly but differently from the model's training. (Names llama.cpp gives extra behaviour we
# lack, such as "roberta-bpe"'s added SEP, or a split of its own, such as "mpt", stay refused.)
#   gpt2:   the GPT-2 split (ByteLevel's own regex; llama.cpp has regexes of its own for
#           "poro-chat", "viking" and "default", not reproduced here)
#   digits: single digits, then the GPT-2 split (SmolLM2, StarCoder, ...)
#   others: the Split regexes in _PRE_SPLITS
_PRE_FAMILY: dict[str, str] = {
    **dict.fromkeys(
        ("default", "gpt-2", "gpt2", "olmo", "jais", "poro-chat", "viking", "phi-2", "gigachat")
        + ("jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert"),
        "gpt2",
    ),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"),
        "digits",
    ),
    **dict.fromkeys((*_LLAMA3_BOS_NAMES, "dbrx", "smaug-bpe"), "llama3"),
    **dict.fromkeys(("qwen2", "qwen", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2"), "qwen2"),
    "tekken": "tekken",
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
}
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "llama3": (_LLAMA3_PATTERN,),
    "qwen2": (_QWEN2_PATTERN,),
    "tekken": (_TEKKEN_PATTERN,),
    "deepseek-llm": _DEEPSEEK_LLM_PATTERNS,
    "deepseek-coder": _DEEPSEEK_CODER_PATTERNS,
}
# families whose BPE first looks a whole pre-token up in the vocabulary (llama.cpp ignore_merges)
_IGNORE_MERGES_FAMILIES = frozenset({"llama3", "tekken"})
# Tokens llama.cpp treats as end of generation whatever the file's EOS says (its EOG set): a
# GGUF model that emits one is done, and running on would generate past the end of the turn.
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<end_of_turn>",
        "<end_of_utterance>",
        "<EOT>",
        "_<EOT>",
        "<|return|>",
        "<|call|>",
    }
)
# names for which llama.cpp adds BOS when the GGUF has no tokenizer.ggml.add_bos_token
_ADD_BOS_PRE = frozenset((*_LLAMA3_BOS_NAMES, "tekken"))


def _opt_id(value: Any, vocab: int) -> int | None:
    """A GGUF token id key's value, or None when absent or outside the vocabulary."""
    return int(value) if value is not None and 0 <= int(value) < vocab else None


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
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        tool_chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        # pad / unk: reported (HF's tok.pad_token_id, unk_token_id), never inserted by us
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        # the model's template for requests with tools, where it has one apart (transformers'
        # named "tool_use" template, llama.cpp's tokenizer.chat_template.tool_use)
        self.tool_chat_template = tool_chat_template
        self.add_bos_token = add_bos_token
        # compiled templates (default, tool_use), each with whether it wants content parts
        self._templates: dict[str, tuple[jinja2.Template, bool]] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_file(cls, tokenizer_json: str | Path, **kwargs: Any) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(tokenizer_json)), **kwargs)

    @classmethod
    def from_hf_dir(cls, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{path}: no tokenizer.json (only fast tokenizers are supported; convert a "
                "slow one with transformers' AutoTokenizer(...).save_pretrained)"
            )
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tcfg = _read_json(path / "tokenizer_config.json")
        templates = _hf_chat_templates(path, tcfg)

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
            chat_template=templates.get("default") or next(iter(templates.values()), None),
            tool_chat_template=templates.get("tool_use"),
            # the post-processor in tokenizer.json already adds BOS where the model wants it
            add_bos_token=bool(tcfg.get("add_bos_token", False)),
            pad_token_id=token_id(tcfg.get("pad_token")),
            unk_token_id=token_id(tcfg.get("unk_token")),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer from GGUF `tokenizer.ggml.*` keys (values already decoded)."""
        kind = meta.get("tokenizer.ggml.model", "gpt2")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(
            meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        )
        pre: str | None = None  # the byte-level BPE pre-tokenizer name
        if kind == "gpt2":
            pre = _gguf_pre(meta)
            backend = _gguf_bpe(tokens, list(meta.get("tokenizer.ggml.merges") or []), pre)
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
        # without the key, llama.cpp adds BOS for SentencePiece files and some BPE families
        add_bos = bool(
            meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or pre in _ADD_BOS_PRE)
        )
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
        head = [(tokens[int(bos)], int(bos))] if add_bos and bos is not None else []
        tail = [(tokens[int(eos_id)], int(eos_id))] if add_eos else []
        if head or tail:  # llama.cpp: BOS before, EOS after the text, each where the file says

            def side(seq: str) -> list[str]:
                return (
                    [f"{t}:{seq}" for t, _ in head]
                    + [f"$A:{seq}" if seq == "0" else "$B:1"]
                    + [f"{t}:{seq}" for t, _ in tail]
                )

            backend.post_processor = processors.TemplateProcessing(
                single=side("0"),
                pair=side("0") + side("1"),
                special_tokens=list(dict(head + tail).items()),
            )
        eos: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            if meta.get(f"tokenizer.ggml.{key}") is not None:
                eos.append(int(meta[f"tokenizer.ggml.{key}"]))
        # NOTE: EOS stays first (it is the template's eos_token); the rest only end generation.
        eos += [i for i, text in enumerate(tokens) if text in _END_OF_GENERATION_TEXTS]
        return cls(
            backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            chat_template=meta.get("tokenizer.chat_template"),
            tool_chat_template=meta.get("tokenizer.chat_template.tool_use"),
            add_bos_token=add_bos,
            pad_token_id=_opt_id(meta.get("tokenizer.ggml.padding_token_id"), len(tokens)),
            unk_token_id=_opt_id(meta.get("tokenizer.ggml.unknown_token_id"), len(tokens)),
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
        for key, tid in (("pad_token", self.pad_token_id), ("unk_token", self.unk_token_id)):
            if tid is not None:
                cfg[key] = self.backend.id_to_token(tid)
        if self.tool_chat_template is not None:
            cfg["chat_template"] = [
                {"name": "default", "template": self.chat_template},
                {"name": "tool_use", "template": self.tool_chat_template},
            ]
        elif self.chat_template is not None:
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
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render the model's own chat template (as text; encode with add_special_tokens=False).

        Content given as OpenAI-style text parts is handed over as the template expects it
        (vLLM's content formats): as the parts to a template that loops over
        ``message.content``, else as one string, the parts joined by newlines.
        ``continue_final_message``: the text ends inside the last message, for the model to go
        on with it (transformers' rule: a tag after its text marks where to cut).
        """
        # transformers' variables: tools and documents always defined (None unless given), the
        # special tokens the model has
        kwargs.setdefault("tools", None)
        kwargs.setdefault("documents", None)
        for name, tid in (("pad_token", self.pad_token_id), ("unk_token", self.unk_token_id)):
            if tid is not None:
                kwargs.setdefault(name, self.backend.id_to_token(tid))
        template, wants_parts = self._compiled(
            chat_template, with_tools=kwargs["tools"] is not None
        )
        rendered = [_for_template(m, wants_parts) for m in messages]
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message and add_generation_prompt exclude each other"
                )
            final = _tag_final_text(rendered)
        text = template.render(
            messages=rendered,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if not continue_final_message:
            return text
        cut = text.rfind(_CONTINUE_TAG.strip())
        if cut < 0 or final.strip() not in text:
            raise ValueError("continue_final_message: the template does not show the final message")
        return text[:cut] if text.startswith(_CONTINUE_TAG, cut) else text[:cut].rstrip()

    def _compiled(self, override: str | None, with_tools: bool) -> tuple[jinja2.Template, bool]:
        if override is not None:
            return _compile_chat_template(override)
        name = "tool_use" if with_tools and self.tool_chat_template else "default"
        if name not in self._templates:
            source = self.tool_chat_template if name == "tool_use" else self.chat_template
            if not source:
                raise ValueError("this model has no chat template; pass chat_template explicitly")
            self._templates[name] = _compile_chat_template(source)
        return self._templates[name]


def _hf_chat_templates(path: Path, tcfg: Mapping[str, Any]) -> dict[str, str]:
    """A Hugging Face directory's chat templates by name, in transformers' order of precedence:
    chat_template.jinja (the default) and additional_chat_templates/NAME.jinja over
    tokenizer_config.json's ``chat_template`` (one, or a list of named ones); the legacy
    chat_template.json only when there is nothing else."""
    named: dict[str, str] = {}
    listed = tcfg.get("chat_template")
    if isinstance(listed, list):
        named.update(
            {t["name"]: t["template"] for t in listed if t.get("name") and t.get("template")}
        )
    elif listed:
        named["default"] = listed
    if (path / "chat_template.jinja").is_file():
        named["default"] = (path / "chat_template.jinja").read_text()
    for file in sorted((path / "additional_chat_templates").glob("*.jinja")):
        named[file.stem] = file.read_text()
    if not named and (legacy := _read_json(path / "chat_template.json").get("chat_template")):
        named["default"] = legacy
    return named


def content_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """A chat message's content as one string: OpenAI-style parts
    (``[{"type": "text", "text": ...}]``) joined by newlines, as vLLM joins them. Other kinds
    (images, audio) are refused: this engine runs text models only."""
    return "\n".join(part["text"] for part in text_parts(content))


def text_parts(content: str | Sequence[Mapping[str, Any]] | None) -> list[dict[str, str]]:
    """A chat message's content as OpenAI-style text parts (none for absent content)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for part in content:
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported")
        parts.append({"type": "text", "text": part.get("text") or ""})
    return parts


def _for_template(message: Mapping[str, Any], wants_parts: bool) -> dict[str, Any]:
    """The message with its content in the form the template reads (None as no text).

    NOTE: a string stays a string even for a template that loops over content, as transformers
    hands it over: such templates test ``content is string`` first, and some (Mistral Small
    3.x) loop for user turns only but concatenate system and assistant content as strings.
    """
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, str):
        return dict(message)
    return {**message, "content": text_parts(content) if wants_parts else content_text(content)}


def check_chat_template(source: str) -> None:
    """ValueError for a template that does not compile."""
    try:
        _compile_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> tuple[jinja2.Template, bool]:
    """The compiled template, and whether it loops over a message's content (then it expects
    OpenAI-style parts, as vLLM detects its "openai" content format). Cached: a template given
    per call (the server's --chat-template, LLM.chat's) took milliseconds to compile."""
    env = _chat_env()
    wants_parts = any(
        _names_content(loop.iter) for loop in env.parse(source).find_all(jinja2.nodes.For)
    )
    return env.from_string(source), wants_parts


def _names_content(node: jinja2.nodes.Node) -> bool:
    """``x.content`` or ``x['content']`` (possibly filtered, e.g. ``x.content | list``)."""
    while isinstance(node, jinja2.nodes.Filter):
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


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


def _gguf_pre(meta: Mapping[str, Any]) -> str:
    """The `tokenizer.ggml.pre` name of a byte-level BPE file; NotImplementedError if unknown."""
    if "tokenizer.ggml.pre" not in meta:
        log.warning("GGUF file has no tokenizer.ggml.pre; using the GPT-2 split ('default')")
        return "default"
    pre = str(meta["tokenizer.ggml.pre"])
    if pre not in _PRE_FAMILY:
        raise NotImplementedError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; known: "
            + ", ".join(sorted(_PRE_FAMILY))
        )
    return pre


def _gguf_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    """Byte-level BPE (GPT-2 family): vocab + merges, pre-tokenizer chosen by tokenizer.ggml.pre."""
    family = _PRE_FAMILY[pre]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    ignore_merges = family in _IGNORE_MERGES_FAMILIES
    backend = HFTokenizer(
        models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=ignore_merges)  # type: ignore[arg-type]
    )
    if family == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif family == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        splits: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated")
            for pattern in _PRE_SPLITS[family]
        ]
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
        if family == "qwen2":
            backend.normalizer = normalizers.NFC()
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


def _tojson(
    value: Any,
    indent: int | None = None,
    ensure_ascii: bool = False,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` filter for chat templates (unlike Jinja's, no HTML escaping)."""
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


_ENV: ImmutableSandboxedEnvironment | None = None


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks assistant turns for
    training masks): rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _chat_env() -> ImmutableSandboxedEnvironment:
    """Sandboxed env with the options and helpers transformers gives chat templates."""
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV


# Template variables apply_chat_template sets itself: extra template kwargs may not replace them.
_TEMPLATE_NAMES_TAKEN = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "chat_template",
     "continue_final_message", "tools"}
)  # fmt: skip


def template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra chat-template variables (vLLM's chat_template_kwargs), refusing the names the
    renderer sets itself (they had failed as a TypeError deep in the call)."""
    out = dict(kwargs or {})
    taken = _TEMPLATE_NAMES_TAKEN.intersection(out)
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(taken))}")
    return out


# Marks where the final message's text ends, to cut the rendering there (transformers' tag).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_text(messages: list[dict[str, Any]]) -> str:
    """Append the tag to the last message's (last text part's) text; returns that text."""
    if not messages:
        raise ValueError("continue_final_message needs a message to continue")
    last = messages[-1] = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
        return content
    parts = [dict(p) for p in content or []]
    for part in reversed(parts):
        if isinstance(part.get("text"), str):
            text = part["text"]
            part["text"] = text + _CONTINUE_TAG
            last["content"] = parts
            return text
    raise ValueError("continue_final_message: the final message has no text to continue")
