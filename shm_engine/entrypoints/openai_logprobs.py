"""Token strings, bytes and logprobs in the OpenAI shapes (completions and chat).

Why a table of every token's bytes: decoding one token is lossy. A byte-level token that holds
part of a UTF-8 sequence decodes to U+FFFD, so emoji pieces looked alike (chat ``bytes``) and
collided as completions ``top_logprobs`` keys. Streaming and non-streaming responses advance one
``LogprobCursor`` per choice token by token, so their ``text_offset`` values agree.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field
from typing import Any

from shm_engine.engine.output_processor import CompletionOutput, PositionLogprobs, RequestOutput
from shm_engine.model.tokenizer import Tokenizer

_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# JSON has no -inf: vLLM writes a logprob of a token ruled out (by the model, or refused by a
# structured output constraint) as this.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet, char -> byte (the inverse of GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}  # printable bytes stand for themselves
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _decoder_types(tokenizer: Tokenizer) -> set[str]:
    """The ``type`` of the tokenizer's decoder and of every decoder nested in it."""
    decoder = tokenizer.backend.decoder
    if decoder is None:
        return set()
    types: set[str] = set()
    todo = [json.loads(decoder.__getstate__())]
    while todo:
        d = todo.pop()
        types.add(d.get("type", ""))
        todo += d.get("decoders") or []
    return types


def _vocab_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Every token's own bytes, by id.

    Why: decoding one token is lossy. A byte-level token that holds part of a UTF-8 sequence
    decodes to U+FFFD, so every emoji piece looked alike (chat ``bytes`` [239, 191, 189]) and
    collided as a completions ``top_logprobs`` key. The bytes come from the vocabulary instead:
    byte-level pieces through GPT-2's byte alphabet, SentencePiece pieces with ``<0xNN>`` byte
    fallback and U+2581 for a space, added tokens as their text. Other decoders fall back to the
    single-token decode.
    """
    backend = tokenizer.backend
    size = tokenizer.vocab_size
    types = _decoder_types(tokenizer)
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    byte_level = _gpt2_byte_decoder() if "ByteLevel" in types else None
    spm = byte_level is None and bool(types & {"ByteFallback", "Metaspace", "Replace"})
    decoded = None
    if byte_level is None and not spm:
        decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    out = []
    for i in range(size):
        piece = backend.id_to_token(i)
        if i in added or piece is None:
            out.append((added.get(i) or piece or "").encode())
        elif byte_level is not None and all(ch in byte_level for ch in piece):
            out.append(bytes(byte_level[ch] for ch in piece))
        elif spm:
            m = _SPM_BYTE.fullmatch(piece)
            out.append(bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode())
        else:
            out.append((decoded[i] if decoded else backend.decode([i], False)).encode())
    return out


class TokenTable:
    """Per-token bytes and strings for logprobs, and the prompt size no context can hold.

    Built once per server (~0.1 s for a 49k vocabulary); lookups are list indexing.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.bytes = _vocab_bytes(tokenizer)
        added = tokenizer.backend.get_added_tokens_decoder()
        # What decode(skip_special_tokens=True), hence the streamed text, leaves out.
        self.special = frozenset(i for i, t in added.items() if t.special)
        # NOTE: bytes bound characters: a token covers at most as many characters of a prompt as
        # it has bytes (one per character at the least, and a SentencePiece piece's U+2581 is
        # the space it stands for). Decoded lengths are not a bound: SentencePiece decoding
        # strips a token's leading space.
        self.max_token_chars = max(1, max(map(len, self.bytes), default=1))
        self._strings: dict[int, str] = {}

    def token_bytes(self, tid: int) -> bytes:
        return self.bytes[tid] if 0 <= tid < len(self.bytes) else b""

    def text_bytes(self, tid: int, skip_special: bool) -> bytes:
        """The bytes a token adds to the output text (special tokens may be skipped)."""
        return b"" if skip_special and tid in self.special else self.token_bytes(tid)

    def string(self, tid: int) -> str:
        """The token as text; ``bytes:\\xNN..`` (OpenAI's notation) if it is not valid UTF-8."""
        s = self._strings.get(tid)
        if s is None:
            b = self.token_bytes(tid)
            try:
                s = b.decode()
            except UnicodeDecodeError:
                s = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            self._strings[tid] = s
        return s


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


@dataclass
class LogprobCursor:
    """How far one choice's logprobs have been reported.

    ``offset`` is the next token's ``text_offset``: characters of the echoed prompt plus those the
    reported tokens' bytes complete (a token holding the first half of a character adds none).
    Streaming and non-streaming both advance one of these token by token, so they agree.
    """

    tokens: int = 0
    text_bytes: int = 0  # UTF-8 bytes of output text the reported tokens make up
    offset: int = 0
    utf8: codecs.IncrementalDecoder = field(default_factory=_utf8_decoder)


