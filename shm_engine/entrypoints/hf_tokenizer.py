"""What ``LLM.get_tokenizer()`` returns: the model's tokenizer with Hugging Face's calling
conventions, as vLLM hands out the HF tokenizer itself.

Why: scripts written for vLLM call ``tok.apply_chat_template(msgs, add_generation_prompt=True)``
and get token ids, ``tok.decode(ids)`` and keep special tokens, ``tok.eos_token_id``,
``tok(text).input_ids``. The engine's own ``Tokenizer`` answers with other defaults (text from the
template, special tokens skipped), which gave such scripts wrong prompts and no error. Anything
not defined here is the wrapped ``Tokenizer``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shm_engine.model.tokenizer import Tokenizer


class Encoding(dict):
    """``tok(text)``'s result: ``input_ids`` and ``attention_mask`` by key or attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFStyleTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    def __call__(
        self,
        text: str | Sequence[str],
        add_special_tokens: bool = True,
        padding: bool | str = False,
        return_tensors: str | None = None,
    ) -> Encoding:
        """HF's encoding: ``padding`` (True / "longest") pads a batch on the right with the pad
        token; ``return_tensors`` "pt" or "np" gives int64 [batch, len] arrays."""
        if isinstance(text, str):
            rows = [self.encode(text, add_special_tokens)]
        else:
            rows = self.tokenizer.encode_batch(text, add_special_tokens)
        masks = [[1] * len(r) for r in rows]
        if padding not in (False, "do_not_pad") and rows:
            if padding not in (True, "longest"):
                raise ValueError(f"padding={padding!r} is not supported (True or 'longest')")
            if self.tokenizer.pad_token_id is None:
                raise ValueError("Asking to pad but the tokenizer does not have a padding token")
            width = max(len(r) for r in rows)
            masks = [m + [0] * (width - len(m)) for m in masks]
            rows = [r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows]
        if return_tensors is not None:
            return Encoding(
                input_ids=_as_tensor(rows, return_tensors),
                attention_mask=_as_tensor(masks, return_tensors),
            )
        if isinstance(text, str):
            return Encoding(input_ids=rows[0], attention_mask=masks[0])
        return Encoding(input_ids=rows, attention_mask=masks)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        tools: Any = None,
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        return_dict: bool = False,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """HF's defaults: token ids (transformers 4's list; ``return_dict`` for the encoding
        transformers 5 returns by default), no generation prompt unless asked for; a list of
        conversations gives a list (with ``return_tensors``, of one length, as HF asks)."""
        options = dict(
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **kwargs,
        )
        batched = bool(conversation) and not isinstance(conversation[0], Mapping)
        convs = list(conversation) if batched else [conversation]
        texts = [self.tokenizer.apply_chat_template(c, **options) for c in convs]
        if not tokenize:
            return texts if batched else texts[0]
        rows = [self.encode(t, add_special_tokens=False) for t in texts]
        masks = [[1] * len(r) for r in rows]
        if return_tensors:
            ids, mask = _as_tensor(rows, return_tensors), _as_tensor(masks, return_tensors)
        elif batched:
            ids, mask = rows, masks
        else:
            ids, mask = rows[0], masks[0]
        return Encoding(input_ids=ids, attention_mask=mask) if return_dict else ids

    @property
    def eos_token_id(self) -> int | None:
        ids = self.tokenizer.eos_token_ids
        return ids[0] if ids else None

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        return [self.tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.backend.get_vocab(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.tokenizer.all_special_ids)


def _as_tensor(rows: list[list[int]], kind: str) -> Any:
    """int64 [len(rows), width] as torch ("pt") or numpy ("np"); rows must be of one length
    (HF's error otherwise)."""
    if len({len(r) for r in rows}) > 1:
        raise ValueError(
            "Unable to create tensor, you should probably activate truncation and/or padding "
            "with 'padding=True' to have batched tensors with the same length."
        )
    if kind == "np":
        import numpy as np

        return np.asarray(rows, dtype=np.int64)
    if kind == "pt":
        import torch  # NOTE: only here: the frontend stays torch-free unless asked for tensors

        return torch.tensor(rows, dtype=torch.int64)
    raise ValueError(f"return_tensors={kind!r} is not supported ('pt' or 'np')")
