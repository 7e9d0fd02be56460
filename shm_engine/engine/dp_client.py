"""Data parallelism: N engine replicas on disjoint cores behind one client.

Each replica is a full EngineCoreProc with its own channel; the client sends each new request to
the replica with the fewest unfinished requests (it sees every output, so the counts are exact),
keeps aborts with the request's owner and merges all outputs into one queue. Replicas of a dense
model need no step synchronisation, so there are no vLLM-style "waves". One dead replica makes
the whole client dead: a frontend cannot silently lose a share of its requests.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from shm_engine.engine.client import EngineDeadError, SyncMPClient, _typed
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.protocol import EngineCoreOutputs, EngineCoreRequest


def split_cores(n: int) -> list[list[int]]:
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise ValueError(f"{n} replicas need at least {n} cores; this process may use {len(cores)}")
    per = len(cores) // n
    return [cores[i * per : (i + 1) * per] for i in range(n)]


class DPClient:
    def __init__(self, config: EngineConfig, data_parallel_size: int) -> None:
        self.outputs: queue.Queue = queue.Queue()
        configs = [
            msgspec.structs.replace(config, cpu_ids=cores, num_threads=len(cores))
            for cores in split_cores(data_parallel_size)
        ]
        # Replicas load their models concurrently.
        with ThreadPoolExecutor(data_parallel_size) as pool:
            futures = [
                pool.submit(SyncMPClient, cfg, engine_index=i, outputs=self.outputs)
                for i, cfg in enumerate(configs)
            ]
            errors = [f.exception() for f in futures]
        self.engines = [f.result() for f in futures if f.exception() is None]
        if any(errors):
            self.shutdown()
            raise next(e for e in errors if e is not None)
        self.ready = self.engines[0].ready
        self.owner: dict[str, int] = {}
        self.load = [0] * len(self.engines)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.owner:
            # Another replica would run it twice; the owning one would fail the original.
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        i = min(range(len(self.engines)), key=self.load.__getitem__)
        self.engines[i].add_request(request)
        self.owner[request.request_id] = i
        self.load[i] += 1

    def abort_requests(self, request_ids: list[str]) -> None:
        per_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self.owner.pop(rid, None)
            if i is not None:
                self.load[i] -= 1
                per_engine.setdefault(i, []).append(rid)
        for i, ids in per_engine.items():
            self.engines[i].abort_requests(ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        try:
            item = self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, EngineDeadError):
            self.outputs.put(item)
            raise item
        for row in item.finished:
            self._release(item.request_ids[row])
        for err in item.errors:
            self._release(err.request_id)
        return item

    def _release(self, rid: str) -> None:
        i = self.owner.pop(rid, None)
        if i is not None:
            self.load[i] -= 1

    def call_utility(self, method: str, *args: Any) -> list[Any]:
        """Call on every replica; returns one result per replica."""
        futures = [e.call_utility_async(method, *args) for e in self.engines]
        return [_typed(method, f.result(timeout=300)) for f in futures]

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()

    def __enter__(self) -> DPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
