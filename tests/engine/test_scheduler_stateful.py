"""Randomized scheduler runs against a model that reads its context back from a simulated KV cache.

As a real model's KV entry, what the stand-in model writes for position p depends on the whole
prefix up to p (it writes a digest of it) into the slot its block table names; reading the
context back through the table checks every slot. A block shared, evicted, reused or published
wrongly (prefix caching, preemption, aborts with steps in flight, a prefix-cache reset), even
one holding the same tokens under another prefix, fails at once; sampled tokens are checked
against an unbatched reference after every step, together with the block pool's reference
counts. Hypothesis drives the mix of requests, aborts, steps in flight and configurations, and
shrinks a failure to a short story.

With speculative decoding on, decodes also run n-gram draft tokens; the stand-in model copies
the token four back two times in three, so its outputs repeat and drafts are often right, and
sometimes wrong: rejected drafts leave KV entries behind that must never be read or published.
"""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from shm_engine.engine.request import Request, RequestStatus
from shm_engine.engine.scheduler import SampledTokens, Scheduler, SchedulerOutput

from .test_scheduler import make_request, make_scheduler, next_token

# Prompts share prefixes (so the prefix cache has something to find) and differ in their tails,
# drawn from a small alphabet so equal blocks recur under different prefixes.
FAMILIES = [[100 + f * 50 + i for i in range(24)] for f in range(3)]


def model_token(prefix: list[int]) -> int:
    """The stand-in model's next token: next_token's hash, but two times in three a copy of the
    token four back, so outputs repeat as copying text does."""
    d = next_token(prefix)
    return prefix[-4] if len(prefix) >= 4 and d % 3 else d


def reference_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(model_token(seq))
    return seq[len(prompt) :]


