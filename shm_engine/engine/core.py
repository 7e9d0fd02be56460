"""EngineCore: the inner loop (schedule -> execute -> sample -> update), usable in-process.

EngineCoreProc (core_proc.py) wraps it in a process with rings and IO threads; tests and embedders
can drive it directly.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    SchedulerStats,
)
from shm_engine.engine.request import Request
from shm_engine.engine.scheduler import SampledTokens, Scheduler, SchedulerOutput
from shm_engine.engine.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, runner=None) -> None:
        if runner is None:
            from shm_engine.engine.model_runner import ModelRunner

            runner = ModelRunner(config)
        self.config = config
        self.runner = runner
        self.max_model_len = runner.max_model_len
        self.scheduler = Scheduler(
            config, runner.num_blocks, runner.max_model_len, runner.vocab_size
        )
        self.grammars = GrammarCompiler(
            getattr(runner, "tokenizer", None), runner.vocab_size, runner.eos_token_ids
        )
        self._sleeping = False
        self._profiler = None
        self.step_time = 0.0  # seconds in the model, for stats
        self.sched_time = 0.0  # seconds in schedule + update
        self.batch_queue_size = config.batch_queue_size
        self.batch_queue: deque[tuple[Future, SchedulerOutput]] = deque()
        self._executor = ThreadPoolExecutor(1, "model") if self.batch_queue_size > 1 else None
        # EngineCoreProc installs a hook that applies aborts which arrived while the model ran,
        # before update_from_output, so an aborted request gets no further token.
        self.before_update = lambda: None

    # ------------------------------------------------------------------ requests

    def preprocess(self, msg: EngineCoreRequest) -> Request:
        """Validate a client request and build the engine's Request; raises ValueError.

        Thread-safe (reads only immutable config), so EngineCoreProc runs it on the input thread;
        the duplicate-id check needs the scheduler's state and happens in add_request. A
        structured output constraint is compiled here, off the busy loop.
        """
        rid = msg.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError("request_id must be a non-empty string")
        params = msg.sampling_params
        params.validate()
        ids = np.asarray(msg.prompt_token_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("prompt_token_ids must be a 1-D array of integers")
        prompt = ids.tolist()
        vocab = self.runner.vocab_size
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):  # as vLLM; negatives: validate()
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        if params.allowed_token_ids:
            allowed = np.unique(np.asarray(params.allowed_token_ids, dtype=np.int64))
            if allowed[-1] >= vocab:
                raise ValueError(f"allowed_token_ids must be in [0, {vocab})")
            stops = {*params.stop_token_ids, *self.runner.eos_token_ids}
            if (
                params.min_tokens
                and len(allowed) <= len(stops)
                and stops.issuperset(allowed.tolist())
            ):
                # every allowed token is masked during min_tokens: nothing could be sampled
                raise ValueError(
                    "allowed_token_ids are all EOS or stop tokens, which min_tokens masks"
                )
            params.allowed_token_ids = allowed.tolist()  # sorted once, off the busy loop
        self.scheduler.check_fits(len(prompt))
        room = self.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(
            rid,
            prompt,
            params,
            self.runner.eos_token_ids,
            max_tokens,
            arrival_time=msg.arrival_time or None,
            priority=msg.priority,
            cache_salt=msg.cache_salt,
        )
        if params.structured_outputs is not None:
            req.matcher = self.grammars.compile(params.structured_outputs)
        if params.bad_words:
            req.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        return req

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens, and those of " word" where that is another token sequence of the
        same length (a word inside text), as vLLM's SamplingParams.update_from_tokenizer."""
        tokenizer = getattr(self.runner, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer, which it lacks")
        out: list[list[int]] = []
        for word in words:
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return [ids for ids in out if ids]

    def add_request(self, msg: EngineCoreRequest | Request) -> None:
        req = msg if isinstance(msg, Request) else self.preprocess(msg)
        if req.request_id in self.scheduler.requests:
            raise ValueError(
                f"duplicate request_id {req.request_id!r}: one with this id is running"
            )
        if self._sleeping:
            raise RuntimeError("the engine is sleeping; call wake_up() first")
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        aborted = self.scheduler.abort_requests(request_ids)
        self._forget_if_idle()
        return aborted

    def ready_info(self) -> EngineReady:
        """What a client learns in the handshake: cache size, context length, vocabulary."""
        r = self.runner
        return EngineReady(
            num_kv_blocks=r.num_blocks,
            block_size=r.block_size,
            max_model_len=r.max_model_len,
            vocab_size=r.vocab_size,
            eos_token_ids=list(r.eos_token_ids),
            model_name=r.model_name,
            weights=r.weight_summary,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    # ------------------------------------------------------------------ stepping

    def step(self) -> EngineCoreOutputs | None:
        """One synchronous step; None when there was nothing to run."""
        if not self.scheduler.has_requests():
            return None
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        self._forget(sched.finished_ids)
        sampled = self._execute(sched) if not sched.empty else SampledTokens([])
        t2 = time.perf_counter()
        self.before_update()
        out = self.scheduler.update_from_output(sched, sampled)
        self._forget_if_idle()
        self.sched_time += (t1 - t0) + (time.perf_counter() - t2)
        self.step_time += t2 - t1
        return out

    def step_with_batch_queue(self) -> EngineCoreOutputs | None:
        """Overlap: schedule and submit step N+1 while step N runs in the model thread.

        A decode request is not rescheduled before its previous token is known (the scheduler
        advanced num_computed_tokens already), so the overlap helps when other work (new
        prompts, prefill chunks) can fill the next batch. Returns None when nothing finished.
        """
        assert self._executor is not None
        if self.scheduler.has_requests() and len(self.batch_queue) < self.batch_queue_size:
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            self.sched_time += time.perf_counter() - t0
            self._forget(sched.finished_ids)
            if not sched.empty:
                self.batch_queue.appendleft((self._executor.submit(self._execute, sched), sched))
                if (
                    len(self.batch_queue) < self.batch_queue_size
                    and not self.batch_queue[-1][0].done()
                ):
                    return None
        if not self.batch_queue:
            return None
        future, sched = self.batch_queue.pop()
        t1 = time.perf_counter()
        sampled = future.result()
        self.step_time += time.perf_counter() - t1
        t2 = time.perf_counter()
        self.before_update()
        out = self.scheduler.update_from_output(sched, sampled)
        self._forget_if_idle()
        self.sched_time += time.perf_counter() - t2
        return out

    def _forget(self, request_ids: list[str]) -> None:
        """Drop the sampler state of requests that finished or were aborted.

        NOTE: with a batch queue, in the model thread after the steps in flight: one of them may
        still sample for an aborted request, and would otherwise re-create its state (leaked, or
        inherited by a new request reusing the id).
        """
        if not request_ids:
            return
        if self._executor is None:
            self.runner.remove_requests(request_ids)
        else:
            self._executor.submit(self.runner.remove_requests, request_ids)

    def _forget_if_idle(self) -> None:
        """Without requests left no schedule() comes to hand over the last finished ids (the
        engine then waits for input): their sampler state, ~5 bytes a vocabulary entry with
        penalties, would stay until the next request."""
        if not self.scheduler.has_requests():
            self._forget(self.scheduler.take_finished_ids())

    def _execute(self, sched: SchedulerOutput) -> SampledTokens:
        with self._error_dump(sched):
            return self.runner.execute(sched)

    @contextmanager
    def _error_dump(self, sched: SchedulerOutput):
        try:
            yield
        except Exception:  # not SystemExit / KeyboardInterrupt: a signal is no model failure
            chunks = ", ".join(
                f"{c.request.request_id}[{c.start}:{c.start + c.num_tokens}]" for c in sched.chunks
            )
            logger.error(
                "model execution failed\nbatch: %d tokens: %s\nscheduler state:\n%s",
                sched.num_tokens,
                chunks,
                self.scheduler.dump_state(),
            )
            raise

    # ------------------------------------------------------------------ utilities (callable by name)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def get_timing(self) -> dict[str, float]:
        """Cumulative seconds in the model and in scheduling + output processing, and steps."""
        return {
            "model_s": self.step_time,
            "sched_s": self.sched_time,
            "steps": self.scheduler.step_count,
        }

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; returns how many blocks were uncached."""
        return self.scheduler.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache memory; only when idle (a running request would lose its KV).

        ``level`` is vLLM's (1: weights kept, 2: weights dropped too); both release the KV cache
        only here: a CPU engine's weights are its packed copy, re-made only by a reload."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_work():
            raise RuntimeError("cannot sleep with requests in flight")
        if not self._sleeping:
            self.scheduler.reset_prefix_cache()
            self.runner.release_kv_cache()
            self._sleeping = True

    def wake_up(self) -> None:
        if self._sleeping:
            self.runner.allocate_kv_cache()
            self._sleeping = False

    def is_sleeping(self) -> bool:
        return self._sleeping

    def profile(self, is_start: bool = True) -> str | None:
        """Start or stop the torch profiler; stopping returns a table of the top ops."""
        import torch.profiler

        if is_start:
            if self._profiler is None:
                self._profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                )
                self._profiler.__enter__()
            return None
        if self._profiler is None:
            raise RuntimeError("the profiler is not running")
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)

    def execute_dummy_batch(self) -> None:
        """Run one tiny forward outside the scheduler (warm-up, liveness check)."""
        if self._executor is None:
            self.runner.execute_dummy()
            return
        # NOTE: with a batch queue the model thread may be in a step's forward right now; the
        # model's scratch buffers and the kernels' thread pool serve one forward at a time, so
        # the dummy queues behind that step on the same thread.
        self._executor.submit(self.runner.execute_dummy).result()

    def echo(self, value):
        """Returns its argument; lets clients test the utility path."""
        return value

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self.grammars.shutdown()
        self.runner.shutdown()
