"""The int8 Llama model on the native kernels: one native call per step.

The call covers the embedding, every layer, the final norm and the LM head.

Weights are quantized to int8 with a scale per (output channel, 32 consecutive k) for the
W8 x A16 GEMM (int16 activations per token) and packed once, at load, one tensor at a time from
the lazy loader, so peak memory stays near the packed size. q/k/v are packed as one [q|k|v] matrix
and gate/up as one [gate|up] matrix, so each projection group is a single GEMM. The input
embedding is looked up, never multiplied: its rows are dequantised from a packed weight, the LM
head's own when the embeddings are tied, so the vocabulary-sized matrix is resident once.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping, Sequence

import torch

from shm_engine.model import kernels
from shm_engine.model.batch import BatchInputs
from shm_engine.model.config import ModelConfig
from shm_engine.model.eval_texts import CALIBRATION_TEXT
from shm_engine.model.hugepages import HugeArena
from shm_engine.model.kv_cache import KV_CACHE_DTYPES, check_kv_dtype
from shm_engine.model.loader import W4Grid, WeightSource
from shm_engine.model.smoothing import LayerCalibrator, LayerWeights, smooth_layer

logger = logging.getLogger(__name__)


def _trim_heap() -> None:
    """Give the fp32 weights freed while packing back to the OS.

    NOTE: glibc raises its mmap threshold after large frees, so later multi-MB temporaries come
    from the heap and stay there once freed; without trimming, loading SmolLM2 leaves ~130 MB of
    free heap resident (peak RSS 561 MB instead of ~420 MB).
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 (probe: glibc only)
except (OSError, AttributeError):
    _LIBC = None


def calibration_ids(tokenizer) -> list[int] | None:  # noqa: ANN001 - a model Tokenizer
    """The tokens Int8Llama calibrates its weight smoothing on (a fixed text, not one the model
    tests evaluate); None without a tokenizer."""
    return None if tokenizer is None else list(tokenizer.encode(CALIBRATION_TEXT))


# The activation formats of the layers' linear calls (Int8Llama's activation_dtype)
ACTIVATION_DTYPES = ("auto", "int16", "int8")
# The layers' weight formats (Int8Llama's weight_dtype); the vocabulary matrices stay int8
WEIGHT_DTYPES = ("int8", "int4", "auto")
# NOTE: the W4 linears that activation_dtype "int8" or "auto" runs on 8-bit activations
# (gemm_w4a8.c).
# qkv keeps int16: on SmolLM2 (simulated over four texts) 8 bits per 16 k on o, gate_up and down
# cost KL 0.00076 to fp32 and top-1 98.9 %, on all four 0.00126 and 97.3 %.
W4_ACT8_LINEARS = frozenset({"o", "gate_up", "down"})
# Each packed linear of a layer and the HF tensors it is packed from (rows concatenated)
LINEAR_SOURCES = {
    "qkv": [f"self_attn.{n}_proj.weight" for n in "qkv"],
    "o": ["self_attn.o_proj.weight"],
    "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "down": ["mlp.down_proj.weight"],
}


def smooths(activation_dtype: str, weight_dtype: str) -> bool:
    """Whether the engine smooths the layers' weights at load (``calibration_ids``): for 8-bit
    activations on the W8 kernel that has them (gemm_a8.c, path vnni). Elsewhere they run on
    W4 weights, which smoothing would move off their grids."""
    return activation_dtype == "int8" and weight_dtype != "int4" and kernels.get_path() == "vnni"


