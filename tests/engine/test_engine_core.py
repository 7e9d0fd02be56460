"""EngineCore in process over a tiny random-weight fp32 model: steps in flight, prompt logprobs."""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import pytest
import torch
from model.conftest import tiny_config, tiny_weights

from shm_engine.engine.client import EngineDeadError, InprocClient
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.core import EngineCore
from shm_engine.engine.model_runner import ModelRunner
from shm_engine.engine.request import Request
from shm_engine.model.reference import ReferenceModel
from shm_engine.model.torch_model import TorchLlama
from shm_engine.sampling_params import SamplingParams

CONFIG = tiny_config(vocab_size=320, max_position_embeddings=256)
WEIGHTS = tiny_weights(CONFIG, seed=1)


def make_core(batch_queue_size: int = 1, step_s: float = 0.0, **overrides: Any) -> EngineCore:
    """A core over the tiny fp32 model; its forward takes ``step_s`` more, so steps queue up."""
    model = TorchLlama(CONFIG, WEIGHTS)
    forward = model.forward

    def slow(*args: Any, **kw: Any) -> Any:
        time.sleep(step_s)
        return forward(*args, **kw)

    if step_s:
        model.forward = slow  # type: ignore[method-assign]
    args = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, num_threads=1)
    cfg = EngineConfig(**{**args, **overrides}, batch_queue_size=batch_queue_size, dtype="float32")
    loaded = types.SimpleNamespace(config=CONFIG, tokenizer=None)
    return EngineCore(cfg, ModelRunner(cfg, loaded, model))


def request(rid: str, prompt: list[int], **sp: Any) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=6, **sp), (), 6, arrival_time=0.0)


def drain(core: EngineCore) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while core.has_work():
        out = core.step_with_batch_queue()
        if out is None:
            continue
        for rid, tok in zip(out.request_ids, out.new_token_ids, strict=True):
            got.setdefault(rid, []).append(tok)
    return got


def test_an_abort_with_its_step_still_queued_leaves_no_sampler_state() -> None:
    # The aborted request's first step runs after the abort: its sampler state, made then, must
    # not outlive it, or a new request reusing the id samples with the old parameters.
    core = make_core(batch_queue_size=3, step_s=0.05)
    try:
        core.add_request(request("A", list(range(3, 20)), temperature=0.0))
        core.step_with_batch_queue()  # A's step runs
        core.add_request(request("R", [5, 6, 7], temperature=0.0))
        core.step_with_batch_queue()  # R's step waits behind it
        core.abort_requests(["R"])
        drain(core)
        assert "R" not in core.runner.sampler_states
        core.add_request(request("R", [5, 6, 7], temperature=1.0, seed=1234))
        assert len(drain(core)["R"]) == 6
        state: Any = core.runner.sampler_states.get("R")
        assert state is None or (state.params.temperature, state.params.seed) == (1.0, 1234)
    finally:
        core.shutdown()


@pytest.mark.parametrize("batch_queue_size", [1, 2])
def test_an_idle_engine_keeps_no_sampler_state(batch_queue_size: int) -> None:
    # The last requests' states used to wait for the next schedule(), which an idle engine
    # never runs (~5 bytes a vocabulary entry each with penalties).
    core = make_core(batch_queue_size=batch_queue_size)
    step = core.step if batch_queue_size == 1 else core.step_with_batch_queue
    try:
        core.add_request(request("a", [5, 6, 7], repetition_penalty=1.3))
        core.add_request(request("b", [5, 6, 8], repetition_penalty=1.3))
        for _ in range(3):
            step()
        assert core.runner.sampler_states
        core.abort_requests(["a"])
        while core.has_work():
            step()
        if core._executor is not None:
            core._executor.submit(lambda: None).result()  # the model thread's queue is done
        assert not core.runner.sampler_states
    finally:
        core.shutdown()


