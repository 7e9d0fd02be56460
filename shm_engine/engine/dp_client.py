"""Data parallelism: N engine replicas on disjoint cores behind one client.

Each replica is a full EngineCoreProc with its own channel; the client sends each new request to
the replica with the fewest unfinished requests (it sees every output, so the counts are exact),
keeps aborts with the request's owner and merges all outputs into one stream. Each request runs
under an id of its own in its replica (``<id>#<n>``), so a late output of an aborted request can
never be taken for a later request that reuses the id. Replicas of a dense
model need no step synchronisation, so there are no vLLM-style "waves". One dead replica makes
the whole client dead: a frontend cannot silently lose a share of its requests.

``DPClient`` serves the blocking ``LLM``; ``AsyncDPClient`` the server's ``AsyncLLM``. Both route
through one ``ReplicaRouter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from shm_engine.engine.client import (
    AsyncMPClient,
    EngineDeadError,
    EngineLaunch,
    SyncMPClient,
    _typed,
)
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


def split_cores(n: int) -> list[list[int]]:
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise ValueError(f"{n} replicas need at least {n} cores; this process may use {len(cores)}")
    per = len(cores) // n
    return [cores[i * per : (i + 1) * per] for i in range(n)]


def replica_configs(config: EngineConfig, n: int) -> list[EngineConfig]:
    """One configuration a replica, each pinned to its own share of the cores."""
    return [
        msgspec.structs.replace(config, cpu_ids=cores, num_threads=len(cores))
        for cores in split_cores(n)
    ]


def start_replicas(configs: list[EngineConfig], start: Callable[[EngineConfig, int], Any]) -> list:
    """Start every replica at once (they load their models concurrently); all or none."""
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = [pool.submit(start, cfg, i) for i, cfg in enumerate(configs)]
        errors = [f.exception() for f in futures]
    engines = [f.result() for f in futures if f.exception() is None]
    if any(errors):
        for e in engines:
            e.shutdown()
        raise next(e for e in errors if e is not None)
    return engines


def merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' scheduler stats as one engine's (KV usage: the mean, the caches are equal)."""
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        step_count=sum(s.step_count for s in stats),
        spec_draft_tokens=sum(s.spec_draft_tokens for s in stats),
        spec_accepted_tokens=sum(s.spec_accepted_tokens for s in stats),
    )


def merge_results(method: str, results: list[Any]) -> Any:
    """The replicas' answers to a utility call as one engine's, so callers need not know how
    many replicas there are: stats merged, counts summed, flags all-true, None for actions;
    other methods (get_timing, profile, echo) give one result per replica."""
    if method == "get_stats":
        return merge_stats(results)
    if method == "reset_prefix_cache":
        return sum(results)
    if method == "is_sleeping":
        return all(results)
    if all(r is None for r in results):
        return None
    return results