class LogprobFormatter:
    """Logprobs of a choice's tokens, from its cursor on, in either API's shape."""

    def __init__(self, tokens: TokenTable) -> None:
        self.tokens = tokens

    def _text_bytes(self, text: str, done: int, tid: int, skip_special: bool) -> bytes:
        """The bytes token ``tid`` adds to ``text`` when ``done`` bytes of it come before.

        NOTE: SentencePiece decoders drop the leading space of the first piece they decode, so
        with no prompt text before it (an empty or all-special prompt) the text starts one byte
        short of the first piece's own bytes.  Whether that happened is read off the text
        itself, so offsets follow what the detokenizer produced, not what the vocabulary says.
        """
        b = self.tokens.text_bytes(tid, skip_special)
        if done == 0 and b[:1] == b" " and not text.startswith(" "):
            return b[1:]
        return b

    def advance(self, text: str, cur: LogprobCursor, tid: int, skip_special: bool) -> int:
        """The ``text_offset`` in ``text`` of the cursor's next token, ``tid``; moves the cursor
        past it."""
        offset = cur.offset
        b = self._text_bytes(text, cur.text_bytes, tid, skip_special)
        cur.offset += len(cur.utf8.decode(b))
        cur.text_bytes += len(b)
        cur.tokens += 1
        return offset

    def _top_dict(self, lps: PositionLogprobs) -> dict[str, float]:
        """Completions' ``{token: logprob}``, keyed by token string as OpenAI and vLLM do.

        Tokens that are not whole UTF-8 get distinct ``bytes:\\xNN`` keys, so pieces of emoji no
        longer collapse into one U+FFFD entry; ids whose strings still coincide keep the higher
        logprob (the first one on a tie).
        """
        top: dict[str, float] = {}
        for tid, lp in sorted(lps.items(), key=lambda kv: -kv[1].logprob):
            top.setdefault(self.tokens.string(tid), _finite(lp.logprob))
        return top

    def completion(
        self, c: CompletionOutput, end: int, cur: LogprobCursor, skip_special: bool
    ) -> dict[str, Any]:
        """Logprobs of tokens ``cur.tokens:end`` in the completions shape."""
        tokens, token_lps, tops, offsets = [], [], [], []
        start = cur.tokens
        for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end], strict=False):
            tokens.append(self.tokens.string(tid))
            token_lps.append(_finite(lps[tid].logprob) if tid in lps else None)
            tops.append(self._top_dict(lps))
            offsets.append(self.advance(c.text, cur, tid, skip_special))
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def prompt(
        self, out: RequestOutput, text: str, skip_special: bool | None, top_n: int
    ) -> dict[str, Any]:
        """The echoed prompt's tokens in the completions shape (``echo`` with ``logprobs``): the
        first has no logprob (nothing predicts it), offsets index ``text``; each position shows
        its token and the ``top_n`` most likely (the engine holds more when vLLM's
        ``prompt_logprobs`` asks for more), so ``prompt_logprobs`` never widens them.

        ``skip_special`` None: a special token counts where ``text`` holds it (a text prompt
        echoed as given holds the special tokens typed in it, not a BOS the tokenizer added).
        """
        entries = out.prompt_logprobs or []
        cur = LogprobCursor()
        tokens, token_lps, tops, offsets = [], [], [], []
        for j, tid in enumerate(out.prompt_token_ids):
            lps = entries[j] if j < len(entries) else None
            tokens.append(self.tokens.string(tid))
            token_lps.append(None if lps is None or tid not in lps else lps[tid].logprob)
            if lps is not None:  # the token and its top_n by rank
                lps = {t: v for t, v in lps.items() if t == tid or (v.rank or 0) <= top_n}
            tops.append(None if lps is None else self._top_dict(lps))
            skip = skip_special
            if skip is None:
                skip = not text.startswith(self.tokens.string(tid), cur.offset)
            offsets.append(self.advance(text, cur, tid, skip))
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, tid: int, lp: float | None) -> dict[str, Any]:
        b = self.tokens.token_bytes(tid)
        lp = None if lp is None else _finite(lp)
        return {"token": self.tokens.string(tid), "logprob": lp, "bytes": list(b)}

    def chat(
        self, c: CompletionOutput, end: int, cur: LogprobCursor, skip_special: bool, top_n: int
    ) -> dict[str, Any]:
        """Logprobs of tokens ``cur.tokens:end`` in the chat shape."""
        content = []
        start = cur.tokens
        for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end], strict=False):
            self.advance(c.text, cur, tid, skip_special)
            top = sorted(lps.items(), key=lambda kv: -kv[1].logprob)[:top_n]
            entry = self._chat_entry(tid, lps[tid].logprob if tid in lps else None)
            entry["top_logprobs"] = [self._chat_entry(t, lp.logprob) for t, lp in top]
            content.append(entry)
        return {"content": content}

    def tokens_covered(
        self, c: CompletionOutput, cur: LogprobCursor, sent_bytes: int, skip_special: bool
    ) -> int:
        """How many tokens ``sent_bytes`` of text sent so far are made of: their logprobs go
        out with it.

        NOTE: counted in UTF-8 bytes, not characters: a byte-level token may hold part of a
        character, whose text is held back until the character is complete.
        """
        ids = c.token_ids
        n, size = cur.tokens, cur.text_bytes
        while n < len(ids):
            size += len(self._text_bytes(c.text, size, ids[n], skip_special))
            if size > sent_bytes:
                break
            n += 1
        return n


def vllm_prompt_logprobs(out: RequestOutput, top_n: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt token, None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}``, its own token and the ``top_n`` the
    request asked for (the engine holds more when ``echo`` with ``logprobs`` wanted more)."""
    fields = []
    for tid, e in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False):
        if e is None:
            fields.append(None)
            continue
        fields.append(
            {
                str(t): {
                    "logprob": _finite(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for t, lp in e.items()
                if t == tid or (lp.rank or 0) <= top_n
            }
        )
    return fields
