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

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> Encoding:
        if isinstance(text, str):
            ids: Any = self.encode(text, add_special_tokens)
            mask: Any = [1] * len(ids)
        else:
            ids = self.tokenizer.encode_batch(text, add_special_tokens)
            mask = [[1] * len(i) for i in ids]
        return Encoding(input_ids=ids, attention_mask=mask)

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
        conversation: Sequence[Mapping[str, Any]],
        tools: Any = None,
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> str | list[int] | Encoding:
        """HF's defaults: token ids (transformers 4's list; ``return_dict`` for the encoding
        transformers 5 returns by default), no generation prompt unless asked for."""
        if tools:
            raise ValueError("tools are not supported")
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

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
