"""DPClient's routing over stand-in replicas (the real ones are in test_engine_e2e)."""

from __future__ import annotations

import numpy as np
import pytest

from shm_engine.engine import dp_client
from shm_engine.engine.client import EngineDeadError
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.protocol import EngineCoreRequest, SchedulerStats
from shm_engine.sampling_params import SamplingParams


class Replica:
    """What DPClient uses of a SyncMPClient; ``dead`` makes every send fail as a dead one's."""

    def __init__(self, config: EngineConfig, engine_index: int, outputs, launch=None) -> None:
        assert launch is None  # DPClient starts its own unless given launches
        self.ready, self.dead, self.running = object(), False, set()
        self.outputs = outputs

    @property
    def is_dead(self) -> bool:
        return self.dead

    def add_request(self, request: EngineCoreRequest) -> None:
        self.running.add(request.request_id)

    def abort_requests(self, ids: list[str]) -> None:
        if self.dead:
            raise EngineDeadError("engine process died")
        self.running -= set(ids)

    def call_utility_async(self, method: str, *args):
        from concurrent.futures import Future

        answers = {"get_stats": SchedulerStats(num_running=len(self.running)),
                   "reset_prefix_cache": 3, "is_sleeping": True, "sleep": None, "echo": args}  # fmt: skip
        done: Future = Future()
        done.set_result(answers[method])
        return done

    def shutdown(self) -> None:
        pass


def client_with_two_requests(monkeypatch) -> dp_client.DPClient:
    monkeypatch.setattr(dp_client, "SyncMPClient", Replica)
    client = dp_client.DPClient(EngineConfig(), 2)
    params = SamplingParams(max_tokens=4)
    for rid in ("a", "b"):
        client.add_request(
            EngineCoreRequest(
                request_id=rid, prompt_token_ids=np.array([1, 2]), sampling_params=params
            )
        )
    return client


def test_an_abort_reaches_the_live_replicas_when_one_is_dead(monkeypatch) -> None:
    # A dead replica's error stopped the loop: the live one ran the forgotten request on.
    client = client_with_two_requests(monkeypatch)
    dead, live = client.engines
    dead.dead = True
    with pytest.raises(EngineDeadError):
        client.abort_requests(["a", "b"])
    assert not live.running and client.router.load == [0, 0]


def test_a_dead_replica_makes_the_live_ones_drop_their_requests(monkeypatch) -> None:
    # The client is dead with it, so no caller aborts: the survivors ran on to max_tokens.
    client = client_with_two_requests(monkeypatch)
    dead, live = client.engines
    assert live.running
    dead.dead = True
    client.outputs.put(EngineDeadError("engine process died"))
    with pytest.raises(EngineDeadError):
        client.get_output(timeout=1)
    assert not live.running and client.router.load == [0, 0]


def test_replica_stats_merge_as_one_engines() -> None:
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=10,
                       prefix_cache_hits=4, num_preemptions=1, step_count=7)  # fmt: skip
    b = SchedulerStats(num_running=1, kv_cache_usage=0.25, prefix_cache_queries=6, step_count=3)
    assert dp_client.merge_stats([a, b]) == SchedulerStats(
        num_running=3, num_waiting=1, kv_cache_usage=0.375, prefix_cache_queries=16,
        prefix_cache_hits=4, num_preemptions=1, step_count=10,
    )  # fmt: skip


def test_utility_results_are_one_engines(monkeypatch) -> None:
    """LLM(data_parallel_size=N).get_stats() and reset_prefix_cache() answer as one engine's
    (they returned a list a replica, so .num_running raised AttributeError)."""
    client = client_with_two_requests(monkeypatch)
    assert client.call_utility("get_stats") == SchedulerStats(num_running=2)
    assert client.call_utility("reset_prefix_cache") == 6
    assert client.call_utility("is_sleeping") is True and client.call_utility("sleep") is None
    assert client.call_utility("echo", 5) == [(5,), (5,)]  # the rest: one result a replica
