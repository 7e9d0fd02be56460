"""Continuous-batching scheduler with vLLM v1 semantics.

Each step has one token budget shared by decodes and (chunked) prefills. Running requests are
served first, in order; when the KV cache is full the scheduler preempts (FCFS: the newest
running request; priority: the lowest-priority one), frees its blocks and requeues it to be
recomputed later. Waiting requests are admitted only in steps without preemption, reusing cached
prefix blocks. ``schedule()`` advances ``num_computed_tokens`` at once, so a request whose sampled
token is still in flight is not scheduled again before ``update_from_output`` appends it.

With ``num_speculative_tokens``, a decode also feeds the model up to that many draft tokens
(ngram_proposer.py) after its last one. Each row is sampled as a plain decode step would sample
that position (the same logits, the same seeded draw, the drafts before it as output so far): a
draft is right if it is the token sampled at its position, and the right ones plus the token
sampled after them are appended at once, exactly what plain steps would have produced. The
drafts' KV entries are computed in the same forward; the rejected ones are taken back from
``num_computed_tokens`` and overwritten later.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.kv_cache_manager import KVCacheManager
from shm_engine.engine.ngram_proposer import NgramProposer
from shm_engine.engine.protocol import EngineCoreOutputs, Logprobs, SchedulerStats
from shm_engine.engine.request import FINISH_REASON, Request, RequestStatus
from shm_engine.engine.structured_output import MaskFiller, consume

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start`` go through the model."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    samples: bool = False  # the chunk reaches the last known token, so a new one is sampled
    epoch: int = 0  # the request's preemption count when scheduled (stale results are dropped)
    score: tuple[int, int] | None = None  # prompt tokens [j0, j1) whose logprobs it computes
    drafts: list[int] = field(default_factory=list)  # guessed tokens after the last one
    # structured outputs: the constraint's allowed next tokens (MaskFiller's int32 words)
    token_mask: np.ndarray | None = None


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # since the previous step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SampledTokens:
    """What the model runner returns: one token per sampling chunk, in chunk order."""

    token_ids: list[int]
    logprobs: list[Logprobs | None] | None = None
    prompt_logprobs: dict[int, list[Logprobs]] | None = None  # chunk index -> its score range's
    # sampling index -> the tokens sampled after each of that chunk's drafts, and their logprobs
    after_drafts: dict[int, list[int]] = field(default_factory=dict)
    after_drafts_logprobs: dict[int, list[Logprobs | None]] = field(default_factory=dict)


class _WaitingQueue:
    """FCFS deque or priority heap behind one interface.

    NOTE: removal is lazy (O(1)): a removed request stays in the container, marked, until it
    reaches the front. Removing from the middle of a deque or heap scans it, and a client that
    sends 100k prompts and goes away aborts them one by one: quadratic, minutes of engine time
    (found by a fuzzing review)."""

    def __init__(self, policy: str) -> None:
        self.priority = policy == "priority"
        self._items: list[Request] | deque[Request] = [] if self.priority else deque()
        self._removed: set[Request] = set()

    def __len__(self) -> int:
        return len(self._items) - len(self._removed)

    def __iter__(self):
        return (r for r in self._items if r not in self._removed)

    def _drop_removed_front(self) -> None:
        while self._items and self._items[0] in self._removed:
            self._removed.discard(self._take())

    def _take(self) -> Request:
        return heapq.heappop(self._items) if self.priority else self._items.popleft()

    def peek(self) -> Request:
        self._drop_removed_front()
        return self._items[0]

    def pop(self) -> Request:
        self._drop_removed_front()
        return self._take()

    def add(self, req: Request) -> None:
        if self.priority:
            heapq.heappush(self._items, req)
        else:
            self._items.append(req)

    def add_front(self, req: Request) -> None:
        """A preempted request goes back ahead of newer ones."""
        if self.priority:
            heapq.heappush(self._items, req)
        else:
            self._items.appendleft(req)

    def remove(self, req: Request) -> None:
        self._removed.add(req)


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_blocks: int, max_model_len: int, vocab_size: int = 0
    ) -> None:
        self.context_len = max_model_len  # the model's (or the configured) limit
        # NOTE: no sequence may outgrow the cache: one that did would preempt itself and never
        # fit again (a request that neither runs nor ends).
        max_model_len = min(max_model_len, num_blocks * config.block_size)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # A prompt (or a preempted sequence) longer than one step's budget could never run.
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens})"
                f" must be at least max_model_len ({max_model_len}): raise it or lower "
                "max_model_len"
            )
        self.config = config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = _WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.step_count = 0
        self.num_draft_tokens = 0  # speculative decoding: drafts checked, and output
        self.num_accepted_tokens = 0
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.vocab_size = vocab_size  # the width of structured outputs' token masks
        self.masks: MaskFiller | None = None  # made by the first constrained request

    # ------------------------------------------------------------------ requests in and out

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise ValueError if a prompt can never run: longer than the context or the whole cache."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= self.context_len:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens; this model's context length is "
                f"{self.context_len} (including at least one output token)"
            )
        capacity = self.kv.pool.num_blocks * self.config.block_size
        if num_prompt_tokens + 1 > capacity:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens but the whole KV cache holds "
                f"{capacity}; raise kv_cache_bytes"
            )

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finish the given requests at once and free their blocks; returns the ids that existed."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            done.append(rid)
        return done

    def has_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ scheduling

    def take_finished_ids(self) -> list[str]:
        """Requests finished or aborted since the last call (their per-request state can go)."""
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self.take_finished_ids())
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}
        preempted = False

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk_size(req, req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not self.kv.allocate(req, n):
                victim = self._pick_victim()
                chunk = scheduled.pop(victim.request_id, None)
                if chunk is not None:
                    budget += chunk.num_tokens
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled[req.request_id] = ScheduledChunk(req, req.num_computed_tokens, n, [])
            budget -= n

        while (
            not preempted
            and budget > 0
            and len(self.waiting)
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting.peek()  # new or preempted: nothing of it is in the cache
            prefix, num_cached = self.kv.find_cached_prefix(req)
            remaining = req.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            n = self._chunk_size(req, remaining, budget)
            req.num_computed_tokens = num_cached
            if not self.kv.allocate(req, n, prefix):
                req.num_computed_tokens = 0
                break
            self.waiting.pop()
            self.kv.count_prefix_lookup(req, num_cached)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = ScheduledChunk(req, num_cached, n, [])
            budget -= n

        if self.config.num_speculative_tokens and not preempted:
            self._add_drafts(scheduled.values(), budget)

        for chunk in scheduled.values():
            req = chunk.request
            chunk.block_ids = self.kv.block_ids(req)
            req.num_computed_tokens += chunk.num_tokens
            chunk.samples = req.num_computed_tokens - len(chunk.drafts) == req.num_tokens
            chunk.epoch = req.num_preemptions
            if req.prompt_logprobs is not None:
                # Position p's logits score prompt token p + 1; those already known are skipped
                # (a recompute after preemption).
                j0 = max(chunk.start, req.num_prompt_scored) + 1
                j1 = min(req.num_computed_tokens + 1, req.num_prompt_tokens)
                if j1 > j0:
                    chunk.score = (j0, j1)
            out.chunks.append(chunk)
        self._fill_token_masks(out.chunks)
        if out.chunks:  # a model step; with a batch queue, schedule() also runs with none to add
            self.step_count += 1
        return out

    def _fill_token_masks(self, chunks: list[ScheduledChunk]) -> None:
        """Structured outputs: the allowed next tokens of each constrained request that samples.

        NOTE: its matcher has consumed every output token: a request is not scheduled to sample
        again before its last sampled token was applied (update_from_output)."""
        constrained = [c for c in chunks if c.samples and c.request.matcher is not None]
        if not constrained:
            return
        if self.masks is None:
            self.masks = MaskFiller(self.vocab_size)
        rows, errors = self.masks.fill([c.request.matcher for c in constrained])
        for chunk, row, error in zip(constrained, rows, errors, strict=True):
            chunk.token_mask = row
            if error is not None:  # this step runs; its token ends the request
                chunk.request.constraint_error = error

    def _add_drafts(self, chunks, budget: int) -> None:
        """Give the step's decodes drafts from what is left of its budget and free blocks.

        NOTE: after every running and admitted request has its share, so drafts never take a
        token or a block another request needed this step, and never preempt; the blocks of
        rejected drafts go back when the step's result arrives (update_from_output). A block a
        running request (and step in flight) stays free for the next steps, where each may
        need one more: drafts that took the last ones, and were right, left a request nothing
        for its next token. A request that moves ahead faster can still meet a full cache
        sooner than it would have."""
        reserve = len(self.running) * self.config.batch_queue_size
        for chunk in chunks:
            if budget <= 0:
                return
            req = chunk.request
            if chunk.num_tokens != 1 or req.num_tokens - req.num_computed_tokens != 1:
                continue  # a prefill chunk
            drafts = self._drafts(req, budget)
            free = self.kv.num_free_blocks - reserve
            while drafts:
                extra = self.kv.blocks_to_allocate(req, 1 + len(drafts))
                if extra == 0 or extra <= free:  # the rest of a held block is always free
                    break
                drafts.pop()
            if drafts and self.kv.allocate(req, 1 + len(drafts)):
                chunk.drafts = drafts
                chunk.num_tokens += len(drafts)
                budget -= len(drafts)

    def _drafts(self, req: Request, room: int) -> list[int]:
        """Draft tokens for a decode of ``req``: at most num_speculative_tokens and ``room``,
        never more than the request and its context have room for (none while prompt logprobs
        are owed, nor under a structured output constraint)."""
        k = min(
            self.config.num_speculative_tokens,
            room,
            req.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        if k <= 0 or req.prompt_logprobs is not None or req.matcher is not None:
            return []
        return self.proposer.propose(req.request_id, req.all_token_ids, k)

    def _chunk_size(self, req: Request, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            n = min(n, threshold)
        return n

    def _pick_victim(self) -> Request:
        if self.waiting.priority:
            victim = max(self.running)
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(req)

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, sched: SchedulerOutput, sampled: SampledTokens
    ) -> EngineCoreOutputs:
        """Append sampled tokens, check stop conditions, free finished requests' blocks."""
        outputs = EngineCoreOutputs(timestamp=time.time())
        ids, counts, tokens = outputs.request_ids, outputs.num_new_tokens, outputs.new_token_ids
        i = 0
        for ci, chunk in enumerate(sched.chunks):
            req = chunk.request
            if (
                req.is_finished
                or req.status != RequestStatus.RUNNING
                or chunk.epoch != req.num_preemptions
            ):
                # Aborted or preempted while the step ran: its result is dropped.  NOTE: with
                # three or more steps in flight a preempted request can be running again (its
                # recompute scheduled) when this older step's result arrives: the epoch tells.
                if chunk.samples:
                    i += 1
                continue
            new_tokens = []
            if chunk.samples:
                new_tokens = [sampled.token_ids[i]]
                if chunk.drafts:
                    # A draft is right if it is the token sampled at its position; the rest
                    # are taken back (their KV entries are overwritten later).
                    for draft, after in zip(chunk.drafts, sampled.after_drafts[i], strict=True):
                        if new_tokens[-1] != draft:
                            break
                        new_tokens.append(after)
                    req.num_computed_tokens -= len(chunk.drafts) - (len(new_tokens) - 1)
                    self.kv.free_surplus(req)  # blocks taken for rejected drafts
                    self.num_draft_tokens += len(chunk.drafts)
            self.kv.cache_computed(req)
            if chunk.score is not None and sampled.prompt_logprobs:
                _add_prompt_logprobs(req, chunk.score[0], sampled.prompt_logprobs[ci])
            if not chunk.samples:
                continue
            lps = [sampled.logprobs[i] if sampled.logprobs else None]
            if len(new_tokens) > 1:
                lps += sampled.after_drafts_logprobs.get(i, [None] * len(chunk.drafts))
            i += 1
            first = req.num_output_tokens == 0
            row, before = len(ids), len(tokens)
            ids.append(req.request_id)
            for token in new_tokens:  # one, or more when drafts were right
                req.all_token_ids.append(token)
                tokens.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if (
                status == RequestStatus.FINISHED_STOPPED
                and req.matcher is not None
                and req.stop_reason is None
                and token not in req.eos_token_ids
            ):
                eos, eos_lps = _end_with_eos(req, lps[0])
                tokens.append(eos)
                lps.append(eos_lps)
            counts.append(len(tokens) - before)
            self.num_accepted_tokens += counts[-1] - 1 if chunk.drafts else 0
            if lps[0] is not None:
                outputs.logprobs[row] = lps[: counts[-1]]
            if first:
                outputs.num_cached_tokens[row] = req.num_cached_tokens
                if req.prompt_logprobs is not None:
                    outputs.prompt_logprobs[row] = req.prompt_logprobs
                    req.prompt_logprobs = None  # handed out: never computed again
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                outputs.finished[row] = FINISH_REASON[status]
                if req.stop_reason is not None:
                    outputs.stop_reasons[row] = req.stop_reason
        return outputs

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        n_out = req.num_output_tokens
        if req.matcher is not None and not _consume(req, token):
            return RequestStatus.FINISHED_ERROR
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.matcher is not None and req.matcher.is_stopped():
            # The constraint is complete: only EOS could follow (min_tokens gives way).
            return RequestStatus.FINISHED_STOPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self.proposer.drop(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.pool.queries,
            prefix_cache_hits=self.kv.pool.hits,
            num_preemptions=self.num_preemptions,
            step_count=self.step_count,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
        )

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def dump_state(self) -> str:
        """A readable snapshot for error reports."""
        lines = [
            f"step={self.step_count} running={len(self.running)} waiting={len(self.waiting)} "
            f"free_blocks={self.kv.num_free_blocks}/{self.kv.pool.num_blocks}",
        ]
        lines += [f"  running: {r!r} blocks={self.kv.block_ids(r)}" for r in self.running]
        lines += [f"  waiting: {r!r}" for r in self.waiting]
        return "\n".join(lines)


