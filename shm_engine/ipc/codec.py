"""msgspec msgpack codec that moves numpy arrays and torch tensors as raw aux frames.

A message is a list of frames: frame 0 is the msgpack body, frames 1.. are the raw bytes of the
arrays it contains.  In the body each array is a msgpack Ext (code 1 = numpy, 2 = torch) holding
only dtype, shape and the frame index, so token ids and logits never become lists of Python ints
(decoding 500 ints from msgpack costs ~15 us; viewing an int32 frame costs ~1 us).

Lifetime rule: arrays returned by ``Decoder.decode`` are zero-copy views of the frames passed in.
When the frames come from ``Channel.recv``/``recv_all`` they point into the ring and stay valid
only until the next receive call on that channel; ``.copy()`` whatever must outlive it (or open the
channel with ``zero_copy=False``).  Torch tensors come back as torch tensors sharing that memory
(``torch.from_numpy``), so the same rule applies to them.
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

Buffer = bytes | bytearray | memoryview

EXT_NUMPY = 1
EXT_TORCH = 2

# Ext payload: u32 frame index, u8 ndim, u8 len(dtype str), dtype str, ndim * i64 shape.
_HEAD = struct.Struct("<IBB")
_DTYPE_RE = re.compile(r"^[<>|=][biufc][0-9]{1,2}$")
_BF16 = "bf16"  # numpy has no bfloat16: travels as int16 bits, restored by torch


def _torch_module() -> Any:
    return sys.modules.get("torch")


class Encoder:
    """Encode an object into ``[body, *aux_frames]``; not thread-safe (one per sending thread)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._aux: list[Any] | None = None

    def encode(self, obj: Any) -> list[Buffer]:
        """Return the frames of one message; aux frames reference the arrays' memory (no copy)."""
        aux: list[Any] = []
        self._aux = aux
        try:
            body = self._enc.encode(obj)
        finally:
            self._aux = None
        return [body, *aux] if aux else [body]

    def encode_into(self, obj: Any, buf: bytearray, aux: list[Any]) -> None:
        """Append the body to ``buf`` and the aux frames to ``aux`` (batch path of send_many)."""
        self._aux = aux
        try:
            self._enc.encode_into(obj, buf, -1)
        finally:
            self._aux = None

    def _array_ext(self, arr: np.ndarray, code: int, dtype_str: str) -> msgspec.msgpack.Ext:
        aux = self._aux
        if aux is None:
            raise TypeError("arrays can only be encoded through Encoder.encode")
        arr = np.ascontiguousarray(arr)
        index = len(aux) + 1
        aux.append(arr.reshape(-1).view(np.uint8))
        d = dtype_str.encode()
        data = _HEAD.pack(index, arr.ndim, len(d)) + d + struct.pack(f"<{arr.ndim}q", *arr.shape)
        return msgspec.msgpack.Ext(code, data)

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise TypeError(f"unsupported array dtype {obj.dtype}")
            return self._array_ext(obj, EXT_NUMPY, obj.dtype.str)
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
            return self._array_ext(arr, EXT_TORCH, arr.dtype.str)
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
        if code not in (EXT_NUMPY, EXT_TORCH):
            raise msgspec.DecodeError(f"unknown ext code {code}")
        try:
            index, ndim, dlen = _HEAD.unpack_from(data, 0)
            off = _HEAD.size
            dtype_str = bytes(data[off : off + dlen]).decode("ascii")
            off += dlen
            shape = struct.unpack_from(f"<{ndim}q", data, off)
            if off + 8 * ndim != len(data):
                raise ValueError("trailing bytes")
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise msgspec.DecodeError(f"malformed array header: {e}") from None
        frames = self._frames
        if not 1 <= index < len(frames):
            raise msgspec.DecodeError(f"array references missing frame {index}")
        bf16 = code == EXT_TORCH and dtype_str == _BF16
        if not bf16 and not _DTYPE_RE.match(dtype_str):
            raise msgspec.DecodeError(f"unsupported dtype {dtype_str!r}")
        dtype = np.dtype("<i2" if bf16 else dtype_str)
        count = 1
        for s in shape:
            if s < 0:
                raise msgspec.DecodeError("negative dimension")
            count *= s
        frame = frames[index]
        if count * dtype.itemsize != len(frame):
            raise msgspec.DecodeError("array frame size does not match its shape")
        arr = np.frombuffer(frame, dtype=dtype).reshape(shape)
        if self._copy:
            arr = arr.copy()
        if code == EXT_NUMPY:
            return arr
        import torch

        t = torch.from_numpy(arr) if arr.flags.writeable else torch.from_numpy(arr.copy())
        return t.view(torch.bfloat16) if bf16 else t
