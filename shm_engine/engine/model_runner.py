"""ModelRunner: turns a SchedulerOutput into one model forward plus sampling.

It owns the model, the paged KV cache (sized from the configured byte budget) and the sampler's
per-request state (seeded generators, penalties' history), keyed by request id and dropped when
the scheduler reports a request finished.
"""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from shm_engine.engine.config import EngineConfig, check_max_model_len
from shm_engine.engine.protocol import Logprobs
from shm_engine.engine.scheduler import SampledTokens, SchedulerOutput
from shm_engine.model.batch import BatchInputs
from shm_engine.model.kv_cache import KV_CACHE_DTYPES, allocate_kv, kv_bytes_per_block
from shm_engine.model.loader import LoadedModel, load_model
from shm_engine.model.sample_native import mask_rows

logger = logging.getLogger(__name__)


def _block_signals() -> None:
    """Helper threads leave SIGINT/SIGTERM to the main thread, whose handlers act on them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def _int8_kv_name(config: EngineConfig) -> str:
    return "fp16" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache's element type for this config (the model's own ``kv_dtype``)."""
    return KV_CACHE_DTYPES[_int8_kv_name(config)] if config.dtype == "int8" else torch.float32


def build_model(config: EngineConfig, loaded: LoadedModel):
    """Build the int8 (native kernels) or fp32 (torch) paged model from loaded weights."""
    if config.dtype == "int8":
        from shm_engine.model.int8_model import Int8Llama, calibration_ids, smooths

        return Int8Llama(
            loaded.config,
            loaded.weights,
            num_threads=config.resolved_threads(),
            kv_cache_dtype=_int8_kv_name(config),
            activation_dtype=config.activation_dtype,
            weight_dtype=config.weight_dtype,
            # NOTE: 8-bit activations on W8 weights (path vnni) want smoothed weights (half
            # their error); int16 ones keep the weights as they are (smoothing halves their KL
            # to fp32 too, but swapped a near-tie first token of a test prompt:
            # docs/kernels.md), and so do W4 ones (smoothing would move them off their grids)
            calibration_ids=(
                calibration_ids(loaded.tokenizer)
                if smooths(config.activation_dtype, config.weight_dtype)
                else None
            ),
        )
    from shm_engine.model.torch_model import TorchLlama

    return TorchLlama(loaded.config, loaded.weights)