class Int8Llama:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        num_threads: int = 0,
        kv_cache_dtype: str = "fp16",
        activation_dtype: str = "auto",
        calibration_ids: Sequence[int] | None = None,
        weight_dtype: str = "int8",
    ) -> None:
        """``calibration_ids``: tokens of a text (``calibration_ids(tokenizer)``) whose
        activations calibrate SmoothQuant factors folded into each layer's weights at load
        (model/smoothing.py; ~2x the layers' packing time); None packs the weights as they
        are. ``activation_dtype``: "int8" runs the layers on 8-bit activations where a kernel
        has them: the o, gate_up and down matrices packed in 4 bits, on every path
        (gemm_w4a8.c; W4_ACT8_LINEARS), and on kernel path "vnni" every int8 layer weight
        (rotated, gemm_a8.c); the others keep int16. "auto" (the default) takes 8 bits on
        those 4-bit matrices only, as llama.cpp quantises activations for its 4-bit weights
        (a scale per 16 k here, per 32 in its Q8 blocks); "int16" everywhere is exact on
        4-bit layers. ``weight_dtype``: the
        layers' weights in "int8" or "int4" (matrices a GGUF file holds as Q4_0 / Q4_1 / Q4_K
        packed from their grids, exact but for Q4_K's scales rounded to fp16; others fitted
        by ``PackedLinear.from_float(w4=True)``), or "auto": int4 for the matrices the file
        holds that way, on every kernel path but "amx" (whose tiles run W8 only; W4 there is
        not timed); the embedding and LM head stay int8."""
        # NOTE: the native attention has no window. Within the window a sliding-window model
        # attends to everything anyway, so it runs exactly up to that length (the runner caps
        # max_model_len there; forward() refuses longer sequences).
        self.full_attention_limit: int | None = config.sliding_window
        # NOTE: fp16 K/V (fp32 math) halves the bytes batched decode reads from the cache against
        # fp32; on SmolLM2 the top-1 agreement with the fp32 model is unchanged against an fp32
        # cache.  int8 rows halve them again, 1.88x the tokens in a budget (test_int8_model bounds
        # what they cost).
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}")
        self.kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
        # NOTE: "int8" activations (each 32 k rotated by the Walsh-Hadamard matrix, a scale
        # per group) run the layers' linear calls on vpdpbusd (a scale per 16 k measured
        # 1.3-1.5x the int16 kernel from ~16 rows, as fast below; docs/kernels.md); every
        # call, so a token's result does not depend on its batch.  Only path "vnni" has that
        # kernel; the others keep int16.
        # Accuracy: docs/kernels.md, "8-bit activations".
        if activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation_dtype must be one of {list(ACTIVATION_DTYPES)}")
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {list(WEIGHT_DTYPES)}")
        if weight_dtype == "int4" and calibration_ids:
            raise ValueError("int4 weights stay on their grids: they cannot be smoothed")
        self.weight_dtype = weight_dtype
        self.smoothed = bool(calibration_ids)
        self.activation_dtype = activation_dtype
        # W8 weights on 8-bit activations (rotated): path vnni; W4 ones: every path
        self._act8 = activation_dtype == "int8" and kernels.get_path() == "vnni"
        self._w4_act8 = activation_dtype != "int16"
        check_kv_dtype(self.kv_dtype, config.head_dim)
        if num_threads:
            kernels.set_num_threads(num_threads)
        self.config = config
        c = config
        # NOTE: every packed weight in one huge-page arena (see HugeArena): batch-1 decode is a
        # stream of all of them each step.
        # the 4-bit linears of each layer, decided before packing (the arena's size)
        self.w4_linears = [self._w4_linears(weights, i) for i in range(c.num_layers)]
        if (
            activation_dtype == "int8"
            and not self._act8
            and not any(s & W4_ACT8_LINEARS for s in self.w4_linears)
        ):
            logger.warning(
                "activation_dtype='int8': kernel path %r runs 8-bit activations on AVX512-VNNI "
                "(without AMX) or on 4-bit layer weights, and none are packed so: the layers "
                "keep int16 activations",
                kernels.get_path(),
            )
        self._arena = HugeArena(self._arena_bytes(c, self.w4_linears))
        # NOTE: vocabulary-sized matrices are packed from chunks of rows (a whole one is 113 MB
        # of fp32 for SmolLM2, which set the peak RSS of loading).
        emb_name = "model.embed_tokens.weight"
        self.lm_head = self._pack_vocab(
            weights, emb_name if c.tie_word_embeddings else "lm_head.weight"
        )
        # The embedding is looked up, never multiplied: its rows are dequantised from the packed
        # layout (for tied weights the LM head's own), so no unpacked copy stays resident.
        self.embedding = (
            self.lm_head if c.tie_word_embeddings else self._pack_vocab(weights, emb_name)
        )
        _trim_heap()
        self.final_norm = weights["model.norm.weight"].float().contiguous()
        self._ends = kernels.ModelEnds(
            self.embedding, self.final_norm, c.rms_norm_eps, self.lm_head
        )
        self.cos_sin = kernels.rope_cos_sin(c.inv_freq(), c.max_position_embeddings)
        self.scale = c.head_dim**-0.5
        calib: LayerCalibrator | None = None
        self.layers = []
        for i in range(c.num_layers):
            lw = self._layer_weights(weights, i)
            if self.smoothed:
                probe = self._pack_layer(lw, c.rope_in_layer(i), probe=True)
                if calib is None:
                    # positions past the RoPE table (or a sliding window) would not run
                    limit = min(c.max_position_embeddings, c.sliding_window or 1 << 62)
                    ids = torch.tensor(list(calibration_ids)[:limit], dtype=torch.int64)
                    hidden = self.embedding.lookup(ids)
                    calib = LayerCalibrator(hidden, probe, self.cos_sin, self.scale)
                act_max = calib.maxima(probe)
                del probe  # NOTE: before the real packing: the load's peak RSS is a layer's
                smooth_layer(lw, act_max, c.num_heads, c.num_kv_heads, c.head_dim)
            layer = self._pack_layer(lw, c.rope_in_layer(i), w4=self.w4_linears[i])
            if calib is not None:
                calib.advance(layer)
            self.layers.append(layer)
            del lw
            _trim_heap()
        self._scratch: kernels.LayerScratch | None = None
        self._stack: kernels.LlamaStack | None = None

    def _w4_linears(self, w: Mapping[str, torch.Tensor], i: int) -> frozenset[str]:
        """Which of layer i's linears (LINEAR_SOURCES' keys) ``weight_dtype`` packs in 4 bits."""
        if self.weight_dtype == "int4":
            return frozenset(LINEAR_SOURCES)
        # NOTE: smoothing rescales the weights off the file's grids. On path vnni W4 x A8 ran
        # 1.2-1.5x the W8 x A16 model (benchmarks/RESULTS.md, 2026-12-08); on amx the W8
        # layers take the AMX tiles from 9 rows, which W4 never does, and W4 is untimed there.
        if self.weight_dtype == "int8" or self.smoothed or kernels.get_path() == "amx":
            return frozenset()
        if not isinstance(w, WeightSource):
            return frozenset()
        p = f"model.layers.{i}."
        return frozenset(
            name
            for name, sources in LINEAR_SOURCES.items()
            if all(w.stored_in_4bit_groups(p + s) for s in sources)
        )

    @staticmethod
    def _arena_bytes(c: ModelConfig, w4_linears: list[frozenset[str]]) -> int:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {
            "qkv": (q + 2 * kv, c.hidden_size),
            "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size),
        }
        layers = sum(
            kernels.PackedLinear.arena_bytes(n, k, name in w4)
            for w4 in w4_linears
            for name, (n, k) in shapes.items()
        )
        vocab = kernels.PackedLinear.arena_bytes(c.vocab_size, c.hidden_size)
        return layers + vocab * (1 if c.tie_word_embeddings else 2)

    def _pack_vocab(self, w: Mapping[str, torch.Tensor], name: str) -> kernels.PackedLinear:
        """A [vocab, hidden] matrix packed from chunks of rows when the source reads rows."""
        if not isinstance(w, WeightSource):
            return kernels.PackedLinear.from_float(w[name], arena=self._arena)
        n, k = w.shape(name)
        # NOTE: a Q8_0 matrix (SmolLM2's tied embedding) is packed from the file's bytes: its
        # values exactly, without the float passes below (~0.2 s of the load); an empty read
        # asks whether the file holds it so
        if w.q8_0_rows(name, 0, 0) is not None and k % 32 == 0:
            packed = kernels.PackedLinear.from_q8_0(
                n, k, lambda a, b: w.q8_0_rows(name, a, b), arena=self._arena
            )
            if packed is not None:
                return packed
        return kernels.PackedLinear.from_row_chunks(
            n, k, lambda a, b: w.rows(name, a, b), arena=self._arena
        )

    def _layer_weights(self, w: Mapping[str, torch.Tensor], i: int) -> LayerWeights:
        """The layer's fp32 tensors; when smoothing, each its own copy (smooth_layer works in
        place). A 4-bit linear comes as grids (W4Grid) when the source holds any of its parts on
        4-bit grids: those parts as they are (exact but for Q4_K's scales rounded to fp16), the
        others ("int4" on a Q4_K_M file's Q6_K v, say) fitted by ``from_float(w4=True)``."""
        p = f"model.layers.{i}."

        def own(name: str) -> torch.Tensor:
            return w[p + name].to(torch.float32, copy=self.smoothed)

        def cat(name: str) -> torch.Tensor | W4Grid:
            names = [p + n for n in LINEAR_SOURCES[name]]
            on_grids = isinstance(w, WeightSource) and [w.stored_in_4bit_groups(n) for n in names]
            if name in self.w4_linears[i] and on_grids and any(on_grids):

                def grid(n: str, stored: bool) -> W4Grid:
                    if stored:
                        return w.w4_grid(n)
                    fitted = kernels.PackedLinear.from_float(w[n], w4=True)
                    return W4Grid.from_values(*fitted.unpack_w4())

                grids = [grid(n, stored) for n, stored in zip(names, on_grids, strict=True)]
                return W4Grid(*(torch.cat(parts) for parts in zip(*grids, strict=True)))
            return torch.cat([w[n] for n in names]).to(torch.float32)

        bias = None
        if self.config.attention_bias:
            bias = torch.cat([w[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]).float()
        qk_norm = self.config.qk_norm
        return LayerWeights(
            q_norm=own("self_attn.q_norm.weight") if qk_norm else None,
            k_norm=own("self_attn.k_norm.weight") if qk_norm else None,
            input_norm=own("input_layernorm.weight"),
            post_norm=own("post_attention_layernorm.weight"),
            qkv=cat("qkv"),
            qkv_bias=bias,
            o=cat("o"),
            gate_up=cat("gate_up"),
            down=cat("down"),
        )

    def _pack_layer(
        self, lw: LayerWeights, rope: bool, probe: bool = False, w4: frozenset[str] = frozenset()
    ) -> kernels.LlamaLayer:
        """The layer packed into the arena, or (``probe``) a heap copy on int16 activations on
        every path, for calibration; the linears named in ``w4`` in 4 bits."""
        c = self.config
        arena = None if probe else self._arena
        act8 = self._act8 and not probe

        def pack(
            name: str,
            weight: torch.Tensor | W4Grid,
            bias: torch.Tensor | None = None,
            act_bf16=True,
        ) -> kernels.PackedLinear:
            in_w4 = name in w4
            w4_act8 = in_w4 and self._w4_act8 and name in W4_ACT8_LINEARS
            if isinstance(weight, W4Grid):
                return kernels.PackedLinear.from_w4_grid(*weight, bias, arena, act8=w4_act8)
            return kernels.PackedLinear.from_float(
                weight,
                bias,
                act_bf16=act_bf16 and not probe,
                arena=arena,
                act8=w4_act8 if in_w4 else act8,
                w4=in_w4,
            )

        return kernels.LlamaLayer(
            hidden=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            ffn=c.intermediate_size,
            eps=c.rms_norm_eps,
            input_norm=lw.input_norm,
            post_norm=lw.post_norm,
            q_norm=lw.q_norm,
            k_norm=lw.k_norm,
            rope=rope,
            qkv=pack("qkv", lw.qkv, lw.qkv_bias),
            o=pack("o", lw.o),
            gate_up=pack("gate_up", lw.gate_up),
            # NOTE: int16 activations for down_proj even on AMX: its input (SiLU(gate) * up) is
            # heavy-tailed, and bf16 there cost SmolLM2 ~0.6 % teacher-forced top-1 agreement with
            # fp32 (97.6 %); bf16 into qkv, o, gate_up and the LM head cost none (98.2 %).
            down=pack("down", lw.down, act_bf16=False),
        )

    @property
    def nbytes(self) -> int:
        layer_bytes = sum(
            lin.nbytes
            for layer in self.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        embedding = 0 if self.embedding is self.lm_head else self.embedding.nbytes
        return layer_bytes + self.lm_head.nbytes + embedding

    @property
    def weight_summary(self) -> str:
        """What the engine logs of the packed weights: size, the 4-bit share and the matrices
        that run on 8-bit activations."""
        w4 = sum(len(s) for s in self.w4_linears)
        total = len(LINEAR_SOURCES) * len(self.w4_linears)
        return (
            f"{self.nbytes / 2**20:.0f} MiB packed, {w4} of {total} layer matrices int4, "
            f"{self.act8_linears} on 8-bit activations"
        )

    @property
    def act8_linears(self) -> int:
        """How many layer matrices run on 8-bit activations (the others on int16)."""
        return sum(
            len(s & W4_ACT8_LINEARS) * self._w4_act8 + (len(LINEAR_SOURCES) - len(s)) * self._act8
            for s in self.w4_linears
        )

    # ------------------------------------------------------------------ forward

    def _scratch_for(self, num_tokens: int) -> kernels.LayerScratch:
        s = self._scratch
        if s is None or s.max_tokens < num_tokens:
            # Grow geometrically so a few large prefills do not reallocate every step.
            size = max(num_tokens, 2 * s.max_tokens if s else 64)
            s = self._scratch = kernels.LayerScratch(self.layers[0], size)
        return s

    def release_kv(self) -> None:
        """Drop the converted stack: it holds the cache tensors, which would outlive a release."""
        self._stack = None

    def _stack_for(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> kernels.LlamaStack:
        # The runner passes the same cache list every step: check and convert it once.
        s = self._stack
        if (
            s is None
            or len(s.kv_caches) != len(kv_caches)
            or any(a is not b for a, b in zip(s.kv_caches, kv_caches, strict=True))
        ):
            s = self._stack = kernels.LlamaStack(self.layers, kv_caches)
        return s

    @torch.inference_mode()
    def forward(
        self,
        batch: BatchInputs,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        argmax_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits [len(logits_indices), vocab]; each row's argmax (first index of the
        largest, NaN as -inf) into ``argmax_out`` (int64) if given."""
        limit = self.full_attention_limit
        if limit is not None and int(batch.seq_lens.max()) > limit:
            raise ValueError(f"a sequence is longer than the sliding window ({limit} tokens)")
        stack = self._stack_for(kv_caches)  # its cache geometry was derived and checked once
        step = kernels.LayerStep(
            positions=batch.positions,
            slot_mapping=batch.slot_mapping,
            block_table=batch.block_table,
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc,
            cos_sin=self.cos_sin,
            num_blocks=stack.num_blocks,
            block_size=stack.block_size,
            scale=self.scale,
            scratch=self._scratch_for(batch.num_tokens),
        )
        return kernels.model_forward(
            self._ends,
            stack,
            step,
            batch.input_ids,
            batch.logits_indices,
            argmax_out,
        )