def test_a_kv_budget_without_room_for_a_block_is_refused() -> None:
    for bad in ({"kv_cache_bytes": 0}, {"kv_cache_bytes": -(1 << 30)}, {"num_kv_blocks": 0}):
        with pytest.raises(ValueError, match="kv_cache_bytes|num_kv_blocks"):
            EngineConfig(**bad)
    cfg = EngineConfig(block_size=4, kv_cache_bytes=100, num_threads=1, dtype="float32")
    loaded = types.SimpleNamespace(config=CONFIG, tokenizer=None)
    with pytest.raises(ValueError, match="holds no block"):  # it used to allocate one anyway
        ModelRunner(cfg, loaded, TorchLlama(CONFIG, WEIGHTS))


def test_a_kv_budget_past_the_memory_available_is_refused() -> None:
    """A clear error before anything is allocated, not the OOM killer mid-start."""
    from shm_engine.engine.model_runner import available_memory

    avail = available_memory()
    if avail is None:
        pytest.skip("no /proc/meminfo")
    # NOTE: 4x what is available: were the check gone, the kernel's overcommit heuristic
    # would refuse the allocation outright rather than let it be touched.
    cfg = EngineConfig(block_size=4, kv_cache_bytes=4 * avail, num_threads=1, dtype="float32")
    loaded = types.SimpleNamespace(config=CONFIG, tokenizer=None)
    with pytest.raises(ValueError, match="GiB of memory available"):
        ModelRunner(cfg, loaded, TorchLlama(CONFIG, WEIGHTS))