class ReplicaRouter:
    """Which replica runs each request, under which id; the load each replica carries."""

    def __init__(self, num_replicas: int) -> None:
        self.owner: dict[str, tuple[int, str]] = {}  # user id -> (replica, id in the replica)
        self.load = [0] * num_replicas
        self._seq = itertools.count()

    def route(self, request: EngineCoreRequest) -> tuple[int, EngineCoreRequest]:
        """The least loaded replica and the request under its replica id."""
        rid = request.request_id
        if rid in self.owner:
            # Another replica would run it twice; the owning one would fail the original.
            raise ValueError(f"duplicate request_id {rid!r}")
        i = min(range(len(self.load)), key=self.load.__getitem__)
        inner = f"{rid}#{next(self._seq)}"
        self.owner[rid] = (i, inner)
        self.load[i] += 1
        return i, msgspec.structs.replace(request, request_id=inner)

    def split_aborts(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Forget the requests; their replica ids, by replica."""
        per_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            entry = self.owner.pop(rid, None)
            if entry is not None:
                i, inner = entry
                self.load[i] -= 1
                per_engine.setdefault(i, []).append(inner)
        return per_engine

    def translate(self, item: EngineCoreOutputs) -> EngineCoreOutputs:
        """A replica's outputs under the caller's ids; finished requests are released."""
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


class _Replicas:
    """What both clients do alike over their replicas: route, abort, report liveness, stop."""

    def __init__(self, engines: list[SyncMPClient]) -> None:
        self.engines = engines
        self.ready = engines[0].ready
        self.router = ReplicaRouter(len(engines))

    @property
    def is_dead(self) -> bool:
        return any(e.is_dead for e in self.engines)

    def add_request(self, request: EngineCoreRequest) -> None:
        i, request = self.router.route(request)
        self.engines[i].add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        # NOTE: every replica gets its aborts before any error is raised: one dead replica
        # stopped the loop, and the live ones ran the forgotten requests to max_tokens.
        errors = []
        for i, ids in self.router.split_aborts(request_ids).items():
            try:
                self.engines[i].abort_requests(ids)
            except EngineDeadError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _abort_survivors(self) -> None:
        """A replica died, and with it the client: the live replicas drop their share of the
        requests, which nobody will read (they had run on to max_tokens at full speed)."""
        for i, ids in self.router.split_aborts(list(self.router.owner)).items():
            if not self.engines[i].is_dead:
                with contextlib.suppress(EngineDeadError):
                    self.engines[i].abort_requests(ids)

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()


def _launch(launches: list[EngineLaunch] | None, index: int) -> EngineLaunch | None:
    """Replica ``index``'s engine process, if the caller started them ahead (launch_engines)."""
    return launches[index] if launches else None


class DPClient(_Replicas):
    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int,
        launches: list[EngineLaunch] | None = None,
    ) -> None:
        """``launches``: the replicas' engine processes, if the caller started them ahead."""
        self.outputs: queue.Queue = queue.Queue()
        super().__init__(
            start_replicas(
                replica_configs(config, data_parallel_size),
                lambda cfg, i: SyncMPClient(
                    cfg, engine_index=i, outputs=self.outputs, launch=_launch(launches, i)
                ),
            )
        )

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        try:
            item = self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, EngineDeadError):
            self._abort_survivors()
            self.outputs.put(item)
            raise item
        return self.router.translate(item)

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call on every replica; their results merged as one engine's (merge_results)."""
        futures = [e.call_utility_async(method, *args) for e in self.engines]
        return merge_results(method, [_typed(method, f.result(timeout=300)) for f in futures])

    def __enter__(self) -> DPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class AsyncDPClient(_Replicas):
    """DPClient for one asyncio loop: what AsyncLLM needs of an AsyncMPClient, over N replicas.

    A task a replica forwards its outputs to one queue, tagged with the replica, so each step's
    piggybacked scheduler stats update that replica's share of the merged stats.
    """

    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int,
        launches: list[EngineLaunch] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        # Blocks the loop while the replicas load: fine at startup, nothing is served yet.
        super().__init__(
            start_replicas(
                replica_configs(config, data_parallel_size),
                lambda cfg, i: AsyncMPClient(
                    cfg, engine_index=i, loop=loop, launch=_launch(launches, i)
                ),
            )
        )
        self.stats = [SchedulerStats() for _ in self.engines]
        self._merged: asyncio.Queue = asyncio.Queue()
        self._forwarders = [
            loop.create_task(self._forward(i, e), name=f"replica-{i}-outputs")
            for i, e in enumerate(self.engines)
        ]

    async def _forward(self, i: int, engine: AsyncMPClient) -> None:
        try:
            while True:
                self._merged.put_nowait((i, await engine.get_output_async()))
        except EngineDeadError as e:
            self._abort_survivors()
            self._merged.put_nowait((i, e))

    async def get_output_async(self) -> EngineCoreOutputs:
        i, item = await self._merged.get()
        if isinstance(item, EngineDeadError):
            self._merged.put_nowait((i, item))
            raise item
        if item.scheduler_stats is not None:
            self.stats[i] = item.scheduler_stats
            item.scheduler_stats = merge_stats(self.stats)
        return self.router.translate(item)

    async def call_utility_coro(self, method: str, *args: Any) -> Any:
        """Call on every replica; their results merged as one engine's (merge_results)."""
        results = await asyncio.gather(*(e.call_utility_coro(method, *args) for e in self.engines))
        if method == "get_stats":
            self.stats = list(results)
        return merge_results(method, list(results))
