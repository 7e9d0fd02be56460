"""Model hyper-parameters, parsed from a Hugging Face config.json or from GGUF metadata.

One frozen dataclass is shared by the loader, the fp32 reference, the int8 runner and the KV-cache
sizing, so that every component agrees on shapes and on the RoPE frequencies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Architectures that share the Llama block (pre-norm, RMSNorm, GQA attention, SwiGLU MLP).
# Qwen3 adds an RMSNorm over each query and key head before RoPE (qk_norm); SmolLM3 leaves RoPE
# out of some layers (nope_layers).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")

_HF_MODEL_TYPES = {a: a for a in SUPPORTED_ARCHITECTURES}
# transformers' defaults for a config.json without max_position_embeddings
_HF_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768,
                     "smollm3": 32768}  # fmt: skip
# The architectures that slide only with use_sliding_window (Qwen2's rule).
_OPT_IN_WINDOW_ARCHS = ("qwen2", "qwen3", "smollm3")
# llama.cpp's SmolLM3 graph: every 4th layer has no RoPE (GGUF files do not say it)
_SMOLLM3_NOPE_INTERVAL = 4
# what each supported rope_scaling kind reads (llama3's original context defaults, as in HF)
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" (also SmolLM2), "mistral", "qwen2", "qwen3" or "smollm3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # dicts don't hash
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    sliding_window: int | None = None  # Mistral v0.1; None = full attention
    # llama.cpp stores Llama-3 RoPE scaling as per-frequency divisors (`rope_freqs.weight`)
    # instead of the HF rope_scaling dict; kept here so inv_freq() is right for such files.
    rope_freq_factors: tuple[float, ...] | None = None
    # layers whose attention has no RoPE (SmolLM3's NoPE layers: positions come from the mask)
    nope_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
        for name in (*sizes, "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if isinstance(self.eos_token_id, list):  # keep the dataclass hashable
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        object.__setattr__(self, "nope_layers", tuple(sorted(set(self.nope_layers))))
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {self.nope_layers} past the {self.num_layers} layers")
        self._rope_kind()  # an unsupported rope_scaling fails here, not after packing the weights

    # ------------------------------------------------------------------ derived values
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_in_layer(self, i: int) -> bool:
        return i not in self.nope_layers

    @property
    def qk_norm(self) -> bool:
        """Queries and keys pass a per-head RMSNorm before RoPE (Qwen3's q_norm, k_norm)."""
        return self.architecture == "qwen3"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied); used for memory estimates."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def _rope_kind(self) -> str:
        """The RoPE scaling kind, checked without torch (frontends parse configs without it)."""
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")
        needs = _ROPE_SCALING_KEYS.get(kind, ())
        missing = [k for k in needs if k not in scaling]
        if missing:
            raise ValueError(f"{kind} rope scaling needs {', '.join(missing)}")
        for k in needs:
            float(scaling[k])  # a value that is no number fails here too
        return kind

    def inv_freq(self) -> torch.Tensor:
        """fp32 RoPE inverse frequencies [head_dim // 2], with linear / llama3 scaling applied.

        Computed in float64 then cast, so the reference and the native kernels can share bits.
        """
        import torch

        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if self.rope_freq_factors is not None:
            inv = inv / torch.tensor(self.rope_freq_factors, dtype=torch.float64)
        kind = self._rope_kind()
        if kind == "linear":
            inv = inv / float(self.rope_scaling["factor"])
        elif kind == "llama3":
            inv = _llama3_scale(inv, self.rope_scaling, self.max_position_embeddings)
        return inv.to(torch.float32)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config.json dict (LlamaConfig / MistralConfig / Qwen2Config)."""
        model_type = cfg.get("model_type")
        if model_type is None:
            archs = cfg.get("architectures") or [""]
            model_type = archs[0].lower().replace("forcausallm", "")
        arch = _HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        _check_hf_features(cfg, arch)
        num_layers = int(cfg["num_hidden_layers"])
        sliding = _hf_sliding_window(cfg, arch, num_layers)
        # transformers' defaults where config.json leaves a key out (it writes none that equal
        # them): SmolLM3 is tied, with theta 2e6
        theta = cfg.get("rope_theta", 2e6 if arch == "smollm3" else 10000.0)
        scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")
        if params and any(isinstance(v, Mapping) for v in params.values()):
            # Keyed by layer type ({"full_attention": {...}, "sliding_attention": {...}}).
            raise NotImplementedError("per-layer-type rope_parameters are not supported")
        if params:
            # NOTE: transformers v5 moved both into rope_parameters; reading only the old keys
            # ran such a model with theta 1e4 and no scaling, silently. A theta left at the top
            # level still counts, as in transformers.
            theta = params.get("rope_theta", theta)
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            # Qwen3Config's default is 128 whatever the width (Qwen3-0.6B: 1024 / 16 heads)
            head_dim=int(cfg.get("head_dim") or (128 if arch == "qwen3" else hidden // heads)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(
                cfg.get("max_position_embeddings", _HF_MAX_POSITIONS[arch])
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "smollm3")),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            sliding_window=sliding,
            nope_layers=_hf_nope_layers(cfg, arch, num_layers),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that from_hf_config() parses back to an equal config."""
        names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM"}  # fmt: skip
        out: dict[str, Any] = {
            "architectures": [names[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.architecture == "smollm3":
            out["no_rope_layers"] = [int(self.rope_in_layer(i)) for i in range(self.num_layers)]
        elif self.nope_layers:
            raise ValueError(f"{self.architecture} has no form for nope_layers in config.json")
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            if self.architecture in _OPT_IN_WINDOW_ARCHS:
                out["use_sliding_window"] = True
                out["max_window_layers"] = 0  # every layer slides
        if self.rope_freq_factors is not None:
            raise ValueError(
                "rope_freq_factors (from a GGUF rope_freqs tensor) have no config.json form"
            )
        return out

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: Mapping[str, Any],
        *,
        vocab_size: int | None = None,
        tie_word_embeddings: bool = False,
        attention_bias: bool = False,
        rope_freq_factors: tuple[float, ...] | None = None,
    ) -> ModelConfig:
        """Parse GGUF key/values (already decoded to Python values).

        What the metadata does not say (tied output, biases, llama3 rope factors) is inferred by
        the loader from the tensor list and passed in.
        """
        arch = str(meta["general.architecture"])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        def need(name: str) -> int:
            value = key(name)
            if isinstance(value, list):  # per-layer lists in some files; this family is uniform
                if len(set(value)) > 1:
                    raise NotImplementedError(f"GGUF {arch}.{name} varies by layer: {value}")
                value = value[0] if value else None
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return int(value)

        heads = need("attention.head_count")
        has_kv = key("attention.head_count_kv") is not None
        kv_heads = need("attention.head_count_kv") if has_kv else heads
        hidden = need("embedding_length")
        head_dim = int(key("attention.key_length", hidden // heads))
        if vocab_size is None:
            vocab_size = key("vocab_size")
            if vocab_size is None:
                vocab_size = len(meta.get("tokenizer.ggml.tokens", ()))
        rope_scaling = None
        # llama.cpp's reading: no type means linear, and the factor may sit under the old key.
        scale_type = key("rope.scaling.type", "linear")
        factor = key("rope.scaling.factor") or key("rope.scale_linear")
        if scale_type == "linear" and factor and float(factor) != 1.0:
            rope_scaling = {"rope_type": "linear", "factor": float(factor)}
        elif scale_type not in ("none", "linear"):
            raise NotImplementedError(f"GGUF rope scaling {scale_type!r} is not supported")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot != eos:
            eos = (int(eos), int(eot)) if eos is not None else int(eot)
        sliding = key("attention.sliding_window")
        layers = need("block_count")
        nope = ()
        if arch == "smollm3":
            nope = tuple(i for i in range(layers) if (i + 1) % _SMOLLM3_NOPE_INTERVAL == 0)
        return cls(
            nope_layers=nope,
            architecture=arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=attention_bias,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=eos if isinstance(eos, tuple) else _opt_int(eos),
            sliding_window=int(sliding) if sliding else None,
            rope_freq_factors=rope_freq_factors,
        )

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _llama3_scale(inv: torch.Tensor, s: Mapping[str, Any], max_positions: int) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by `factor`, short ones
    untouched, a linear blend in between (same formula as the reference implementation).

    As in transformers, the original context defaults to `max_positions` (guessing Llama 3's
    8192 gave other models different frequencies, silently) and the factors have no default."""
    import torch

    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_ctx = float(s.get("original_max_position_embeddings", max_positions))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _check_hf_features(cfg: Mapping[str, Any], arch: str) -> None:
    """Refuse config.json features this forward does not compute, rather than ignore them.

    Why: a checkpoint with, e.g., MLP biases would load (the extra tensors unread) and silently
    compute a different function.
    """
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"hidden_act {act!r} is not supported (only SiLU)")
    if cfg.get("mlp_bias"):
        raise NotImplementedError("mlp_bias=true (biases on the MLP projections) is not supported")
    if arch != "qwen2" and cfg.get("attention_bias"):
        # Llama/Mistral/Qwen3 put the bias on o_proj too; only Qwen2's q/k/v-only bias is
        # computed.
        raise NotImplementedError(f"attention_bias=true on a {arch} model is not supported")


def _hf_nope_layers(cfg: Mapping[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: ``no_rope_layers`` flags (1: RoPE, as transformers reads
    them), or by default every ``no_rope_layer_interval``-th layer."""
    if arch != "smollm3":
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(num_layers)]
    if len(flags) < num_layers:  # transformers reads the first num_layers
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, rope in enumerate(flags[:num_layers]) if not rope)


def _hf_sliding_window(cfg: Mapping[str, Any], arch: str, num_layers: int) -> int | None:
    """The attention window transformers applies, or None for full attention everywhere.

    Why each rule: Llama's attention has no window (a stray key is ignored there); Mistral's
    window covers every layer; Qwen2 slides only with use_sliding_window, and then only from layer
    max_window_layers on (or as `layer_types` says). One window for all layers is what the
    kernels compute, so a mix of full and sliding layers is refused rather than run wrong.
    """
    window = cfg.get("sliding_window", 4096)  # transformers' default, where the key is left out
    if arch == "llama" or not window:
        return None
    if arch in _OPT_IN_WINDOW_ARCHS and not cfg.get("use_sliding_window", False):
        return None
    kinds = cfg.get("layer_types")
    if kinds is None and arch == "smollm3":
        raise NotImplementedError("a SmolLM3 sliding window needs its layer_types")
    if kinds is None and arch in _OPT_IN_WINDOW_ARCHS:
        first = int(cfg.get("max_window_layers", 28))  # transformers' default
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    kinds = set(kinds or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return int(window)
    raise NotImplementedError(
        f"layers mixing full and sliding-window attention ({sorted(kinds)}) are not supported"
    )
