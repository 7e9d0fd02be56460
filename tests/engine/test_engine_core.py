"""EngineCore in process over a tiny random-weight fp32 model: step ordering with steps in flight."""

from __future__ import annotations

import time
import types
from typing import Any

from model.conftest import tiny_config, tiny_weights

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.core import EngineCore
from shm_engine.engine.model_runner import ModelRunner
from shm_engine.engine.request import Request
from shm_engine.model.torch_model import TorchLlama
from shm_engine.sampling_params import SamplingParams


def slow_core(batch_queue_size: int, step_s: float) -> EngineCore:
    """A core whose model takes ``step_s`` a forward, so steps queue up behind each other."""
    config = tiny_config(vocab_size=320, max_position_embeddings=256)
    model = TorchLlama(config, tiny_weights(config, seed=1))
    forward = model.forward

    def slow(*args: Any, **kw: Any) -> Any:
        time.sleep(step_s)
        return forward(*args, **kw)

    model.forward = slow  # type: ignore[method-assign]
    cfg = EngineConfig(
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=64,
        batch_queue_size=batch_queue_size,
        dtype="float32",
        num_threads=1,
    )
    loaded = types.SimpleNamespace(config=config, tokenizer=None)
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
    core = slow_core(batch_queue_size=3, step_s=0.05)
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