def kv_entry(tokens: list[int], p: int) -> bytes:
    """What a model stores for position p: a function of the prefix tokens[: p + 1]."""
    return hashlib.blake2b(repr(tokens[: p + 1]).encode(), digest_size=8).digest()


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        num_blocks=st.integers(6, 40),
        budget=st.integers(4, 32),
        max_seqs=st.integers(1, 6),
        threshold=st.sampled_from([0, 3]),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        depth=st.integers(1, 3),
        max_model_len=st.sampled_from([40, 1024]),
        spec=st.sampled_from([0, 0, 1, 3, 5]),
        lookup_min=st.integers(1, 2),
    )
    def setup(
        self, block_size, num_blocks, budget, max_seqs, threshold, policy, caching, depth,
        max_model_len, spec, lookup_min,
    ) -> None:  # fmt: skip
        self.s: Scheduler = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            budget=budget,
            max_seqs=max_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=threshold,
            scheduling_policy=policy,
            enable_prefix_caching=caching,
            batch_queue_size=depth,
            num_speculative_tokens=spec,
            prompt_lookup_min=lookup_min,
            prompt_lookup_max=3,
        )
        self.depth = depth
        self.slots: list[list[bytes | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.in_flight: list[tuple[SchedulerOutput, SampledTokens]] = []
        self.live: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every request added, finished ones too
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.next_id = 0

    # ------------------------------------------------------------------ the stand-in model

    def execute(self, out: SchedulerOutput) -> SampledTokens:
        """Write each chunk's KV entries into its slots, read the whole context back through the
        block table (each entry must be this prefix's), then sample."""
        bs = self.s.config.block_size
        tokens, after = [], {}
        for chunk in out.chunks:
            req, table = chunk.request, chunk.block_ids
            seq = req.all_token_ids + chunk.drafts
            end = chunk.start + chunk.num_tokens
            if chunk.drafts:
                assert chunk.samples and chunk.num_tokens == 1 + len(chunk.drafts)
                assert end <= self.s.max_model_len
            assert chunk.num_tokens >= 1, "a chunk the model cannot run"
            assert len(table) * bs >= end, "block table too short"
            for p in range(chunk.start, end):
                self.slots[table[p // bs]][p % bs] = kv_entry(seq, p)
            for p in range(end):
                got = self.slots[table[p // bs]][p % bs]
                assert got == kv_entry(seq, p), f"{req!r} reads a wrong KV entry at {p}: {table}"
            if chunk.samples:
                base = end - len(chunk.drafts)
                tokens.append(model_token(seq[:base]))
                if chunk.drafts:
                    after[len(tokens) - 1] = [
                        model_token(seq[: base + 1 + j]) for j in range(len(chunk.drafts))
                    ]
        return SampledTokens(tokens, after_drafts=after)

    # ------------------------------------------------------------------ rules

    @rule(
        family=st.integers(0, len(FAMILIES) - 1),
        shared=st.integers(0, 24),
        tail=st.lists(st.integers(1, 3), max_size=12),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 2),
    )
    def add(self, family, shared, tail, max_tokens, priority) -> None:
        prompt = FAMILIES[family][:shared] + tail
        try:
            self.s.check_fits(len(prompt))
        except ValueError:
            return  # the engine refuses it before it reaches the scheduler
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = make_request(rid, prompt, max_tokens=max_tokens, priority=priority)
        self.s.add_request(req)
        self.live[rid] = self.requests[rid] = req
        self.outputs[rid] = []

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16))
    def abort(self, pick) -> None:
        rid = sorted(self.live)[pick % len(self.live)]
        assert self.s.abort_requests([rid]) == [rid]
        del self.live[rid]
        self.aborted.add(rid)

    @precondition(lambda self: len(self.in_flight) < self.depth)
    @rule()
    def schedule(self) -> None:
        out = self.s.schedule()
        cfg = self.s.config
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.s.running) <= cfg.max_num_seqs
        ids = [c.request.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        for chunk in out.chunks:
            assert chunk.request.status == RequestStatus.RUNNING
            if cfg.long_prefill_token_threshold and not chunk.drafts:  # a prefill's cap
                assert chunk.num_tokens <= cfg.long_prefill_token_threshold
        if out.preempted_ids:
            event(f"preemption with {len(self.in_flight)} steps in flight")
        if any(c.start and c.samples for c in out.chunks if c.request.num_output_tokens == 0):
            event("prefix or chunk reused")
        self.in_flight.append((out, self.execute(out)))

    @precondition(lambda self: self.in_flight)
    @rule()
    def complete(self) -> None:
        out, sampled = self.in_flight.pop(0)
        accepted = self.s.num_accepted_tokens
        result = self.s.update_from_output(out, sampled)
        if self.s.num_accepted_tokens > accepted:
            event("drafts accepted")
        elif any(c.drafts for c in out.chunks):
            event("drafts all rejected")
        k = 0
        for row, (rid, n) in enumerate(zip(result.request_ids, result.num_new_tokens, strict=True)):
            assert rid not in self.finished and rid not in self.aborted
            self.outputs[rid].extend(result.new_token_ids[k : k + n])
            k += n
            if row in result.finished:
                self.finished[rid] = result.finished[row]
                del self.live[rid]

    @rule()
    def reset_prefix_cache(self) -> None:
        self.s.reset_prefix_cache()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tokens_match_the_reference(self) -> None:
        for rid, got in self.outputs.items():
            req = self.requests[rid]
            assert got == reference_output(req.prompt_token_ids, len(got)), f"{rid}: wrong tokens"
            if rid in self.live:
                assert got == req.output_token_ids, f"{rid}: streamed tokens differ from its own"

    @invariant()
    def block_references_are_exact(self) -> None:
        pool, kv = self.s.kv.pool, self.s.kv
        holders = [0] * pool.num_blocks
        for blocks in kv.req_blocks.values():
            for b in blocks:
                holders[b.block_id] += 1
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id], f"{b}: {holders[b.block_id]} holders"
            assert (b.block_id in pool.free_queue) == (b.ref_cnt == 0)
        for h, b in pool.cached.items():
            assert b.block_hash == h
        for rid, blocks in kv.req_blocks.items():
            req = self.s.requests[rid]
            assert req.status == RequestStatus.RUNNING, f"{req!r} holds blocks"
            assert len(blocks) >= kv.blocks_needed(req.num_computed_tokens)

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        for _ in range(50_000):  # drain: everything still live must finish with the right tokens
            if not self.in_flight and not self.s.has_requests():
                break
            if self.in_flight and (len(self.in_flight) >= self.depth or not self.s.has_requests()):
                self.complete()
            else:
                self.schedule()
            self.tokens_match_the_reference()
            self.block_references_are_exact()
        else:
            raise AssertionError("did not drain:\n" + self.s.dump_state())
        assert not self.live
        for rid, reason in self.finished.items():
            req = self.requests[rid]
            room = self.s.max_model_len - req.num_prompt_tokens
            assert (reason, len(self.outputs[rid])) == ("length", min(req.max_tokens, room)), rid
        assert self.s.kv.num_free_blocks == self.s.kv.pool.num_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
