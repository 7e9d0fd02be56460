"""Engine configuration: what the scheduler, KV cache and model runner are sized by."""

from __future__ import annotations

import os

import msgspec

# A decode step with k drafts computes k + 1 rows; past a handful, a wrong guess early wastes
# most of them.
MAX_SPECULATIVE_TOKENS = 16


class EngineConfig(msgspec.Struct, kw_only=True):
    """Sent to the engine process in the handshake, hence a msgspec Struct."""

    model: str | None = None  # GGUF file or HF directory; None: the embedded SmolLM2
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes (tests)
    max_num_seqs: int = 64
    # NOTE: a step's prefill chunk stalls every running decode for its duration; 256 tokens is
    # ~0.3 s on a 2-core AVX2 machine, ~0.1 s with AMX (by their prefill rates). Against 512, bench serve c=16 there kept
    # its throughput and cut TTFT p50 by 35-45 % and ITL p99 by 40 % (benchmarks/RESULTS.md).
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None  # None: the model's context length
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may take the whole budget
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority"
    num_threads: int = 0  # 0: every core this process may run on
    cpu_ids: list[int] | None = None  # pin the engine process (data-parallel replicas)
    batch_queue_size: int = 1  # 2: schedule step N+1 while step N runs in the model thread
    dtype: str = "int8"  # "int8" (VNNI kernels) or "float32" (torch reference path)
    # "auto" (the model's: fp16 for int8, fp32 for float32), "fp16" or "int8" (int8 weights only)
    kv_cache_dtype: str = "auto"
    # the int8 model's activations in its layers: "auto" (8 bits on 4-bit layers' o, gate_up and
    # down, as llama.cpp does for its 4-bit weights; int16 elsewhere), "int16" (exact on 4-bit
    # layers), or "int8" (also 8 bits on int8 layers, on kernel path "vnni", i.e. AVX512-VNNI
    # without AMX; accuracy: docs/kernels.md, "8-bit activations")
    activation_dtype: str = "auto"
    # the int8 model's layer weights: "int8", "int4" (4-bit groups of 32, affine: ~0.6 of the
    # bytes a decode step streams) or "auto": int4 for the matrices a GGUF file holds as Q4_0 /
    # Q4_1 / Q4_K (their own grids), on every kernel path but "amx" (docs/kernels.md)
    weight_dtype: str = "auto"
    log_stats: bool = True
    # Speculative decoding by n-gram lookup (ngram_proposer.py): up to this many draft tokens
    # a decode step, checked in the same forward (0: off; the same tokens, see Scheduler);
    # drafts continue the most recent earlier occurrence of the last n tokens, n from max down
    # to min
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be 0 (off) or positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}")
        if self.batch_queue_size < 1:
            raise ValueError("batch_queue_size must be at least 1")
        if self.num_threads < 0:
            raise ValueError(
                f"num_threads must be 0 (every core) or positive, got {self.num_threads}"
            )
        if self.dtype not in ("int8", "float32"):
            raise ValueError(f"dtype must be 'int8' or 'float32', got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "fp16", "int8"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto', 'fp16' or 'int8', got {self.kv_cache_dtype!r}"
            )
        if self.dtype == "float32" and self.kv_cache_dtype != "auto":
            raise ValueError("the float32 reference path keeps an fp32 KV cache")
        if self.activation_dtype not in ("auto", "int16", "int8"):
            raise ValueError(
                f"activation_dtype must be 'auto', 'int16' or 'int8', got {self.activation_dtype!r}"
            )
        if self.dtype == "float32" and self.activation_dtype == "int8":
            raise ValueError("activation_dtype applies to the int8 model only")
        if self.weight_dtype not in ("auto", "int8", "int4"):
            raise ValueError(
                f"weight_dtype must be 'auto', 'int8' or 'int4', got {self.weight_dtype!r}"
            )
        if self.dtype == "float32" and self.weight_dtype == "int4":
            raise ValueError("weight_dtype applies to the int8 model only")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    def resolved_threads(self) -> int:
        if self.num_threads:
            return self.num_threads
        return len(self.cpu_ids) if self.cpu_ids else len(os.sched_getaffinity(0))


_SPECULATIVE_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def speculative_args(speculative_config: dict | None) -> dict:
    """EngineConfig's speculative fields from vLLM's ``speculative_config`` (``{"method":
    "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, ...}``), so vLLM users'
    settings work unchanged; ValueError for what this engine does not do (draft models)."""
    if not speculative_config:
        return {}
    if not isinstance(speculative_config, dict):
        raise ValueError("speculative_config must be an object")
    spec = dict(speculative_config)
    method = spec.pop("method", "ngram")
    if method != "ngram":
        raise ValueError(
            f"speculative_config: only method 'ngram' (n-gram lookup) is supported, got {method!r}"
        )
    unknown = sorted(set(spec) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unsupported keys {unknown}")
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    return spec


def check_max_model_len(
    max_model_len: int | None, limit: int, what: str = "the model's context length"
) -> None:
    """Refuse a configured context longer than the model can run (positions past its RoPE
    table, or the training, would come out wrong without an error)."""
    if max_model_len and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds {what} ({limit} positions)")
