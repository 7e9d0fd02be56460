"""Data parallelism: N engine replicas on disjoint cores behind one client.

Each replica is a full EngineCoreProc with its own channel; the client sends each new request to
the replica with the fewest unfinished requests (it sees every output, so the counts are exact),
keeps aborts with the request's owner and merges all outputs into one queue. Each request runs
under an id of its own in its replica (``<id>#<n>``), so a late output of an aborted request can
never be taken for a later request that reuses the id. Replicas of a dense
model need no step synchronisation, so there are no vLLM-style "waves". One dead replica makes
the whole client dead: a frontend cannot silently lose a share of its requests.
"""

from __future__ import annotations

import itertools
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
        self.owner: dict[str, tuple[int, str]] = {}  # user id -> (replica, id in the replica)
        self.load = [0] * len(self.engines)
        self._seq = itertools.count()

    def add_request(self, request: EngineCoreRequest) -> None:
        rid = request.request_id
        if rid in self.owner:
            # Another replica would run it twice; the owning one would fail the original.
            raise ValueError(f"duplicate request_id {rid!r}")
        i = min(range(len(self.engines)), key=self.load.__getitem__)
        inner = f"{rid}#{next(self._seq)}"
        self.engines[i].add_request(msgspec.structs.replace(request, request_id=inner))
        self.owner[rid] = (i, inner)
        self.load[i] += 1

    def abort_requests(self, request_ids: list[str]) -> None:
        per_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            entry = self.owner.pop(rid, None)
            if entry is not None:
                i, inner = entry
                self.load[i] -= 1
                per_engine.setdefault(i, []).append(inner)
        # NOTE: every replica gets its aborts before any error is raised: one dead replica
        # stopped the loop, and the live ones ran the forgotten requests to max_tokens.
        errors = []
        for i, ids in per_engine.items():
            try:
                self.engines[i].abort_requests(ids)
            except EngineDeadError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        try:
            item = self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, EngineDeadError):
            self.outputs.put(item)
            raise item
        ids = item.request_ids
        ended = [ids[row] for row in item.finished] + [e.request_id for e in item.errors]
        item.request_ids = [self._user_id(inner) for inner in ids]
        for err in item.errors:
            err.request_id = self._user_id(err.request_id)
        for inner in ended:
            self._release(inner)
        return item

    def _current(self, inner: str) -> str | None:
        """The caller's id of a replica's, if that request is still the one under it."""
        rid = inner.rpartition("#")[0]
        entry = self.owner.get(rid)
        return rid if entry is not None and entry[1] == inner else None

    def _user_id(self, inner: str) -> str:
        """The caller's id for a replica's; a request no longer current (aborted, its id perhaps
        reused) keeps the replica's id, which no caller knows, so its late rows are ignored."""
        return self._current(inner) or inner

    def _release(self, inner: str) -> None:
        rid = self._current(inner)
        if rid is not None:
            self.load[self.owner.pop(rid)[0]] -= 1

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