def test_a_dummy_batch_never_runs_beside_a_step() -> None:
    # With a batch queue a step's forward runs on the model thread; a dummy forward from the
    # busy loop ran at the same time, over the same scratch buffers and kernel thread pool.
    core = make_core(batch_queue_size=2, step_s=0.05)
    inside, overlaps = threading.Lock(), []
    execute, dummy = core.runner.execute, core.runner.execute_dummy

    def exclusive(run: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            overlaps.append(not inside.acquire(blocking=False))
            try:
                time.sleep(0.01)
                return run(*args)
            finally:
                if not overlaps[-1]:
                    inside.release()

        return wrapped

    core.runner.execute = exclusive(execute)  # type: ignore[method-assign]
    core.runner.execute_dummy = exclusive(dummy)  # type: ignore[method-assign]
    try:
        core.add_request(request("A", list(range(3, 40)), temperature=0.0))
        while core.has_work():
            core.step_with_batch_queue()
            core.execute_dummy_batch()
        assert len(overlaps) > 4 and not any(overlaps)
    finally:
        core.shutdown()


def test_the_in_process_client_after_shutdown_says_the_engine_is_gone() -> None:
    # As the process clients do; a step used to run into the released KV cache instead.
    client = InprocClient(EngineConfig(), core=make_core())
    client.shutdown()
    client.shutdown()
    for call in (lambda: client.get_output(), lambda: client.call_utility("echo", 1)):
        with pytest.raises(EngineDeadError, match="shut down"):
            call()


@pytest.mark.parametrize("budget", [64, 5])  # the whole prompt in a step, or chunks of 5
def test_prompt_logprobs_match_the_reference(budget: int) -> None:
    core = make_core(max_num_batched_tokens=budget)
    prompt = [(7 * i) % 300 + 3 for i in range(37)]
    core.add_request(request("p", prompt, temperature=0.0, prompt_logprobs=3))
    # A prefix-cache hit must not skip positions whose logits are owed: run it twice.
    for _ in range(2):
        got = []
        while core.has_work():
            out = core.step()
            got += [lps for row, lps in out.prompt_logprobs.items()] if out else []
        assert len(got) == 1 and len(got[0]) == len(prompt) - 1
        ref = torch.log_softmax(ReferenceModel(CONFIG, WEIGHTS).forward(prompt), -1)
        for j, lp in enumerate(got[0], start=1):
            row = ref[j - 1]
            assert lp.token_ids[0] == prompt[j]
            assert lp.logprobs[0] == pytest.approx(float(row[prompt[j]]), abs=1e-4)
            assert lp.token_ids[1:] == row.topk(3).indices.tolist()
            assert lp.sampled_rank == int((row >= row[prompt[j]]).sum())
        core.add_request(request("p", prompt, temperature=0.0, prompt_logprobs=3))
    core.shutdown()


def test_outputs_split_by_client_keep_every_row_column() -> None:
    """An engine serving several clients sends each its rows with all their columns (prompt
    logprobs had been dropped); every row-keyed column of EngineCoreOutputs is carried."""
    import typing

    import msgspec

    from shm_engine.engine.core_proc import _split_by_client
    from shm_engine.engine.protocol import ROW_COLUMNS, EngineCoreOutputs, Logprobs

    row_keyed = {
        f.name
        for f in msgspec.structs.fields(EngineCoreOutputs)
        if typing.get_origin(f.type) is dict and typing.get_args(f.type)[0] is int
    }
    assert row_keyed == set(ROW_COLUMNS)
    lp = [Logprobs([5, 6], [-0.1, -2.0], 1)]
    out = EngineCoreOutputs(
        request_ids=["a", "b", "c"],
        num_new_tokens=[1, 2, 1],
        new_token_ids=[10, 20, 21, 30],
        finished={1: "stop", 2: "length"},
        stop_reasons={1: 7},
        num_cached_tokens={0: 16, 2: 32},
        logprobs={0: lp, 2: lp},
        prompt_logprobs={0: lp, 2: lp},
    )
    parts = _split_by_client(out, {"a": 0, "b": 1, "c": 0})
    a_c, b = parts[0], parts[1]
    assert (a_c.request_ids, a_c.new_token_ids, b.request_ids, b.new_token_ids) == (
        ["a", "c"], [10, 30], ["b"], [20, 21]
    )  # fmt: skip
    assert a_c.finished == {1: "length"} and b.finished == {0: "stop"} and b.stop_reasons == {0: 7}
    assert a_c.num_cached_tokens == {0: 16, 1: 32} and a_c.logprobs == {0: lp, 1: lp}
    assert a_c.prompt_logprobs == {0: lp, 1: lp} and not b.prompt_logprobs


def test_stop_token_ids_past_the_vocabulary_are_refused() -> None:
    """As vLLM: a stop id the model can never sample is a mistake, not a no-op."""
    import numpy as np

    from shm_engine.engine.protocol import EngineCoreRequest

    core = make_core()
    try:
        for ids, ok in (([CONFIG.vocab_size - 1], True), ([CONFIG.vocab_size], False)):
            msg = EngineCoreRequest(
                request_id="r",
                prompt_token_ids=np.array([1, 2], dtype=np.int32),
                sampling_params=SamplingParams(stop_token_ids=ids),
            )
            if ok:
                core.preprocess(msg)
            else:
                with pytest.raises(ValueError, match="stop_token_ids must be in"):
                    core.preprocess(msg)
    finally:
        core.shutdown()


@pytest.mark.parametrize("batch_queue_size", [1, 2])
def test_step_count_counts_model_steps(batch_queue_size: int) -> None:
    """With a batch queue, schedule() also runs when it has nothing to add; those are no steps
    (get_stats' step_count was about twice the model's forwards)."""
    core = make_core(batch_queue_size, step_s=0.01)
    forwards = 0
    execute = core.runner.execute

    def counted(sched):
        nonlocal forwards
        forwards += 1
        return execute(sched)

    core.runner.execute = counted
    try:
        for i in range(3):
            core.add_request(request(f"r{i}", [1, 2, 3 + i]))
        step = core.step_with_batch_queue if batch_queue_size > 1 else core.step
        while core.has_work():
            step()
        assert core.scheduler.step_count == forwards > 0
    finally:
        core.shutdown()
