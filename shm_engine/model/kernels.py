"""Python wrapper of the native W8xA16 / fp32 kernels (``shm_engine._kernels_cffi``).

This is the only module that imports the cffi extension.  Every function takes CPU torch tensors,
checks dtype / shape / contiguity and raises ``ValueError`` / ``TypeError`` with a clear message
before calling into C; the C code releases the GIL and runs on a persistent pthread pool
(``set_num_threads``).

Quantisation, W8 (group 32) x A16 (per token); identical on every dispatch path, so paths and
thread counts agree bit for bit:

* weights, once at load: int8 with a scale per (output channel, 32 consecutive k):
  ``s = fp16(max|w| / 127 * 2^E) * 2^-E`` (``E`` per matrix keeps the fp16 scales in range;
  ``scale_mult = 2^-E``), ``q = rint(w / s)`` in [-127, 127]; packed in blocks of 16 channels,
  per group 8 rows of 16 channels x 4 consecutive k (an AMX-INT8 B tile; ``vpmovsxbw`` of half a
  row gives a zmm of int16 pairs for ``vpdpwssd``); N padded to 16 and K to 32 with zeros;
* activations, per call: per row (token) ``xq = rint(x * 32767 / max|x|)`` in [-32767, 32767]
  (int16, symmetric), ``sx = max|x| / 32767``;
* per group ``dot = sum_k xq * q`` exactly in int32 (AVX512-VNNI ``vpdpwssd``, AVX2
  ``vpmaddwd``), then ``acc = fma(float(dot), s_g, acc)`` over the groups in order;
* ``y = acc * (sx * scale_mult) + bias``.

Path "amx" (CPUs with AMX-BF16 and AMX-INT8; the best path there) runs everything as "vnni"
except linear calls of >= 9 rows. Those of >= ``AMX_BF16_MIN_ROWS`` (64) rows whose weight
has ``act_bf16`` (the default) round the activations to bf16 (nearest even) instead of int16 and
run on bf16 tiles (native/kernels/gemm_amx.c), with the weights entering exactly and the group
scales applied in fp32 as above; their results differ from the other paths by the bf16 rounding.
The rest run on int8 tiles (native/kernels/gemm_amx8.c) with exactly "vnni"'s results. Nothing
depends on the thread count.

KV cache layout (per layer): ``k_cache, v_cache: [num_blocks, Hkv, slab_rows, D]``, float32,
float16 or int8 (``KV_DTYPES``; fp16 is rounded to nearest even on write and widened exactly on
read, the attention math is fp32; int8 rows carry a scale each and keys are Hadamard-rotated, see
model/kv_cache.py); token slot ``s`` lives in block ``s // block_size`` at offset
``s % block_size`` of every head's slab.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from shm_engine._kernels_cffi import ffi, lib
from shm_engine.model.hugepages import HugeArena
from shm_engine.model.kv_cache import check_kv_dtype, kv_block_size

__all__ = [
    "AMX_BF16_MIN_ROWS",
    "PATHS",
    "KV_DTYPES",
    "LayerScratch",
    "LayerStep",
    "LlamaLayer",
    "PackedLinear",
    "argmax_rows",
    "best_path",
    "get_num_threads",
    "get_path",
    "group_dots",
    "linear",
    "LlamaStack",
    "llama_forward",
    "llama_layer_forward",
    "ModelEnds",
    "model_forward",
    "padded_k",
    "pool_held",
    "paged_attention",
    "quantize_rows",
    "rmsnorm",
    "rope",
    "rope_cos_sin",
    "rope_inv_freq",
    "set_num_threads",
    "set_path",
    "silu_mul",
    "use_path",
    "write_kv",
]

PATHS = {"portable": 0, "avx2": 1, "vnni": 2, "amx": 3}
_PATH_NAMES = {v: k for k, v in PATHS.items()}
# On path "amx", act_bf16 weights take the bf16 kernel from this many rows (native SHMK_AMX_MIN_M)
AMX_BF16_MIN_ROWS = int(lib.shmk_amx_bf16_min_rows())


# --------------------------------------------------------------------------- dispatch / threads
def best_path() -> str:
    """Fastest path this CPU supports: "amx", "vnni", "avx2" or "portable"."""
    return _PATH_NAMES[lib.shmk_best_path()]


def get_path() -> str:
    """Path in use (default: best_path(), or $SHMK_PATH if set to a supported one)."""
    return _PATH_NAMES[lib.shmk_get_path()]


def set_path(name: str) -> None:
    """Force a dispatch path ("portable", "avx2", "vnni", "amx"); ValueError if the CPU lacks it."""
    if name not in PATHS:
        raise ValueError(f"unknown kernel path {name!r}; expected one of {sorted(PATHS)}")
    if lib.shmk_set_path(PATHS[name]) != 0:
        raise ValueError(f"kernel path {name!r} is not supported by this CPU (best: {best_path()})")


@contextlib.contextmanager
def use_path(name: str) -> Iterator[None]:
    """Temporarily force a dispatch path (process wide)."""
    old = get_path()
    set_path(name)
    try:
        yield
    finally:
        set_path(old)


def set_num_threads(n: int) -> int:
    """Resize the kernel thread pool (the calling thread counts as one); returns the new size."""
    if int(n) < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    return int(lib.shmk_set_num_threads(int(n)))


def get_num_threads() -> int:
    return int(lib.shmk_get_num_threads())


@contextlib.contextmanager
def pool_held() -> Iterator[None]:
    """Keep idle pool threads spinning (up to ~1 ms) between the parallel calls of the block.

    NOTE: a model forward makes ~270 parallel calls back to back. A worker that ran out of tasks
    while the caller finished a long one used to park after ~30 us, and its futex wake-up at the
    next call took ~45 us on this VM (b32 decode: 65 parks a step). Outside such blocks the short
    spin stays, so an idle engine does not hold a core the frontend needs.
    """
    lib.shmk_pool_hold(1)
    try:
        yield
    finally:
        lib.shmk_pool_hold(0)


def padded_k(k: int) -> int:
    """K rounded up to a multiple of 32 (row length of quantised activations)."""
    return int(lib.shmk_padded_k(k))


# --------------------------------------------------------------------------- validation helpers
def _check(t: torch.Tensor, name: str, dtype: torch.dtype | Sequence[torch.dtype], ndim: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _row_spans(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Chunks of about ``chunk_rows`` of n rows, each starting on a 16-channel block (the packed
    layout's unit), for packing a matrix a chunk at a time."""
    step = max(16, chunk_rows // 16 * 16)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _packed_words(rows: torch.Tensor, group_bytes: int) -> torch.Tensor:
    """A matrix's weight bytes in channel order (uint8 or int8 [n, groups * group_bytes], as a
    GGUF Q4_0 / Q4_1 / Q8_0 block holds a group's) moved in words of 4 into the packed layout:
    [block of 16 channels, group, word, channel] (int32, flat; channels past n are zeros)."""
    n, nbytes = rows.shape
    nb = -(-n // 16)
    qp = torch.zeros(nb * 16, nbytes, dtype=torch.uint8)
    qp[:n] = rows.view(torch.uint8)
    words = qp.view(torch.int32).view(nb, 16, nbytes // group_bytes, group_bytes // 4)
    return words.permute(0, 2, 3, 1).reshape(-1)


def _packed_fp16(t: torch.Tensor, mult: float) -> torch.Tensor:
    """Group values (fp32 [n, groups]: scales or minimums) divided by ``mult`` as fp16 bits in
    the packed layout's [block of 16 channels, group, channel] order (int16, flat), normals or 0
    only (the kernels' contract)."""
    n, groups = t.shape
    nb = -(-n // 16)
    h = torch.zeros(nb * 16, groups, dtype=torch.float16)
    h[:n] = (t.double() / mult).to(torch.float16)
    h[h.abs() < 2.0**-14] = 0
    return h.view(nb, 16, groups).permute(0, 2, 1).reshape(-1).view(torch.int16)


def _shape(t: torch.Tensor, name: str, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _f32(t: torch.Tensor):
    return ffi.cast("float *", t.data_ptr())


def _i32(t: torch.Tensor):
    return ffi.cast("int32_t *", t.data_ptr())


def _i64(t: torch.Tensor):
    return ffi.cast("int64_t *", t.data_ptr())


def _i8(t: torch.Tensor):
    return ffi.cast("int8_t *", t.data_ptr())


def _u8(t: torch.Tensor):
    return ffi.cast("uint8_t *", t.data_ptr())


def _i16(t: torch.Tensor):
    return ffi.cast("int16_t *", t.data_ptr())


def _u16(t: torch.Tensor):
    return ffi.cast("uint16_t *", t.data_ptr())


def _cpu_f32(t: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 CPU copy of ``t`` (``t`` itself when it already is one)."""
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _as_i64(t: torch.Tensor, name: str) -> torch.Tensor:
    _check(t, name, (torch.int64, torch.int32), 1)
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def _as_i32(t: torch.Tensor, name: str, ndim: int) -> torch.Tensor:
    _check(t, name, (torch.int32, torch.int64), ndim)
    if t.dtype == torch.int32:
        return t
    # NOTE: checked before narrowing: 2**32 + 3 would otherwise pass as a valid 3.
    if t.numel() and (int(t.min()) < -(2**31) or int(t.max()) >= 2**31):
        raise ValueError(f"{name} has values beyond int32")
    return t.to(torch.int32)


# --------------------------------------------------------------------------- W8 x A16 linear
class PackedLinear:
    """A group-32 weight packed for the native GEMM (build once at load with ``from_float``).

    Attributes: ``n``, ``k`` (logical shape [n, k]), ``kp`` (k padded to 32), ``groups``
    (kp / 32), ``packed`` (int8, flat, ceil(n/16)*16 * kp bytes; half that for W4), ``scales``
    (fp16 bits as int16, flat [ceil(n/16)][groups][16]), ``scale_mult`` (power of two), ``bias``
    (fp32 [n] or None), ``act8`` (8-bit activations; a W8 weight is then packed rotated: see
    ``from_float``),
    ``mins`` (W4 only: the group minimums, laid out as ``scales``; see ``from_float``).
    """

    __slots__ = (
        "n", "k", "kp", "groups", "packed", "scales", "scale_mult", "bias", "act_bf16", "act8",
        "mins", "_c",
    )  # fmt: skip

    def __init__(
        self, n, k, packed, scales, scale_mult, bias=None, act_bf16=True, act8=False, mins=None
    ):
        """Wrap already packed data (as ``from_float`` makes it); checked against n and k."""
        if int(n) < 1 or int(k) < 1:
            raise ValueError(f"n and k must be >= 1, got n={n}, k={k}")
        self.n, self.k, self.kp = int(n), int(k), padded_k(k)
        self.groups = self.kp // 32
        # NOTE: C reads exactly these many elements through the raw pointers below
        _check(packed, "packed", torch.int8, 1)
        _shape(packed, "packed", (self.packed_bytes(self.n, self.k, mins is not None),))
        _check(scales, "scales", torch.int16, 1)
        _shape(scales, "scales", (int(lib.shmk_packed_scales(self.n, self.k)),))
        if mins is not None:
            _check(mins, "mins", torch.int16, 1)
            _shape(mins, "mins", tuple(scales.shape))
        if bias is not None:
            _check(bias, "bias", torch.float32, 1)
            _shape(bias, "bias", (self.n,))
        if not math.isfinite(float(scale_mult)):
            raise ValueError(f"scale_mult must be finite, got {scale_mult}")
        self.packed, self.scales, self.scale_mult, self.bias = packed, scales, scale_mult, bias
        self.act_bf16 = bool(act_bf16)
        c = ffi.new("shmk_linear_t *")
        c.n, c.k = self.n, self.k
        c.act_bf16 = int(self.act_bf16)
        c.packed = _i8(packed)
        c.scales = _u16(scales)
        c.scale_mult = float(scale_mult)
        c.bias = _f32(bias) if bias is not None else ffi.NULL
        self.act8 = bool(act8)
        c.act8 = int(self.act8)
        self.mins = mins
        c.mins = _u16(mins) if mins is not None else ffi.NULL
        self._c = c

    @property
    def w4(self) -> bool:
        """4-bit weights (``from_float(w4=True)``)."""
        return self.mins is not None

    @staticmethod
    def packed_bytes(n: int, k: int, w4: bool = False) -> int:
        """Bytes of ``packed`` for an [n, k] weight."""
        return int(lib.shmk_packed_bytes_w4(n, k) if w4 else lib.shmk_packed_bytes(n, k))

    @staticmethod
    def arena_bytes(n: int, k: int, w4: bool = False) -> int:
        """What packing an [n, k] weight takes from a HugeArena."""
        scales = HugeArena.footprint(int(lib.shmk_packed_scales(n, k)), torch.int16)
        packed = HugeArena.footprint(PackedLinear.packed_bytes(n, k, w4), torch.int8)
        return packed + scales * (2 if w4 else 1)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_bf16: bool = True,
        arena: HugeArena | None = None,
        act8: bool = False,
        w4: bool = False,
    ) -> PackedLinear:
        """Quantise and pack a float weight [n, k] (any float dtype; copied to fp32 if needed).

        ``act_bf16=False`` keeps int16 activations on the AMX path too (see path "amx").
        ``arena``: place the packed weight and scales there (huge pages) instead of the heap.
        ``act8``: every call quantises the activations to 8 bits (gemm_a8.c: faster than the int16
        kernel from ~16 rows on path "vnni", portable C elsewhere; less accurate:
        docs/kernels.md). The kernel rotates each 32 k of a row by the Walsh-Hadamard matrix
        H before rounding, so the weight is packed as ``rotate_groups(weight)``: W H / 32,
        which that rotated row multiplies to W x; its bytes are stored + 128.
        ``w4``: 4-bit weights, w = s u + m with u in [0, 15] and a scale s and minimum m per
        (channel, 32 k), llama.cpp's Q4_1 grid or, where it fits better, Q4_0's (native w4.c):
        tensors a GGUF file holds in those formats pack back exactly. The GEMM runs them on
        int16 activations as W8, plus each group's activation sum times m; with ``act8`` on
        8-bit activations a scale per 16 k, unrotated (gemm_w4a8.c: vpmaddubsw, faster on
        AVX2; the weight is packed the same either way)."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError("weight must be a 2-D torch.Tensor [n, k]")
        if not weight.is_floating_point():
            raise TypeError(f"weight must be floating point, got {weight.dtype}")
        w = _cpu_f32(weight)
        n, k = w.shape
        if n < 1 or k < 1:
            raise ValueError(f"weight must be non-empty, got shape {tuple(w.shape)}")
        packed, scales, mins = cls._buffers(n, k, arena, w4)
        if w4:
            amax = float(lib.shmk_weights_amax(_f32(w), w.numel()))
            pack = lib.shmk_pack_rows_w4(_f32(w), n, k, amax, _u8(packed), _u16(scales), _u16(mins))
            mult = float(pack)
        else:
            if act8:
                w = rotate_groups(w)  # [n, kp]: the padded columns are no longer zeros
            mult = float(lib.shmk_pack_weights(_f32(w), n, w.shape[1], _i8(packed), _u16(scales)))
        if act8 and not w4:
            # NOTE: + 128 (mod 256): stored as u8, vpdpbusd's unsigned operand (gemm_a8.c)
            packed.bitwise_xor_(-128)
        b = None
        if bias is not None:
            b = _cpu_f32(bias)
            _shape(b, "bias", (n,))
        return cls(n, k, packed, scales, mult, b, act_bf16, act8, mins)

    @classmethod
    def from_w4_grid(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None = None,
        arena: HugeArena | None = None,
        act8: bool = False,
    ) -> PackedLinear:
        """Pack a matrix already on 4-bit grids, w[j, k] = scales[j, g] u[j, k] + mins[j, g] with
        g = k // 32 (q uint8 [n, k / 2]: u two to a byte in ``loader.W4Grid``'s order; scales,
        mins fp32 [n, groups]), as a GGUF file's Q4_0 / Q4_1 / Q4_K blocks hold it: exact but
        for rounding the scales and minimums to fp16 (nearest even; those of Q4_0 and Q4_1 are
        fp16 already). ``act8``: run it on 8-bit activations (``from_float``).

        NOTE: the same layout as ``from_float(w4=True)`` writes in C (w4.c), built with torch:
        byte 4 r + t of a group's 16 is, as it stands, the byte t of nibble row r (k 4 r + t low,
        16 + 4 r + t high), so the bytes only move in words of 4."""
        _check(q, "q", torch.uint8, 2)
        n, half = q.shape
        if n < 1 or half < 1 or half % 16:
            raise ValueError(f"q must hold whole groups of 32 nibbles, got shape {tuple(q.shape)}")
        k = 2 * half
        groups = k // 32
        for t, name in ((scales, "scales"), (mins, "mins")):
            _check(t, name, torch.float32, 2)
            _shape(t, name, (n, groups))
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} must be finite")
        amax = max(float(scales.abs().max()), float(mins.abs().max()))
        # as w4.c: the largest |scale| or |minimum| lands in [2^14, 2^15) of fp16
        e = math.frexp(amax)[1] if amax > 0 else 0
        mult = 2.0 ** (e - 15)
        packed, sbuf, mbuf = cls._buffers(n, k, arena, w4=True)
        packed.view(torch.int32).copy_(_packed_words(q, 16))  # a group's 4 nibble rows
        sbuf.copy_(_packed_fp16(scales, mult))
        mbuf.copy_(_packed_fp16(mins, mult))
        b = None if bias is None else _cpu_f32(bias)
        return cls(n, k, packed, sbuf, mult, b, act8=act8, mins=mbuf)

    @classmethod
    def from_q8_0(
        cls,
        n: int,
        k: int,
        rows: Callable[[int, int], torch.Tensor],
        chunk_rows: int = 4096,
        arena: HugeArena | None = None,
    ) -> PackedLinear | None:
        """Pack an [n, k] matrix from GGUF Q8_0 blocks, ``rows(a, b)`` giving rows a .. b - 1's
        (uint8 [b - a, k / 32 * 34]: per 32 weights an fp16 scale d and 32 int8 q, w = d q),
        keeping the file's values exactly; None where a q is -128 (the kernels' weights lie in
        -127 .. 127) or a scale is negative (the W8 layout's scales are magnitudes, as its
        packer makes them: the lookup and unpack read them so): pack the floats instead.

        NOTE: the W8 layout holds a group's 32 int8 of a channel as 8 words of 4 bytes in k
        order (shmk_dequant_channels), so the bytes only move in words; the scales are the
        file's, multiplied by the power of two that puts the largest in [2^14, 2^15) of fp16
        (as shmk_pack_rows' are; normals or 0 only). Requantising the dequantised floats gives
        the same values where a group's largest |q| is 127, as ggml's quantiser makes it. Two
        passes over chunks (the largest scale first), as ``from_row_chunks``."""
        n, k = int(n), int(k)
        if n < 1 or k < 1 or k % 32:
            raise ValueError(f"n must be >= 1 and k a positive multiple of 32, got {n}, {k}")
        groups = k // 32
        spans = _row_spans(n, chunk_rows)

        def chunk(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
            blocks = rows(a, b)
            _check(blocks, "blocks", torch.uint8, 2)
            _shape(blocks, "blocks", (b - a, groups * 34))
            blk = blocks.view(b - a, groups, 34)
            q = blk[:, :, 2:].reshape(b - a, k).view(torch.int8)
            d = blk[:, :, :2].contiguous().view(torch.float16).view(b - a, groups).float()
            return q, d

        dmax = 0.0
        for a, b in spans:
            q, d = chunk(a, b)
            if int(q.min()) == -128 or bool((d < 0).any()):
                return None
            if not bool(torch.isfinite(d).all()):
                raise ValueError("Q8_0 scales must be finite")
            dmax = max(dmax, float(d.abs().max()))
        e = math.frexp(dmax)[1] if dmax > 0 else 0  # dmax in [2^(e-1), 2^e)
        mult = 2.0 ** (e - 15)
        packed, scales, _ = cls._buffers(n, k, arena)
        for a, b in spans:
            q, d = chunk(a, b)
            b0, b1 = a // 16, -(-b // 16)  # the chunk's blocks (a starts one)
            packed[b0 * 16 * k : b1 * 16 * k].view(torch.int32).copy_(_packed_words(q, 32))
            # exact: fp16 values times a power of two
            scales[b0 * 16 * groups : b1 * 16 * groups].copy_(_packed_fp16(d, mult))
        return cls(n, k, packed, scales, mult)

    @staticmethod
    def _buffers(
        n: int, k: int, arena: HugeArena | None, w4: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Uninitialised packed bytes, fp16 scales and (W4) fp16 minimums for an [n, k] weight
        (arena or heap)."""
        take = (
            arena.take
            if arena is not None
            else lambda numel, dtype: torch.empty(numel, dtype=dtype)
        )
        groups = int(lib.shmk_packed_scales(n, k))
        return (
            take(PackedLinear.packed_bytes(n, k, w4), torch.int8),
            take(groups, torch.int16),
            take(groups, torch.int16) if w4 else None,
        )

    @classmethod
    def from_row_chunks(
        cls,
        n: int,
        k: int,
        rows: Callable[[int, int], torch.Tensor],
        chunk_rows: int = 4096,
        arena: HugeArena | None = None,
    ) -> PackedLinear:
        """``from_float`` of an [n, k] weight read in chunks, ``rows(start, end)`` giving rows
        start .. end - 1 (any float dtype): bit-identical to packing it whole.

        NOTE: two passes (the matrix-wide max |w| sets ``scale_mult``, then each chunk packs),
        so a vocabulary-sized matrix never exists in fp32: SmolLM2's tied embedding is 113 MB
        of fp32 and set the peak RSS of loading."""
        n, k = int(n), int(k)
        if n < 1 or k < 1:
            raise ValueError(f"n and k must be >= 1, got n={n}, k={k}")
        spans = _row_spans(n, chunk_rows)

        def chunk(a: int, b: int) -> torch.Tensor:
            w = rows(a, b)
            if not isinstance(w, torch.Tensor) or not w.is_floating_point():
                raise TypeError("rows() must give a floating point torch.Tensor")
            w = _cpu_f32(w)
            _shape(w, "rows", (b - a, k))
            return w

        amax = 0.0
        for a, b in spans:
            w = chunk(a, b)
            amax = max(amax, float(lib.shmk_weights_amax(_f32(w), w.numel())))
        packed, scales, _ = cls._buffers(n, k, arena)
        block_bytes, block_scales = padded_k(k) * 16, padded_k(k) // 32 * 16
        mult = 1.0
        for a, b in spans:
            w = chunk(a, b)
            blk = a // 16
            mult = float(
                lib.shmk_pack_rows(
                    _f32(w), b - a, k, amax,
                    _i8(packed[blk * block_bytes :]), _u16(scales[blk * block_scales :]),
                )
            )  # fmt: skip
        return cls(n, k, packed, scales, mult)

    @property
    def nbytes(self) -> int:
        extra = self.bias.numel() * 4 if self.bias is not None else 0
        extra += self.mins.numel() * 2 if self.mins is not None else 0
        return self.packed.numel() + self.scales.numel() * 2 + extra

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [len(ids), k]: the output channels ``ids`` dequantised (an embedding lookup;
        ``model_forward`` does the same in C)."""
        _not_act8(self)
        if self.w4:
            raise ValueError("lookup reads W8 weights only (vocabulary matrices stay W8)")
        ids = _as_i64(ids, "ids")
        if ids.dim() != 1:
            raise ValueError("ids must be 1-D")
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < self.n):
            raise ValueError(f"ids must lie in [0, {self.n})")
        out = torch.empty(ids.numel(), self.k)
        lib.shmk_dequant_channels(self._c, _i64(ids), ids.numel(), _f32(out))
        return out

    def unpack(self, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [n, k], group scales fp32 [n, groups]) back out of the packed layout;
        ``padded``: q's kp columns (an ``act8`` weight's padding is rotated into, not zero).
        For W4, q holds u (0 .. 15): see ``unpack_w4``."""
        if self.w4:
            return self.unpack_w4(padded)[:2]
        k = self.kp if padded else self.k
        q = torch.empty(self.n, k, dtype=torch.int8)
        s = torch.empty(self.n, self.groups, dtype=torch.float32)
        lib.shmk_unpack_weights(
            _i8(self.packed), _u16(self.scales), self.scale_mult, self.n, k, _i8(q), _f32(s)
        )
        if self.act8 and not self.w4:
            q.bitwise_xor_(-128)  # stored + 128
        return q, s

    def unpack_w4(self, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A W4 weight's (u uint8 [n, k], group scales, group minimums fp32 [n, groups])."""
        if not self.w4:
            raise ValueError("not a W4 weight")
        k = self.kp if padded else self.k
        u = torch.empty(self.n, k, dtype=torch.uint8)
        s = torch.empty(self.n, self.groups, dtype=torch.float32)
        m = torch.empty_like(s)
        lib.shmk_unpack_w4(
            _u8(self.packed), _u16(self.scales), _u16(self.mins), self.scale_mult,
            self.n, k, _u8(u), _f32(s), _f32(m),
        )  # fmt: skip
        return u, s, m

    def dequantized(self) -> torch.Tensor:
        """fp32 [n, k] = q * group scale (+ group minimum for W4): what the GEMM effectively
        multiplies by (for a W8 ``act8`` weight, by the rotated activations: W H / 32)."""
        grow = lambda t: t.repeat_interleave(32, dim=1)[:, : self.k]  # noqa: E731
        if self.w4:
            u, s, m = self.unpack_w4()
            return (u.float() * grow(s) + grow(m)).contiguous()
        q, s = self.unpack()
        return (q.float() * grow(s)).contiguous()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self, out)

    def __repr__(self) -> str:
        bias = ", bias" if self.bias is not None else ""
        w4 = ", w4" if self.w4 else ""
        act8 = ", act8" if self.act8 else ""
        return f"PackedLinear(n={self.n}, k={self.k}{bias}{w4}{act8})"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int16: (xq int16 [m, padded_k(k)] zero-padded, scales fp32 [m])."""
    _check(x, "x", torch.float32, 2)
    m, k = x.shape
    xq = torch.empty(m, padded_k(k), dtype=torch.int16)
    scales = torch.empty(m, dtype=torch.float32)
    lib.shmk_quantize_rows(_f32(x), m, k, _i16(xq), _f32(scales))
    return xq, scales


def quantize_rows_w4a8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a W4 ``act8`` weight's GEMM makes of x fp32 [m, k] (gemm_w4a8.c): (xq int8
    [m, padded_k(k)] zero-padded, a scale per 16 k fp32 [m, padded_k(k) / 16], each 32 k's
    sum as quantised fp32 [m, padded_k(k) / 32])."""
    _check(x, "x", torch.float32, 2)
    m, k = x.shape
    kp = padded_k(k)
    xq = torch.empty(m, kp, dtype=torch.int8)
    scales = torch.empty(m, kp // 16, dtype=torch.float32)
    sums = torch.empty(m, kp // 32, dtype=torch.float32)
    lib.shmk_quantize_rows_w4a8(_f32(x), m, k, _i8(xq), _f32(scales), _f32(sums))
    return xq, scales, sums


def _not_act8(w: PackedLinear) -> None:
    if w.act8 and not w.w4:
        raise ValueError("an act8 weight is stored rotated and + 128: only linear() reads it")


def group_dots(xq: torch.Tensor, w: PackedLinear) -> torch.Tensor:
    """Exact int32 group dot products dots[m, n, g] = xq[:, 32g:32g+32] @ q[:, 32g:32g+32]^T
    (for a W4 weight, q is u: its scales and minimums are not applied)."""
    _check(xq, "xq", torch.int16, 2)
    _not_act8(w)
    if xq.shape[1] != w.kp:
        raise ValueError(f"xq must have {w.kp} columns (padded k of {w.k}), got {xq.shape[1]}")
    m = xq.shape[0]
    dots = torch.empty(m, w.n, w.groups, dtype=torch.int32)
    if m:
        lib.shmk_gemm_group_dots(_i16(xq), m, w._c, _i32(dots))
    return dots


def hadamard(n: int = 32) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard matrix of order n (a power of two): symmetric, entries
    +-1, H H = n I."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def rotate_groups(w: torch.Tensor) -> torch.Tensor:
    """[n, padded_k(k)] fp32: each group of 32 columns of ``w`` (zero padded) times H / 32, the
    weight an ``act8`` PackedLinear packs (H H / 32 = I, so it times H x is W x)."""
    n, k = w.shape
    kp = padded_k(k)
    wp = torch.nn.functional.pad(w.float(), (0, kp - k)).view(n, kp // 32, 32)
    return (wp @ (hadamard(32) / 32)).view(n, kp)


def quantize_rows_a8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit GEMM's activations: each group of 32 k (zero padded) rotated by the
    Walsh-Hadamard matrix, then int8 with a scale per group: (q int8 [m, padded_k(k)],
    scales fp32 [m, padded_k(k) / 32])."""
    _check(x, "x", torch.float32, 2)
    m, k = x.shape
    xq = torch.empty(m, padded_k(k), dtype=torch.int8)
    scales = torch.empty(m, padded_k(k) // 32, dtype=torch.float32)
    lib.shmk_quantize_rows_a8(_f32(x), m, k, _i8(xq), _f32(scales))
    return xq, scales


def linear_a8(x: torch.Tensor, w: PackedLinear) -> torch.Tensor:
    """``linear`` on 8-bit activations whatever ``w.act8`` says (so only right for ``act8``
    weights): the VNNI kernel where the CPU path has it, else the portable one, the same bits."""
    _check(x, "x", torch.float32, 2)
    if w.w4:
        # NOTE: gemm_a8.c reads W8 bytes: a W4 buffer is half as long
        raise ValueError("linear_a8 reads W8 weights only (a W4 weight runs in linear)")
    if x.shape[1] != w.k:
        raise ValueError(f"x has {x.shape[1]} features, weight expects k={w.k}")
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    if x.shape[0]:
        lib.shmk_linear_a8(_f32(x), x.shape[0], w._c, _f32(out))
    return out


def linear(x: torch.Tensor, w: PackedLinear, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., n] = x[..., k] @ W^T (+ bias) via dynamic int16 quantisation of x (8-bit for
    ``act8`` weights); fp32 in and out."""
    if not isinstance(w, PackedLinear):
        raise TypeError(f"w must be a PackedLinear, got {type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a torch.Tensor with at least one dimension")
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects k={w.k}")
    _check(x, "x", torch.float32, x.dim())
    lead = tuple(x.shape[:-1])
    m = math.prod(lead)
    if out is None:
        out = torch.empty(*lead, w.n, dtype=torch.float32)
    else:
        _check(out, "out", torch.float32, x.dim())
        _shape(out, "out", (*lead, w.n))
    if m:
        lib.shmk_linear(_f32(x), m, w._c, _f32(out))
    return out


# --------------------------------------------------------------------------- elementwise
def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = x * rsqrt(mean(x^2, -1) + eps) * weight for x [m, h] fp32.

    With ``residual``: first ``x += residual`` in place (x is the residual stream), then normalise.
    ``out`` may be omitted (allocated) but must not alias x.
    """
    _check(x, "x", torch.float32, 2)
    m, h = x.shape
    _check(weight, "weight", torch.float32, 1)
    _shape(weight, "weight", (h,))
    if out is None:
        out = torch.empty_like(x)
    else:
        _check(out, "out", torch.float32, 2)
        _shape(out, "out", (m, h))
    res = ffi.NULL
    if residual is not None:
        _check(residual, "residual", torch.float32, 2)
        _shape(residual, "residual", (m, h))
        res = _f32(residual)
    lib.shmk_rmsnorm(_f32(x), res, _f32(weight), m, h, float(eps), _f32(out))
    return out


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Default Llama inverse frequencies, computed like HF: 1 / theta^(arange(0, d, 2) / d)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exps)


def rope_cos_sin(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """Table [max_pos, d] fp32: [:, :d/2] = cos(p * inv_freq), [:, d/2:] = sin(p * inv_freq).

    Pass a scaled ``inv_freq`` (llama3 / linear / NTK) to get scaled RoPE; ``freqs`` is formed in
    fp32 exactly like HF (outer(positions, inv_freq)).

    NOTE: cos / sin run in float64 and are rounded once to fp32. torch's fp32 cos was seen to be
    off by up to 1.5e-4 (relative) on the half of a 512 x 32 table that a second intra-op thread
    computed, in about one run in ten; float64 gives the same correctly rounded table every time.
    numpy computes it (one thread): torch's float64 cos / sin kernels are ~8 MB of code pages
    that the engine process would otherwise keep resident for this one table.
    """
    _check(inv_freq, "inv_freq", torch.float32, 1)
    t = np.arange(max_pos, dtype=np.float32)
    freqs = np.outer(t, inv_freq.numpy()).astype(np.float64)  # the product in fp32, as HF
    table = np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)
    return torch.from_numpy(table)


def rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> None:
    """In-place NeoX / HF rotate_half RoPE: pairs (i, i + d/2) of q [t, hq, d] and k [t, hk, d].

    positions: int64 or int32 [t] (clamped to the table); cos_sin from ``rope_cos_sin``.
    """
    _check(q, "q", torch.float32, 3)
    t, hq, d = q.shape
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    hk = 0
    if k is not None:
        _check(k, "k", torch.float32, 3)
        if k.shape[0] != t or k.shape[2] != d:
            raise ValueError(f"k must be [{t}, hk, {d}], got {tuple(k.shape)}")
        hk = k.shape[1]
    pos = _as_i64(positions, "positions")
    _shape(pos, "positions", (t,))
    _check(cos_sin, "cos_sin", torch.float32, 2)
    if cos_sin.shape[1] != d or cos_sin.shape[0] < 1:
        raise ValueError(f"cos_sin must be [max_pos >= 1, {d}], got {tuple(cos_sin.shape)}")
    kp = _f32(k) if k is not None else ffi.NULL
    lib.shmk_rope(_f32(q), kp, _i64(pos), t, hq, hk, d, _f32(cos_sin), cos_sin.shape[0])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [m]: the first index of each row's largest value of x [m, n] fp32 (n >= 1); NaN
    counts as -inf, so a row with nothing above -inf gives 0. Rows run in parallel on the pool."""
    _check(x, "x", torch.float32, 2)
    m, n = x.shape
    if n < 1 or n >= 2**31:
        raise ValueError(f"x must have 1 to 2**31 - 1 columns, got {n}")
    out = torch.empty(m, dtype=torch.int64)
    if m:
        lib.shmk_argmax_rows(_f32(x), m, n, _i64(out))
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[m, f] = silu(gate_up[:, :f]) * gate_up[:, f:] for gate_up [m, 2f] fp32."""
    _check(gate_up, "gate_up", torch.float32, 2)
    m, f2 = gate_up.shape
    if f2 % 2:
        raise ValueError(f"gate_up must have an even number of columns, got {f2}")
    f = f2 // 2
    if out is None:
        out = torch.empty(m, f, dtype=torch.float32)
    else:
        _check(out, "out", torch.float32, 2)
        _shape(out, "out", (m, f))
    if m:
        lib.shmk_silu_mul(_f32(gate_up), m, f, _f32(out))
    return out


# --------------------------------------------------------------------------- paged KV / attention
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.int8: 2}


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, Hkv, block_size, D) of a k/v cache pair, after checking both."""
    _check(k_cache, "k_cache", tuple(KV_DTYPES), 4)
    _check(v_cache, "v_cache", tuple(KV_DTYPES), 4)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache differ: {tuple(k_cache.shape)} {k_cache.dtype} vs "
            f"{tuple(v_cache.shape)} {v_cache.dtype}"
        )
    nb, hk, rows, d = k_cache.shape
    check_kv_dtype(k_cache.dtype, d)
    bs = kv_block_size(rows, d, k_cache.dtype)
    if min(nb, hk, bs, d) < 1:
        raise ValueError(f"the cache must have no empty dimension, got {tuple(k_cache.shape)}")
    return nb, hk, bs, d


def _kv_struct(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The C view (shmk_kv_t) of a checked cache pair; keep the tensors alive while it is used."""
    nb, hk, rows, d = k_cache.shape
    bs = kv_block_size(rows, d, k_cache.dtype)
    kv = ffi.new("shmk_kv_t *")
    kv.k, kv.v = ffi.cast("void *", k_cache.data_ptr()), ffi.cast("void *", v_cache.data_ptr())
    kv.num_blocks, kv.block_size, kv.hk, kv.d = nb, bs, hk, d
    kv.dtype = KV_DTYPES[k_cache.dtype]
    return kv


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Token i's k[i] [Hkv, D] goes to slot slot_mapping[i] (same for v); negative slots skipped."""
    nb, hk, bs, d = _check_cache(k_cache, v_cache)
    _check(k, "k", torch.float32, 3)
    _check(v, "v", torch.float32, 3)
    t = k.shape[0]
    _shape(k, "k", (t, hk, d))
    _shape(v, "v", (t, hk, d))
    slots = _as_i64(slot_mapping, "slot_mapping")
    _shape(slots, "slot_mapping", (t,))
    if t and int(slots.max()) >= nb * bs:
        raise ValueError(f"slot_mapping has a slot >= num_blocks * block_size = {nb * bs}")
    lib.shmk_write_kv(_f32(k), _f32(v), _i64(slots), t, _kv_struct(k_cache, v_cache))


def _batch_tensors(block_table, seq_lens, query_start_loc):
    """(block_table, seq_lens, query_start_loc) as int32 after checking their shapes."""
    bt = _as_i32(block_table, "block_table", 2)
    sl = _as_i32(seq_lens, "seq_lens", 1)
    qsl = _as_i32(query_start_loc, "query_start_loc", 1)
    b = sl.shape[0]
    _shape(qsl, "query_start_loc", (b + 1,))
    if bt.shape[0] != b:
        raise ValueError(f"block_table must have {b} rows (one per sequence), got {bt.shape[0]}")
    return bt, sl, qsl


def _check_step(c, num_blocks: int, bs: int) -> None:
    """The batch metadata in a shmk_step_t against the cache geometry, checked in C.

    NOTE: not in torch: between two model steps the interpreter runs with cold caches (a step
    streams ~180 MB), where each of the ~10 small torch ops this took cost 30-60 us."""
    err = lib.shmk_check_step(c, num_blocks, bs)
    if err == lib.SHMK_STEP_QSL:
        raise ValueError(f"query_start_loc must run from 0 to the token count {c.t}")
    if err == lib.SHMK_STEP_QLEN:
        raise ValueError("need 0 <= q_len <= seq_len for every sequence")
    if err == lib.SHMK_STEP_CAPACITY:
        raise ValueError(f"seq_len exceeds block_table capacity {c.max_blocks} x {bs}")
    if err == lib.SHMK_STEP_BLOCK:
        raise ValueError(f"block_table references a block outside [0, {num_blocks})")
    if err == lib.SHMK_STEP_SLOT:
        raise ValueError(f"slot_mapping has a slot >= num_blocks * block_size = {num_blocks * bs}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [t, hq, d] over a paged cache, for mixed prefill/decode batches.

    Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1] (q_len of them); they are
    the LAST q_len tokens of its seq_lens[b] kv positions (which must already be in the cache), so
    query token i attends to kv positions 0 .. seq_len - q_len + i.  block_table [b, max_blocks]
    int32 maps position p to cache block block_table[b, p // block_size].  GQA: hq % hk == 0,
    q head h reads kv head h // (hq // hk).  Returns out [t, hq, d] fp32.
    """
    nb, hk, bs, d = _check_cache(k_cache, v_cache)
    _check(q, "q", torch.float32, 3)
    t, hq, dq = q.shape
    if dq != d:
        raise ValueError(f"q head_dim {dq} != cache head_dim {d}")
    if hq % hk:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hk})")
    if d > 1024:
        raise ValueError(f"head_dim must be <= 1024, got {d}")
    bt, sl, qsl = _batch_tensors(block_table, seq_lens, query_start_loc)
    c = ffi.new("shmk_step_t *")  # the metadata only, for the check (no slots)
    c.t, c.b, c.block_table, c.max_blocks = t, sl.shape[0], _i32(bt), bt.shape[1]
    c.seq_lens, c.query_start_loc = _i32(sl), _i32(qsl)
    _check_step(c, nb, bs)
    if out is None:
        out = torch.empty_like(q)
    else:
        _check(out, "out", torch.float32, 3)
        _shape(out, "out", (t, hq, d))
    b = sl.shape[0]
    if t and b:
        lib.shmk_paged_attention(
            _f32(q), _kv_struct(k_cache, v_cache), _i32(bt), bt.shape[1], _i32(sl), _i32(qsl),
            b, hq, float(scale), _f32(out),
        )  # fmt: skip
    return out


# --------------------------------------------------------------------------- fused decoder layer
class LlamaLayer:
    """Packed weights of one Llama-family decoder layer for ``llama_layer_forward``.

    qkv rows are [q (hq*d) | k (hk*d) | v (hk*d)], gate_up rows are [gate (ffn) | up (ffn)].
    ``q_norm``, ``k_norm`` [d]: Qwen3's RMSNorm of each query and key head before RoPE;
    ``rope`` false: none (SmolLM3's NoPE layers).
    """

    def __init__(
        self,
        *,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ffn: int,
        eps: float,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        qkv: PackedLinear,
        o: PackedLinear,
        gate_up: PackedLinear,
        down: PackedLinear,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        rope: bool = True,
    ):
        hq, hk, d = num_heads, num_kv_heads, head_dim
        if hq % hk:
            raise ValueError(f"num_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
        expect = {
            "qkv": (qkv, (hq + 2 * hk) * d, hidden),
            "o": (o, hidden, hq * d),
            "gate_up": (gate_up, 2 * ffn, hidden),
            "down": (down, hidden, ffn),
        }
        for name, (lin, n, k) in expect.items():
            if not isinstance(lin, PackedLinear):
                raise TypeError(f"{name} must be a PackedLinear")
            if (lin.n, lin.k) != (n, k):
                raise ValueError(f"{name} must be [{n}, {k}], got [{lin.n}, {lin.k}]")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        norms = []
        named = [("input_norm", input_norm, hidden), ("post_norm", post_norm, hidden)]
        if q_norm is not None:
            named += [("q_norm", q_norm, d), ("k_norm", k_norm, d)]
        for name, t, size in named:
            t = t.detach().to(torch.float32).contiguous()
            _check(t, name, torch.float32, 1)
            _shape(t, name, (size,))
            norms.append(t)
        self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.ffn = (
            hidden,
            hq,
            hk,
            d,
            ffn,
        )
        self.eps = float(eps)
        self.input_norm, self.post_norm = norms[:2]
        self.qk_norms = norms[2:]  # kept alive: the struct points into them
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        c = ffi.new("shmk_layer_t *")
        c.hidden, c.hq, c.hk, c.d, c.ffn, c.eps = hidden, hq, hk, d, ffn, self.eps
        c.input_norm, c.post_norm = _f32(norms[0]), _f32(norms[1])
        if self.qk_norms:
            c.q_norm, c.k_norm = _f32(norms[2]), _f32(norms[3])
        else:
            c.q_norm = c.k_norm = ffi.NULL
        self.rope = bool(rope)
        c.rope = int(self.rope)
        c.qkv, c.o, c.gate_up, c.down = qkv._c[0], o._c[0], gate_up._c[0], down._c[0]
        self._c = c


class LayerScratch:
    """Reusable fp32 work buffers for up to ``max_tokens`` tokens of one layer shape."""

    def __init__(self, layer: LlamaLayer, max_tokens: int):
        t, h, d = int(max_tokens), layer.hidden, layer.head_dim
        hq, hk, f = layer.num_heads, layer.num_kv_heads, layer.ffn
        self.max_tokens = t
        self.normed = torch.empty(t, h)
        self.qkv = torch.empty(t, (hq + 2 * hk) * d)
        self.attn = torch.empty(t, hq * d)
        self.gate_up = torch.empty(t, 2 * f)
        self.act = torch.empty(t, f)
        self.hidden = torch.empty(t, h)  # the residual stream of model_forward
        self.final = torch.empty(t, h)  # its normed rows that get logits
        self.dims = (h, hq, hk, d, f)


class LayerStep:
    """Per-step batch metadata (validated once) shared by every layer of one forward pass.

    positions [t] and slot_mapping [t] (int64 or int32), block_table [b, max_blocks],
    seq_lens [b] and query_start_loc [b+1] (int32 or int64), cos_sin from ``rope_cos_sin``.
    The cache geometry (num_blocks, block_size) must match the caches given to the forward.
    """

    def __init__(
        self,
        *,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        cos_sin: torch.Tensor,
        num_blocks: int,
        block_size: int,
        scale: float,
        scratch: LayerScratch,
        act_max: torch.Tensor | None = None,
    ):
        """``act_max``: fp32 [2 hidden + heads x head_dim + ffn], raised by each layer run to
        the max |x| per input channel of its qkv, o, gate_up and down (calibration)."""
        pos = _as_i64(positions, "positions")
        t = pos.shape[0]
        if t > scratch.max_tokens:
            raise ValueError(f"{t} tokens exceed the scratch capacity {scratch.max_tokens}")
        slots = _as_i64(slot_mapping, "slot_mapping")
        _shape(slots, "slot_mapping", (t,))
        bt, sl, qsl = _batch_tensors(block_table, seq_lens, query_start_loc)
        _check(cos_sin, "cos_sin", torch.float32, 2)
        d = scratch.dims[3]
        if cos_sin.shape[1] != d or cos_sin.shape[0] < 1:
            raise ValueError(f"cos_sin must be [max_pos >= 1, {d}], got {tuple(cos_sin.shape)}")
        self.t, self.num_blocks, self.block_size = t, int(num_blocks), int(block_size)
        self.scratch = scratch
        self._keep = (pos, slots, bt, sl, qsl, cos_sin)
        c = ffi.new("shmk_step_t *")
        c.t, c.b = t, sl.shape[0]
        c.positions, c.slots = _i64(pos), _i64(slots)
        c.block_table, c.max_blocks = _i32(bt), bt.shape[1]
        c.seq_lens, c.query_start_loc = _i32(sl), _i32(qsl)
        c.cos_sin, c.max_pos = _f32(cos_sin), cos_sin.shape[0]
        c.scale = float(scale)
        c.normed, c.qkv, c.attn = _f32(scratch.normed), _f32(scratch.qkv), _f32(scratch.attn)
        c.gate_up, c.act = _f32(scratch.gate_up), _f32(scratch.act)
        if act_max is not None:
            h, hq, _, d, f = scratch.dims
            _check(act_max, "act_max", torch.float32, 1)
            _shape(act_max, "act_max", (2 * h + hq * d + f,))
            c.act_max = _f32(act_max)
            self._keep += (act_max,)
        _check_step(c, self.num_blocks, self.block_size)
        self._c = c


def llama_layer_forward(
    layer: LlamaLayer,
    step: LayerStep,
    hidden: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """One decoder layer in a single native call; ``hidden`` [t, hidden] fp32 is updated in place.

    hidden += o_proj(attn(rope(qkv(rmsnorm(hidden)))));  hidden += down(silu*up(rmsnorm(hidden))).
    The new k/v of the step's tokens are written to the caches at ``slot_mapping`` first.
    """
    llama_forward(LlamaStack([layer], [(k_cache, v_cache)]), step, hidden)


class LlamaStack:
    """A model's layers with their KV caches as C arrays, checked once, for ``llama_forward``.

    Build it when the caches are allocated and reuse it every step: a step then crosses into C
    once instead of once per layer, without re-checking 2 x num_layers cache tensors (~10 us a
    layer of Python)."""

    def __init__(
        self, layers: Sequence[LlamaLayer], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ):
        if len(layers) != len(kv_caches) or not layers:
            raise ValueError(f"{len(layers)} layers but {len(kv_caches)} k/v cache pairs")
        n = len(layers)
        self.layers, self.kv_caches = list(layers), list(kv_caches)
        self._layers = ffi.new("shmk_layer_t[]", n)
        self._kv = ffi.new("shmk_kv_t[]", n)
        shapes = set()
        for i, (layer, (k_cache, v_cache)) in enumerate(
            zip(self.layers, self.kv_caches, strict=True)
        ):
            nb, hk, bs, d = _check_cache(k_cache, v_cache)
            if (hk, d) != (layer.num_kv_heads, layer.head_dim):
                raise ValueError(f"layer {i}: cache heads/dim {(hk, d)} do not fit the layer")
            dims = (layer.hidden, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.ffn)
            shapes.add((nb, bs, dims))
            self._layers[i] = layer._c[0]
            self._kv[i] = _kv_struct(k_cache, v_cache)[0]
        if len(shapes) != 1:
            raise ValueError("all layers must share one shape and one cache geometry")
        ((self.num_blocks, self.block_size, self.dims),) = shapes
        self.hidden = self.layers[0].hidden


def llama_forward(stack: LlamaStack, step: LayerStep, hidden: torch.Tensor) -> None:
    """Every layer of ``stack`` in order, in one native call; ``hidden`` [t, hidden] in place."""
    _check(hidden, "hidden", torch.float32, 2)
    if tuple(hidden.shape) != (step.t, stack.hidden):
        raise ValueError(f"hidden must be [{step.t}, {stack.hidden}], got {tuple(hidden.shape)}")
    if (step.num_blocks, step.block_size) != (stack.num_blocks, stack.block_size):
        raise ValueError("the step was built for another cache geometry")
    if step.scratch.dims != stack.dims:
        raise ValueError("step scratch was sized for a different layer shape")
    lib.shmk_llama_forward(stack._layers, stack._kv, len(stack.layers), step._c, _f32(hidden))


class ModelEnds:
    """What ``model_forward`` runs around a ``LlamaStack``: the embedding (rows of a packed
    [vocab, hidden] weight, dequantised as they are looked up: with tied weights the LM head
    itself, so the 31 MB of an unpacked copy never exist), the final RMSNorm and the LM head."""

    def __init__(
        self,
        embedding: PackedLinear,
        final_norm: torch.Tensor,
        eps: float,
        lm_head: PackedLinear,
    ):
        _check(final_norm, "final_norm", torch.float32, 1)
        if embedding.w4 or embedding.act8:
            # NOTE: the C lookup (shmk_dequant_channels) reads plain W8 bytes: a W4 buffer is
            # half as long, an act8 one rotated
            raise ValueError("the embedding must be a plain W8 weight (not W4, not act8)")
        vocab, h = embedding.n, embedding.k
        _shape(final_norm, "final_norm", (h,))
        if lm_head.k != h:
            raise ValueError(f"lm_head takes {lm_head.k} inputs, the hidden size is {h}")
        self.hidden, self.vocab, self.embedding, self.lm_head = h, vocab, embedding, lm_head
        self._keep = final_norm
        c = ffi.new("shmk_model_t *")
        c.embedding = embedding._c
        c.vocab, c.hidden, c.final_norm, c.eps = vocab, h, _f32(final_norm), float(eps)
        c.lm_head = lm_head._c
        self._c = c


def model_forward(
    ends: ModelEnds,
    stack: LlamaStack,
    step: LayerStep,
    input_ids: torch.Tensor,
    logits_rows: torch.Tensor,
    argmax_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 logits [len(logits_rows), lm_head.n] of one step, in one native call: the embedding
    of ``input_ids`` [t], every layer, the final norm of the rows ``logits_rows`` and the LM head;
    with ``argmax_out`` (int64 [len(logits_rows)]) also each row's ``argmax_rows``.

    NOTE: one call, not a torch op per piece: between steps the interpreter runs on cold caches
    and the ~15 small ops around the layers cost ~0.6 ms a step at batch 16 (~0.1 ms warm)."""
    ids = _as_i64(input_ids, "input_ids")
    rows = _as_i64(logits_rows, "logits_rows")
    _shape(ids, "input_ids", (step.t,))
    if (step.num_blocks, step.block_size) != (stack.num_blocks, stack.block_size):
        raise ValueError("the step was built for another cache geometry")
    if step.scratch.dims != stack.dims or stack.hidden != ends.hidden:
        raise ValueError("step scratch was sized for a different layer shape")
    s = step.scratch
    if rows.shape[0] > s.max_tokens:  # the normed rows go to a scratch of max_tokens rows
        raise ValueError(f"{rows.shape[0]} logits rows exceed the scratch capacity {s.max_tokens}")
    logits = torch.empty(rows.shape[0], ends.lm_head.n)
    argmax = ffi.NULL
    if argmax_out is not None:
        _check(argmax_out, "argmax_out", torch.int64, 1)
        _shape(argmax_out, "argmax_out", (rows.shape[0],))
        argmax = _i64(argmax_out)
    err = lib.shmk_model_forward(
        ends._c, stack._layers, stack._kv, len(stack.layers), step._c, _i64(ids), _i64(rows),
        rows.shape[0], _f32(s.hidden), _f32(s.final), _f32(logits), argmax,
    )  # fmt: skip
    if err == -1:
        raise ValueError(f"input_ids must lie in [0, {ends.vocab})")
    if err == -2:
        raise ValueError(f"logits_rows must lie in [0, {step.t})")
    return logits
