"""msgspec msgpack codec that moves numpy arrays and torch tensors as raw aux frames.

A message is a list of frames: frame 0 is the msgpack body, frames 1.. are the raw bytes of the
arrays it contains.  In the body each array is a msgpack Ext (code 1 = numpy, 2 = torch) holding
dtype, shape and the frame index, so token ids and logits never become lists of Python ints
(decoding 500 ints from msgpack costs ~15 us; viewing an int32 frame costs ~1 us).  Arrays of at
most ``inline_max`` bytes (default 4 KiB) travel packed inside the Ext instead of in an aux frame:
a per-frame cost (pointer setup, a record) would dominate for them.

Lifetime rule: arrays that travelled as aux frames are zero-copy views of the received frames.
When the frames come from ``Channel.recv``/``recv_all`` they point into the ring and stay valid
only until the next receive call on that channel; ``.copy()`` whatever must outlive it (or open the
channel with ``zero_copy=False``).  Small (inline) arrays are always fresh copies, free of that
rule.  Torch tensors come back as torch tensors (``torch.from_numpy``, same memory and rule).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

Buffer = bytes | bytearray | memoryview

EXT_NUMPY = 1
EXT_TORCH = 2

# Ext payload: u32 frame index (0 = data inline after the header), u8 ndim, u8 dtype code,
# ndim * i64 shape.  A closed table of dtype codes means nothing from the wire reaches np.dtype().
_HEAD = struct.Struct("<IBB")
_HEAD1 = struct.Struct("<IBBq")  # the same header followed by the one dimension of a 1-D array
_Ext = msgspec.msgpack.Ext
_SHAPE = [struct.Struct(f"<{n}q") for n in range(33)]
_CODES = [
    "?",
    "i1",
    "u1",
    "<i2",
    "<u2",
    "<i4",
    "<u4",
    "<i8",
    "<u8",
    "<f2",
    "<f4",
    "<f8",
    "<c8",
    "<c16",
]
_DTYPE_OF = [np.dtype(c) for c in _CODES]
_CODE_OF = {dt: i for i, dt in enumerate(_DTYPE_OF)}
_BF16 = len(_CODES)  # numpy has no bfloat16: travels as int16 bits, restored by torch
_DTYPE_OF.append(np.dtype("<i2"))


def _torch_module() -> Any:
    return sys.modules.get("torch")


class Encoder:
    """Encode an object into ``[body, *aux_frames]``; not thread-safe (one per sending thread)."""

    def __init__(self, inline_max: int = 4096) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._aux: list[Any] | None = None
        self.inline_max = inline_max

    def encode(self, obj: Any) -> list[Buffer]:
        """Return the frames of one message; aux frames reference the arrays' memory (no copy)."""
        aux: list[Any] = []
        self._aux = aux
        try:
            body = self._enc.encode(obj)
        finally:
            self._aux = None
        return [body, *aux] if aux else [body]

    def _array_ext(self, arr: np.ndarray, code: int, dtype_code: int) -> msgspec.msgpack.Ext:
        ndim = arr.ndim
        if arr.nbytes <= self.inline_max:
            # Inline (frame index 0: the bytes follow the header); tobytes() is C order even for
            # a non-contiguous array, so no contiguity check is needed on this hot path.
            if ndim == 1:
                return _Ext(code, _HEAD1.pack(0, 1, dtype_code, arr.shape[0]) + arr.tobytes())
            head = _HEAD.pack(0, ndim, dtype_code) + _SHAPE[ndim].pack(*arr.shape)
            return _Ext(code, head + arr.tobytes())
        aux = self._aux
        if aux is None:
            raise TypeError("large arrays can only be encoded through Encoder.encode")
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (ascontiguousarray would turn 0-d into 1-d)
        aux.append(arr.reshape(-1).view(np.uint8))
        return _Ext(code, _HEAD.pack(len(aux), ndim, dtype_code) + _SHAPE[ndim].pack(*arr.shape))

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            dc = _CODE_OF.get(obj.dtype)
            if dc is None:
                if obj.dtype.kind not in "biufc" or obj.ndim > 32:
                    raise TypeError(f"unsupported array {obj.dtype} ndim={obj.ndim}")
                obj = obj.astype(obj.dtype.newbyteorder("<"))
                dc = _CODE_OF.get(obj.dtype)
                if dc is None:  # e.g. longdouble
                    raise TypeError(f"unsupported array dtype {obj.dtype}")
            return self._array_ext(obj, EXT_NUMPY, dc)
        if isinstance(obj, np.generic):
            return obj.item()
        torch = _torch_module()
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                raise TypeError("only CPU tensors can be sent")
            if t.dtype == torch.bfloat16:
                return self._array_ext(t.contiguous().view(torch.int16).numpy(), EXT_TORCH, _BF16)
            arr = t.contiguous().numpy()
            dc = _CODE_OF.get(arr.dtype)
            if dc is None:
                raise TypeError(f"unsupported tensor dtype {t.dtype}")
            return self._array_ext(arr, EXT_TORCH, dc)
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class Decoder:
    """Decode frames into ``type`` (any msgspec type); arrays are views of the frames."""

    def __init__(self, type: Any = Any, *, copy_arrays: bool = False) -> None:
        self._dec = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook)
        self._frames: Sequence[Buffer] = ()
        self._copy = copy_arrays

    def decode(self, frames: Sequence[Buffer]) -> Any:
        """Decode one message; raises msgspec.DecodeError/ValidationError on a bad body."""
        self._frames = frames
        try:
            return self._dec.decode(frames[0])
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != EXT_NUMPY and code != EXT_TORCH:
            raise msgspec.DecodeError(f"unknown ext code {code}")
        try:
            index, ndim, dc = _HEAD.unpack_from(data, 0)
            shape = _SHAPE[ndim].unpack_from(data, 6)
            dtype = _DTYPE_OF[dc]
        except (struct.error, IndexError) as e:
            raise msgspec.DecodeError(f"malformed array header: {e}") from None
        off = 6 + 8 * ndim
        if ndim == 1:
            count = shape[0]
            if count < 0:
                raise msgspec.DecodeError("negative dimension")
        else:
            count = 1
            for s in shape:
                if s < 0:
                    raise msgspec.DecodeError("negative dimension")
                count *= s
        if index == 0:
            if count * dtype.itemsize != len(data) - off:
                raise msgspec.DecodeError("array data size does not match its shape")
            # Inline: tiny, so copy (aligned, and free of the lifetime rule).
            arr = np.frombuffer(data, dtype, count, off).copy()
        else:
            frames = self._frames
            if off != len(data) or not 1 <= index < len(frames):
                raise msgspec.DecodeError(f"array references missing frame {index}")
            buf = frames[index]
            if count * dtype.itemsize != len(buf):
                raise msgspec.DecodeError("array frame size does not match its shape")
            arr = np.frombuffer(buf, dtype)
            if self._copy:
                arr = arr.copy()
        if ndim != 1:
            try:
                arr = arr.reshape(shape)
            except ValueError as e:  # e.g. an empty array with absurd dimensions
                raise msgspec.DecodeError(f"bad array shape: {e}") from None
        if code == EXT_NUMPY:
            if dc == _BF16:
                raise msgspec.DecodeError("bfloat16 needs a torch ext")
            return arr
        import torch

        t = torch.from_numpy(arr) if arr.flags.writeable else torch.from_numpy(arr.copy())
        return t.view(torch.bfloat16) if dc == _BF16 else t


def detach(obj: Any) -> Any:
    """``obj`` with every array in it (in lists, tuples, dicts, structs) copied out of the frames
    it was decoded from: for what is kept past the next receive (the lifetime rule above), such
    as a message another thread handles later."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, list | tuple):
        return type(obj)(detach(x) for x in obj)
    if isinstance(obj, dict):
        return {k: detach(v) for k, v in obj.items()}
    if isinstance(obj, msgspec.Struct):
        fields = {f: detach(getattr(obj, f)) for f in obj.__struct_fields__}
        return msgspec.structs.replace(obj, **fields)
    torch = _torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.clone()
    return obj
