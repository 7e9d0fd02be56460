"""GGUF metadata: the file's header read into a config and a tokenizer, without torch.

Frontends need only this (their tokenizer and the model's limits), so it stays free of torch,
which costs ~1.5 s and ~230 MB to import; `gguf_loader` adds the weights.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField
from gguf.quants import dequantize as gguf_dequantize

from ..sampling_params import checked_defaults
from .config import ModelConfig
from .tokenizer import Tokenizer

# llama.cpp's general.sampling.* keys that name a request field: its defaults for requests
# that leave the field unset, as generation_config.json's are in a Hugging Face directory
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}

_U64 = struct.Struct("<Q")


class FastGGUFReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap.

    Parsing the ~100k tokenizer strings slices the map ~250k times; np.memmap's per-slice
    __array_finalize__ makes that 2-3x slower than slicing an ndarray that shares the mapping.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        if isinstance(value, np.memmap):
            self._mmap = getattr(value, "_mmap", None)
            value = value.view(np.ndarray)
        self._data = value

    def _get_field_parts(self, orig_offs: int, raw_type: int):  # type: ignore[override]
        """The package's parts for one field, arrays of strings or scalars read in one pass.

        Why: the package reads an array element by element through ``_get`` (~5 us each), and a
        tokenizer's vocabulary, merges, scores and token types are ~200k elements: 1 s of every
        engine start and again in the frontend. The parts are the same views, built directly.
        """
        if (
            GGUFValueType(raw_type) != GGUFValueType.ARRAY
            or getattr(self, "byte_order", "I") != "I"
        ):
            return super()._get_field_parts(orig_offs, raw_type)
        itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if len(itype) != 1 or len(alen) != 1:
            raise ValueError(f"array header at {orig_offs} runs past the end of the file")
        item = GGUFValueType(int(itype[0]))
        count, offs = int(alen[0]), orig_offs + 12
        parts: list[np.ndarray] = [itype, alen]
        data = self.data
        if item == GGUFValueType.STRING:
            if offs + 8 * count > len(data):  # every string takes at least its length word
                raise ValueError(f"string array of {count} items at {orig_offs} runs past the file")
            for _ in range(count):
                if offs + 8 > len(data):
                    raise ValueError(f"string length at {offs} runs past the end of the file")
                (n,) = _U64.unpack_from(data, offs)
                if offs + 8 + n > len(data):
                    raise ValueError(f"string at {offs} runs past the end of the file")
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + n])
                offs += 8 + n
            types = [GGUFValueType.ARRAY] + [item] * (count > 0)  # as the package's
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), types
        nptype = self.gguf_scalar_to_np.get(item)
        if nptype is None:  # nested arrays: the package's own reading
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, count)
        if len(values) != count:
            raise ValueError(f"array of {count} items at {orig_offs} runs past the file")
        parts += (values[i : i + 1] for i in range(count))
        types = [GGUFValueType.ARRAY] + [item] * (count > 0)
        return 12 + values.nbytes, parts, list(range(2, len(parts))), types

    def release(self, offset: int, nbytes: int) -> None:
        """Drop the file pages of a tensor already copied out, so they leave this process's RSS
        (the kernel page cache keeps them; a later access faults them back in)."""
        mm = getattr(self, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        start = offset - offset % mmap.PAGESIZE
        end = offset + nbytes
        end -= end % mmap.PAGESIZE  # pages shared with the next tensor stay
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def read_gguf(path: str | Path) -> GGUFReader:
    try:
        return FastGGUFReader(path)
    except (AttributeError, TypeError):  # a gguf version that stores data differently
        return GGUFReader(path)


def field_value(field: ReaderField) -> Any:
    """Decode one metadata field to a Python scalar, str or list (independent of gguf version)."""
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.STRING:
        return _to_str(field.parts[field.data[0]])
    if kind == GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        if not field.data:
            return []
        if sub == GGUFValueType.STRING:
            return [_to_str(field.parts[i]) for i in field.data]
        if sub == GGUFValueType.ARRAY:
            raise NotImplementedError(f"nested arrays in GGUF field {field.name}")
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        # shortest decimal that round-trips the float32: 1e-05, not 9.999999747378752e-06, so a
        # config read from GGUF equals the config.json it was converted from
        return float(np.format_float_scientific(value, unique=True, trim="-"))
    return value.item()


def _to_str(part: np.ndarray) -> str:
    raw = part.tobytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace")


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {
        name: field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")
    }


def gguf_sampling_defaults(meta: dict[str, Any], path: Path) -> dict[str, float | int]:
    """The sampling defaults a GGUF file's metadata carries ({} for most files)."""
    out: dict[str, float | int] = {}
    for key, name in _SAMPLING_KEYS.items():
        if (value := meta.get(key)) is not None:
            out[name] = int(value) if name == "top_k" else float(value)
    return checked_defaults(out, path)


def read_gguf_info(
    path: Path,
) -> tuple[GGUFReader, ModelConfig, Tokenizer, dict[str, float | int]]:
    """Open a GGUF file and parse its config, tokenizer and sampling defaults; the reader keeps
    the tensors."""
    try:
        reader = read_gguf(path)
    except (ValueError, IndexError, struct.error) as e:  # numpy's name neither file nor cause
        raise ValueError(f"{path}: corrupt or truncated GGUF file: {e}") from e
    if getattr(reader, "byte_order", "I") != "I":
        # The dequantizers read little-endian bytes: a big-endian file would load as garbage.
        raise NotImplementedError(f"{path}: big-endian GGUF files are not supported")
    meta = gguf_metadata(reader)
    if int(meta.get("split.count", 1)) > 1:
        # One shard holds some of the tensors: it would fail as "missing tensors", and a tied
        # LM head would be guessed from output.weight's absence there.
        raise NotImplementedError(
            f"{path}: shard {int(meta.get('split.no', 0)) + 1} of a GGUF split into "
            f"{int(meta['split.count'])} files; merge them into one first "
            "(llama.cpp: llama-gguf-split --merge FIRST_SHARD OUT.gguf)"
        )
    by_name = {t.name: t for t in reader.tensors}
    embed = by_name.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    rope_factors = None
    if "rope_freqs.weight" in by_name:
        t = by_name["rope_freqs.weight"]
        rope_factors = tuple(gguf_dequantize(np.asarray(t.data), t.tensor_type).ravel().tolist())
    config = ModelConfig.from_gguf_metadata(
        meta,
        vocab_size=int(embed.shape[-1]),
        tie_word_embeddings="output.weight" not in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name,
        rope_freq_factors=rope_factors,
    )
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    defaults = gguf_sampling_defaults(meta, path)
    reader.fields.clear()  # ~250k small arrays (the vocabulary); everything needed is parsed
    return reader, config, tokenizer, defaults