def available_memory() -> int | None:
    """Bytes the kernel can hand out without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_memory(kv_bytes: int) -> None:
    """Refuse a KV cache budget larger than the memory available.

    NOTE: the cache is allocated lazily by the OS and then zeroed page by page, so too large a
    budget passed the allocation and ended with the OOM killer taking this process (or a
    neighbour) mid-start, where it now fails with a message.
    """
    available = available_memory()
    if available is not None and kv_bytes > available:
        raise ValueError(
            f"a KV cache of {kv_bytes / 2**30:.2f} GiB does not fit in the "
            f"{available / 2**30:.2f} GiB of memory available: lower the KV cache budget"
        )


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded=None, model=None) -> None:
        self.config = config
        # NOTE: the int8 model computes on the native thread pool; torch only gathers embeddings
        # and runs small sampling ops. With more torch threads, libgomp's workers spin for
        # milliseconds after every small parallel op and take the cores from the native pool
        # (measured: batch-16 decode steps 15-20% slower).
        torch.set_num_threads(1 if config.dtype == "int8" else config.resolved_threads())
        started = time.perf_counter()
        if loaded is None:
            loaded = load_model(config.model)  # metadata; the weights are read as they are used
        self.model_config = loaded.config
        self.model_name = str(config.model or "SmolLM2-135M-Instruct")
        self.vocab_size = loaded.config.vocab_size
        self.tokenizer = loaded.tokenizer  # structured outputs build their token trie from it
        self.eos_token_ids = tuple(loaded.tokenizer.eos_token_ids if loaded.tokenizer else ())
        self.eos_token_ids = self.eos_token_ids or loaded.config.eos_token_ids
        self.block_size = config.block_size
        kv_dtype = model.kv_dtype if model is not None else kv_cache_dtype(config)
        per_block = kv_bytes_per_block(self.model_config, self.block_size, kv_dtype)
        self.num_blocks = config.num_kv_blocks or config.kv_cache_bytes // per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"a KV cache budget of {config.kv_cache_bytes} bytes holds no block: one block of "
                f"{self.block_size} tokens takes {per_block} bytes for this model"
            )
        capacity = self.num_blocks * self.block_size
        if config.max_model_len and config.max_model_len > capacity:
            # NOTE: as vLLM, a context the cache cannot hold once is a start-up error; it had
            # been lowered to the cache's size without a word.
            raise ValueError(
                f"max_model_len {config.max_model_len} does not fit in the KV cache "
                f"({self.num_blocks} blocks of {self.block_size} tokens: {capacity} tokens); "
                "raise the KV cache budget or lower max_model_len"
            )
        check_fits_memory(self.num_blocks * per_block)
        # NOTE: the cache is zeroed (its pages faulted in, on huge pages after compaction:
        # 1.4 s for 512 MiB on a 2-core guest) while the weights are dequantised and packed,
        # mostly one thread's work. Threads are joined before any error leaves this method.
        with ThreadPoolExecutor(1, "kv-alloc", _block_signals) as pool:
            kv_future = pool.submit(
                allocate_kv, self.model_config, self.num_blocks, self.block_size, kv_dtype
            )
            self.model = model if model is not None else build_model(config, loaded)
            # what the model packed, for the start-up logs (Int8Llama.weight_summary)
            self.weight_summary = getattr(self.model, "weight_summary", "fp32 weights")
            loaded_at = time.perf_counter()
            self.kv_caches = kv_future.result()
        kv_wait = time.perf_counter() - loaded_at
        # The RoPE table (and the model's training) end at max_position_embeddings: later
        # positions would come out wrong without an error. The int8 path runs a sliding-window
        # model exactly only within its window (Int8Llama.full_attention_limit).
        limit = loaded.config.max_position_embeddings
        window = getattr(self.model, "full_attention_limit", None)
        what = "the model's context length"
        if window is not None and window < limit:
            limit, what = window, "the int8 path's limit for this sliding-window model"
            if not config.max_model_len:
                logger.info("sliding-window model on the int8 path: max_model_len %d", window)
        check_max_model_len(config.max_model_len, limit, what)
        # NOTE: never longer than the whole cache holds: a lone sequence that outgrew the cache
        # would preempt itself and be readmitted forever.
        self.max_model_len = min(config.max_model_len or limit, capacity)
        if self.max_model_len < limit and not config.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than the model's context (%d): "
                "max_model_len is %d",
                capacity,
                limit,
                self.max_model_len,
            )
        from shm_engine.model.sampler import Sampler

        self.sampler = Sampler()
        self.sampler_states: dict[str, object] = {}
        logger.info(
            "model runner: model built in %.2f s (%s); %d KV blocks of %d tokens (%.0f MiB), "
            "%.2f s more to allocate",
            loaded_at - started,
            self.weight_summary,
            self.num_blocks,
            self.block_size,
            self.num_blocks * per_block / 2**20,
            kv_wait,
        )

    # ------------------------------------------------------------------ KV cache memory

    def allocate_kv_cache(self) -> None:
        if self.kv_caches is None:
            self.kv_caches = allocate_kv(
                self.model_config, self.num_blocks, self.block_size, self.model.kv_dtype
            )

    def release_kv_cache(self) -> None:
        # NOTE: the model's per-cache state goes too, or its references keep the memory alive.
        self.kv_caches = None
        self.model.release_kv()

    # ------------------------------------------------------------------ requests

    def remove_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.sampler_states.pop(rid, None)

    def execute(self, sched: SchedulerOutput) -> SampledTokens:
        if self.kv_caches is None:
            raise RuntimeError("the KV cache is released (engine sleeping)")
        chunks = sched.chunks
        scores = [c.score for c in chunks] if any(c.score for c in chunks) else None
        # NOTE: a chunk with drafts runs them after its last token and needs the logits of
        # every row: each is sampled as a plain step would sample its position
        rows = [(1 + len(c.drafts)) if c.samples else 0 for c in chunks]
        batch = BatchInputs.build(
            [
                (c.request.all_token_ids + c.drafts if c.drafts else c.request.all_token_ids,
                 c.start, c.num_tokens, c.block_ids)
                for c in chunks
            ],
            self.block_size,
            rows,
            scores,
        )  # fmt: skip
        sampling = [c for c in chunks if c.samples]
        states = []
        for c in sampling:
            req = c.request
            state = self.sampler_states.get(req.request_id)
            if state is None:
                state = self.sampler_states[req.request_id] = self.sampler.new_state(
                    req.sampling_params,
                    req.prompt_token_ids,
                    req.eos_token_ids,
                    req.bad_words_token_ids,
                )
            states.append(state)
        num_rows = sum(rows)
        # NOTE: every row plain greedy (the common case): the model's native call also takes
        # each row's argmax and the sampler is skipped, no Python between the LM head and the
        # tokens (batch 16: ~0.2 ms a step on the cold caches a step leaves)
        greedy = None
        if states and all(s.plain_greedy for s in states) and scores is None:
            greedy = torch.empty(num_rows, dtype=torch.int64)
        logits = self.model.forward(batch, self.kv_caches, greedy)
        if any(c.token_mask is not None for c in sampling):
            masked_rows, argmax = self._apply_token_masks(sampling, rows, logits)
            if greedy is not None:  # those rows' argmax again, among the allowed tokens
                greedy[masked_rows] = torch.from_numpy(argmax)
        prompt_lps = None
        if scores is not None:  # the scoring rows follow the sampling ones
            prompt_lps = _prompt_logprobs(chunks, logits[num_rows:])
            logits = logits[:num_rows]
        if not sampling:
            return SampledTokens([], prompt_logprobs=prompt_lps)
        drafted = num_rows > len(sampling)
        if greedy is not None:
            tokens = greedy.tolist()
            if not drafted:
                return SampledTokens(tokens)
            return _split_draft_rows(sampling, tokens)
        histories = [c.request.output_token_ids for c in sampling]
        checkpoints = []
        if drafted:
            # NOTE: a row after drafts is sampled with them as output so far: the step count
            # that keys a seeded draw, min_tokens, the penalties' counts (the rows of a request
            # come in order, each folding in one more draft; the counts go back afterwards)
            row_states, row_histories = [], []
            for c, state, history in zip(sampling, states, histories, strict=True):
                row_states.append(state)
                row_histories.append(history)
                if c.drafts and state.has_penalties:
                    checkpoints.append((state, state.checkpoint()))
                for j in range(len(c.drafts)):
                    row_states.append(state)
                    row_histories.append(history + c.drafts[: j + 1])
            states, histories = row_states, row_histories
        try:
            result = self.sampler.sample(logits, states, histories)
        finally:
            for state, checkpoint in checkpoints:
                state.restore(checkpoint)
        logprobs = None
        if result.logprobs is not None:
            logprobs = [
                None if lp is None else Logprobs(lp.token_ids, lp.logprobs, lp.sampled_rank)
                for lp in result.logprobs
            ]
        tokens = result.token_ids.tolist()
        if not drafted:
            return SampledTokens(tokens, logprobs, prompt_lps)
        out = _split_draft_rows(sampling, tokens, logprobs)
        out.prompt_logprobs = prompt_lps
        return out

    @staticmethod
    def _apply_token_masks(
        sampling: list, rows: list[int], logits: torch.Tensor
    ) -> tuple[list[int], np.ndarray]:
        """Structured outputs: the tokens a request's constraint refuses get -inf logits (and
        so logprobs), as vLLM applies its grammar bitmask before sampling; returns the rows
        and their argmax after masking."""
        starts = np.cumsum([0] + [r for r in rows if r])[:-1]  # each sampling chunk's first row
        masked = [(int(row), c.token_mask) for c, row in zip(sampling, starts, strict=True)]
        masked = [(row, mask) for row, mask in masked if mask is not None]
        masked_rows = [row for row, _ in masked]
        argmax = mask_rows(logits, masked_rows, np.stack([mask for _, mask in masked]))
        return masked_rows, argmax

    def execute_dummy(self) -> None:
        """A one-token forward on a scratch one-block cache, so no live or cached KV is touched."""
        batch = BatchInputs.build([([0], 0, 1, [0])], self.block_size, [True])
        self.model.forward(
            batch, allocate_kv(self.model_config, 1, self.block_size, self.model.kv_dtype)
        )

    def shutdown(self) -> None:
        self.kv_caches = None


def _split_draft_rows(
    sampling: list, tokens: list[int], logprobs: list[Logprobs | None] | None = None
) -> SampledTokens:
    """One token (and logprobs) a row, grouped by chunk: each chunk's first row's are its
    sampled ones, the rest those sampled after each of its drafts."""
    out = SampledTokens([], [] if logprobs is not None else None)
    row = 0
    for i, c in enumerate(sampling):
        end = row + 1 + len(c.drafts)
        out.token_ids.append(tokens[row])
        if logprobs is not None:
            out.logprobs.append(logprobs[row])
        if c.drafts:
            out.after_drafts[i] = tokens[row + 1 : end]
            if logprobs is not None:
                out.after_drafts_logprobs[i] = logprobs[row + 1 : end]
        row = end
    return out


def _prompt_logprobs(chunks: list, logits: torch.Tensor) -> dict[int, list[Logprobs]]:
    """Each scoring chunk's prompt tokens: their own logprob (of the raw distribution, as
    vLLM's), rank, and the top-n of their position."""
    lps = torch.log_softmax(logits.float(), dim=-1)
    out: dict[int, list[Logprobs]] = {}
    row = 0
    for ci, c in enumerate(chunks):
        if c.score is None:
            continue
        j0, j1 = c.score
        n = j1 - j0
        rows = lps[row : row + n]
        row += n
        targets = torch.tensor(c.request.all_token_ids[j0:j1], dtype=torch.int64)
        own = rows.gather(1, targets[:, None])[:, 0]
        ranks = (rows >= own[:, None]).sum(1)  # vLLM's: tied tokens all count
        k = min(c.request.sampling_params.prompt_logprobs, rows.shape[1])
        top_lp, top_ids = rows.topk(k, dim=1) if k else (rows[:, :0], rows[:, :0].long())
        out[ci] = [
            Logprobs([t, *ids], [lp, *tl], rank)
            for t, lp, rank, ids, tl in zip(
                targets.tolist(),
                own.tolist(),
                ranks.tolist(),
                top_ids.tolist(),
                top_lp.tolist(),
                strict=True,
            )
        ]
    return out