def _consume(req: Request, token: int) -> bool:
    """Feed a sampled token to the request's structured output constraint; False if the
    request must end with an error (a refused token, or a constraint too slow to follow)."""
    error = req.constraint_error or consume(req.matcher, token)
    if error is None:
        return True
    logger.warning("request %s ends: %s", req.request_id, error)
    return False


def _end_with_eos(req: Request, logprobs: Logprobs | None) -> tuple[int, Logprobs | None]:
    """The EOS a completed constraint allows as its only next token, and its logprobs.

    NOTE: appended at once rather than sampled in a forward of its own (vLLM's way, one more
    step): a "stop" finish hides the last token's text, which is the EOS here as for any
    other stop, and the token ids end with EOS as vLLM's do."""
    eos = req.eos_token_ids[0]
    req.all_token_ids.append(eos)
    if logprobs is None:
        return eos, None
    # Under the mask EOS is certain: its logprob is 0, and it heads the top-n (the other
    # tokens are refused, -inf, and left out).
    top = 1 if req.sampling_params.logprobs else 0
    return eos, Logprobs([eos] * (1 + top), [0.0] * (1 + top))


def _add_prompt_logprobs(req: Request, j0: int, entries: list[Logprobs]) -> None:
    """Append the logprobs of prompt tokens j0, j0 + 1, ...; those already known are skipped."""
    have = req.prompt_logprobs
    if have is None:
        return
    skip = len(have) + 1 - j0
    if skip >= 0:
        have.extend(entries[skip:])
