"""Codec round trips: numpy dtypes, torch tensors, nested structs, zero-copy and validation."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
import torch

from shm_engine.ipc import Decoder, Encoder, MalformedMessage, channel_pair, detach

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.float16,
          np.float32, np.float64, np.complex64]  # fmt: skip


class Params(msgspec.Struct, array_like=True):
    temperature: float
    stop: list[str]


class Req(msgspec.Struct, tag="req"):
    request_id: str
    tokens: np.ndarray
    params: Params
    extra: dict[str, np.ndarray]


class Abort(msgspec.Struct, tag="abort"):
    ids: list[str]


Msg = Req | Abort


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4), (3000,)])
def test_numpy_round_trip(dtype: type, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arr = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    frames = Encoder().encode({"a": arr, "nested": [arr, {"b": arr}]})
    out = Decoder().decode(frames)
    for got in (out["a"], out["nested"][0], out["nested"][1]["b"]):
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)


def test_non_contiguous_and_big_endian() -> None:
    arr = np.arange(100, dtype=np.int32).reshape(10, 10).T
    be = np.arange(10, dtype=">i4")
    out = Decoder().decode(Encoder().encode([arr, be]))
    np.testing.assert_array_equal(out[0], arr)
    np.testing.assert_array_equal(out[1], be)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
@pytest.mark.parametrize("n", [5, 5000])
def test_torch_round_trip(dtype: torch.dtype, n: int) -> None:
    t = (torch.randn(n) * 10).to(dtype)
    out = Decoder().decode(Encoder().encode({"t": t}))["t"]
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    assert torch.equal(out, t)


def test_typed_nested_structs() -> None:
    req = Req(
        "r1",
        np.arange(500, dtype=np.int32),
        Params(0.5, ["\n", "END"]),
        {"logits": np.ones((4, 2000), np.float32)},
    )
    frames = Encoder().encode(req)
    assert len(frames) == 2  # tokens inline (2 KB), logits as an aux frame (32 KB)
    out = Decoder(Msg).decode(frames)
    assert isinstance(out, Req) and out.request_id == "r1" and out.params == req.params
    np.testing.assert_array_equal(out.tokens, req.tokens)
    np.testing.assert_array_equal(out.extra["logits"], req.extra["logits"])
    assert Decoder(Msg).decode(Encoder().encode(Abort(["a", "b"]))) == Abort(["a", "b"])


def test_large_arrays_are_zero_copy_views_into_the_ring() -> None:
    a, b = channel_pair(1 << 20)
    big = np.arange(20_000, dtype=np.int64)  # < capacity / 2: not fragmented
    a.send({"x": big, "small": np.arange(3)})
    got = b.recv(timeout=5)
    np.testing.assert_array_equal(got["x"], big)
    ring = np.frombuffer(b._mm, dtype=np.uint8)
    start = ring.ctypes.data
    assert start <= got["x"].ctypes.data < start + len(ring)  # a view of the mapping
    kept = got["small"]
    a.send({"x": big * 2, "small": np.arange(3) + 1})
    b.recv(timeout=5)
    np.testing.assert_array_equal(kept, np.arange(3))  # inline arrays are copies
    a.close()
    b.close()


def test_zero_copy_false_gives_copies() -> None:
    a, b = channel_pair(1 << 18, zero_copy=False)
    a.send(np.arange(20_000, dtype=np.int32))
    got = b.recv(timeout=5)
    a.send(np.zeros(20_000, dtype=np.int32))
    b.recv(timeout=5)
    np.testing.assert_array_equal(got, np.arange(20_000, dtype=np.int32))


class _Holder(msgspec.Struct):
    arrays: list[object]


def test_detach_copies_every_array_out_of_the_ring() -> None:
    a, b = channel_pair(1 << 19, recv_type_b=_Holder)
    big = np.arange(20_000, dtype=np.int32)
    a.send(_Holder([big, {"t": torch.arange(5000)}, (big * 2, "text")]))  # ~200 KB
    got = detach(b.recv(timeout=5))
    for _ in range(2):  # the second wraps around onto the first's ring space
        zeros = np.zeros(20_000, dtype=np.int32)
        a.send(_Holder([zeros, {"t": torch.zeros(5000, dtype=torch.int64)}, (zeros, "")]))
        b.recv(timeout=5)
    np.testing.assert_array_equal(got.arrays[0], big)
    assert torch.equal(got.arrays[1]["t"], torch.arange(5000))
    assert got.arrays[2][1] == "text"
    np.testing.assert_array_equal(got.arrays[2][0], big * 2)
    a.close()
    b.close()


@pytest.mark.parametrize(
    "bad",
    [
        b"\x01\x00\x00\x00\x01\x05",  # truncated shape
        b"\x00\x00\x00\x00\x01\x63" + b"\x01" + b"\x00" * 7,  # unknown dtype code
        b"\x05\x00\x00\x00\x01\x05" + b"\x02" + b"\x00" * 7,  # missing frame 5
        b"\x00\x00\x00\x00\x01\x05" + b"\x02" + b"\x00" * 7 + b"\x00" * 3,  # size mismatch
        b"\x00\x00\x00\x00\x01\x05" + b"\xff" * 8,  # negative dimension
    ],
)
def test_malformed_array_headers_raise(bad: bytes) -> None:
    body = msgspec.msgpack.encode(msgspec.msgpack.Ext(1, bad))
    with pytest.raises(msgspec.DecodeError):
        Decoder().decode([body])


@pytest.mark.parametrize("zero_copy", [True, False])
def test_recv_all_mixes_single_and_multi_frame_messages(zero_copy: bool) -> None:
    """Regression: the last frame of a multi-frame message looks like a one-frame message."""
    a, b = channel_pair(1 << 20, zero_copy=zero_copy)
    big = np.arange(3000, dtype=np.int64)  # 24 KB: an aux frame
    msgs = [1, {"a": big, "b": big + 1}, b"x", {"c": big[:10]}, "end"]
    a.send_many(msgs)
    a.send_many([7, 8, 9])
    got = b.recv_all(timeout=5)  # both batches are available: one list of 8
    assert got[0] == 1 and got[2] == b"x" and got[4] == "end" and got[5:] == [7, 8, 9]
    np.testing.assert_array_equal(got[1]["a"], big)
    np.testing.assert_array_equal(got[1]["b"], big + 1)
    np.testing.assert_array_equal(got[3]["c"], big[:10])
    for m in msgs:
        a.send(m)
    assert [type(x) for x in b.recv_all(timeout=5)] == [type(m) for m in msgs]


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("multi_frame", [False, True])
def test_a_malformed_message_costs_only_itself_in_a_batch(
    multi_frame: bool, zero_copy: bool
) -> None:
    a, b = channel_pair(1 << 20, recv_type_b=Msg, zero_copy=zero_copy)
    big = np.arange(3000, dtype=np.int64)  # an aux frame: the general (multi-frame) path
    good = Req("r1", big if multi_frame else big[:4], Params(0.5, []), {})
    a.send(Abort(["x"]))
    a.send_bytes([b"\xc1 not msgpack"])
    a.send_bytes([msgspec.msgpack.encode({"type": "nope"})])  # valid msgpack, not a Msg
    a.send(good)
    got = b.recv_all(timeout=5)
    assert [type(m).__name__ for m in got] == [
        "Abort",
        "MalformedMessage",
        "MalformedMessage",
        "Req",
    ]
    assert isinstance(got[1], MalformedMessage) and "malformed" in got[1].error
    np.testing.assert_array_equal(got[3].tokens, good.tokens)
    a.send_bytes([b"\xc1"])
    with pytest.raises(msgspec.DecodeError):
        b.recv(timeout=5)  # a single receive raises instead


def test_an_impossible_array_shape_is_a_decode_error() -> None:
    # 0 elements pass the size check, but no numpy array has dimensions this large.
    head = struct.pack("<IBB3q", 0, 3, 5, 2**62, 2**62, 0)
    bad = msgspec.msgpack.encode(msgspec.msgpack.Ext(1, head))
    a, b = channel_pair(4096)
    a.send(1)
    a.send_bytes([bad])
    a.send(3)
    got = b.recv_all(timeout=5)
    assert got[0] == 1 and got[2] == 3 and isinstance(got[1], MalformedMessage), got
    a.send_bytes([bad])
    with pytest.raises(msgspec.DecodeError, match="shape"):
        b.recv(timeout=5)


def test_unsupported_dtypes_are_a_type_error() -> None:
    with pytest.raises(TypeError):
        Encoder().encode(np.zeros(3, dtype=np.longdouble))
