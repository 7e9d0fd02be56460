"""EngineCoreClient: how a frontend drives an engine, in-process or in another process.

- ``InprocClient``: EngineCore in this process (embedding, tests); outputs come from ``step()``.
- ``SyncMPClient``: spawns EngineCoreProc and talks to it over a ring channel; a receiver thread
  routes utility results to their callers and queues step outputs.
- ``AsyncMPClient``: the same process and channel, with awaitable outputs for asyncio servers.

A dead engine (crash, SIGKILL, EngineDead message) raises EngineDeadError from every call within
a second: the channel's liveness link reports the peer's death, the receiver thread marks the
client dead and wakes every waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

import msgspec

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.protocol import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineHello,
    EngineMessage,
    EngineReady,
    EngineStartup,
    UtilityCall,
)

if TYPE_CHECKING:
    from shm_engine.ipc import ChannelListener

# What encoding a message raises (the ring's own errors are IPCError and TimeoutError): nothing
# was written, the engine is fine, and the caller learns what was wrong with the message.
_ENCODE_ERRORS = (TypeError, ValueError, OverflowError, NotImplementedError, msgspec.EncodeError)
logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process died or reported a fatal error; in-flight requests are lost."""


class UtilityError(RuntimeError):
    """A utility call failed inside the engine; the message is the engine's."""


class InprocClient:
    """EngineCore in this process, behind the client interface."""

    def __init__(self, config: EngineConfig, core=None) -> None:
        from shm_engine.engine.core import EngineCore

        self.core = core or EngineCore(config)
        self.ready = self.core.ready_info()
        self._errors: list[EngineCoreOutputs] = []
        self._shut_down = False
        # NOTE: EngineCore is single-threaded (scheduler, model scratch): an appliance's worker
        # threads sharing one LLM take turns here, as the process clients' locks make them do.
        # Unlocked, four threads got each other's tokens without any error.
        self._lock = threading.Lock()

    def _check(self) -> None:
        """As the process clients: after shutdown every call says the engine is gone (a step
        ran into the released KV cache and logged a model failure)."""
        if self._shut_down:
            raise EngineDeadError("engine shut down")

    def add_request(self, request: EngineCoreRequest) -> None:
        from shm_engine.engine.core_proc import _error_output

        with self._lock:
            self._check()
            try:
                self.core.add_request(request)
            except (ValueError, RuntimeError) as e:
                self._errors.append(_error_output(request.request_id, str(e)))

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            self._check()
            self.core.abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        with self._lock:
            self._check()
            if self._errors:
                return self._errors.pop(0)
            if self.core.batch_queue_size > 1:
                return self.core.step_with_batch_queue()
            return self.core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        from shm_engine.engine.core_proc import UTILITY_METHODS

        with self._lock:
            self._check()
            if method not in UTILITY_METHODS:
                raise UtilityError(f"unknown utility method {method!r}")
            return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        with self._lock:
            if not self._shut_down:
                self._shut_down = True
                self.core.shutdown()


class EngineLaunch:
    """An engine process started ahead of its client, which adopts it (``SyncMPClient(...,
    launch=)``): the engine's imports then overlap whatever the frontend does before it builds
    the client (``serve``: its web stack and the model's metadata, ~1.5 s). ``close()`` stops
    one that no client adopted; after an adoption it does nothing."""

    def __init__(self, engine_index: int = 0) -> None:
        from shm_engine.ipc import ChannelListener

        self.engine_index = engine_index
        self.adopted = False
        self.listener = ChannelListener()
        try:
            # NOTE: a fresh interpreter (not multiprocessing's spawn) so the user's __main__ is
            # never re-imported in the engine and scripts need no `if __name__ == "__main__"`
            # guard. Its own process group: a terminal's Ctrl-C (sent to the foreground group)
            # is the frontend's alone (chat stops a reply and goes on; the frontend stops the
            # engine when it exits), so SIGINT sent to the engine itself can mean "shut down".
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shm_engine.engine.core_proc",
                    self.listener.address,
                    f"--engine-index={engine_index}",
                ],
                stdin=subprocess.DEVNULL,
                process_group=0,
            )
        except BaseException:
            self.listener.close()
            raise

    def adopt(self) -> tuple[ChannelListener, subprocess.Popen]:
        if self.adopted:
            raise RuntimeError("this engine launch was adopted or closed already")
        self.adopted = True
        return self.listener, self.proc

    def close(self) -> None:
        if self.adopted:
            return
        self.adopted = True
        _stop_process(self.proc)
        self.listener.close()


def launch_engines(count: int) -> list[EngineLaunch]:
    """``count`` engine processes started ahead (replica indices 0..count-1); all or none, and
    none for more replicas than this process has cores (ValueError)."""
    from shm_engine.engine.dp_client import split_cores  # (dp_client imports this module)

    if count < 1:
        raise ValueError(f"engine count must be at least 1, got {count}")
    if count > 1:
        split_cores(count)
    launches: list[EngineLaunch] = []
    try:
        for i in range(count):
            launches.append(EngineLaunch(i))
    except BaseException:
        close_launches(launches)
        raise
    return launches


def close_launches(launches: list[EngineLaunch] | None) -> None:
    """Stop the launched engines no client adopted (adopted ones stop with their client)."""
    for launch in launches or ():
        launch.close()


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SyncMPClient:
    """Spawns an engine process and exchanges messages with it over a shared-memory channel."""

    def __init__(
        self,
        config: EngineConfig,
        startup_timeout: float = 300.0,
        engine_index: int = 0,
        outputs: queue.Queue | None = None,
        ring_capacity: int | None = None,
        launch: EngineLaunch | None = None,
    ) -> None:
        """``outputs``: a queue shared with other clients (data parallel merges replicas here).

        ``ring_capacity``: bytes of each direction's ring (a power of two; the IPC default if None).
        ``launch``: an engine process started ahead (its engine_index wins), else one is started.
        """
        from shm_engine.ipc.channel import DEFAULT_CAPACITY, check_capacity

        self._ring_capacity = DEFAULT_CAPACITY if ring_capacity is None else ring_capacity
        check_capacity(self._ring_capacity)  # before a process is spawned for nothing

        self.config = config
        self.engine_index = launch.engine_index if launch is not None else engine_index
        self._dead: str | None = None
        self._closing = False
        self._call_ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = outputs or queue.Queue()
        self.listener, self.proc = (launch or EngineLaunch(engine_index)).adopt()
        try:
            self.channel = self._accept(startup_timeout)
            hello = self.channel.recv(timeout=startup_timeout)
            if not isinstance(hello, EngineHello):
                raise EngineDeadError(f"bad handshake: {hello!r}")
            self.channel.send(EngineStartup(config=config))
            ready = self.channel.recv(timeout=startup_timeout)
            if isinstance(ready, EngineDead):
                raise EngineDeadError(ready.message)  # "engine failed to start: ..."
            if not isinstance(ready, EngineReady):
                raise EngineDeadError(f"bad handshake: {ready!r}")
        except BaseException as e:
            self._kill()
            self.listener.close()
            if isinstance(e, EngineDeadError) or not isinstance(e, Exception):
                raise  # Ctrl-C stays a KeyboardInterrupt: `except Exception` must not eat it
            raise EngineDeadError(f"engine failed to start: {type(e).__name__}: {e}") from e
        self.ready = ready
        self._receiver = threading.Thread(
            target=self._receive_loop, name="engine-outputs", daemon=True
        )
        self._receiver.start()

    def _accept(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.listener.accept(
                    timeout=0.5,
                    recv_type=EngineMessage | EngineHello | EngineReady,
                    capacity=self._ring_capacity,
                )
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise EngineDeadError(
                        f"engine process exited with code {self.proc.returncode} before connecting"
                    ) from None
                if time.monotonic() > deadline:
                    raise

    # ------------------------------------------------------------------ receiving

    def _receive_loop(self) -> None:
        from shm_engine.ipc import IPCError, MalformedMessage

        # NOTE: signals are for the main thread: one the kernel hands this thread (blocked in C)
        # does not interrupt a blocking call of the main thread, such as chat's input().
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            while True:
                for msg in self.channel.recv_all(timeout=None):
                    if isinstance(msg, MalformedMessage):
                        self._mark_dead(f"engine output could not be decoded: {msg.error}")
                        return
                    if isinstance(msg, EngineDead):
                        self._mark_dead(f"engine reported a fatal error: {msg.message}")
                        return
                    if msg.utility_output is not None:
                        self._resolve(msg)
                        if not msg.request_ids and not msg.errors:
                            continue
                    self._deliver(msg)
        except (IPCError, OSError) as e:
            self._mark_dead(
                "" if self._closing else f"engine process died ({type(e).__name__}: {e})"
            )
        except Exception as e:  # a decode error is a broken engine too
            logger.exception("engine output could not be decoded")
            self._mark_dead(f"engine output could not be decoded: {e}")

    def _resolve(self, msg: EngineCoreOutputs) -> None:
        from shm_engine.ipc import detach

        u = msg.utility_output
        with self._lock:
            fut = self._pending.pop(u.call_id, None)
        if fut is None:
            return
        if u.failure_message is not None:
            _settle(fut, exc=UtilityError(u.failure_message))
        else:
            _settle(fut, result=detach(u.result))  # arrays: the caller keeps them

    def _mark_dead(self, reason: str) -> None:
        self._dead = reason or "engine shut down"
        err = EngineDeadError(self._dead)
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            _settle(fut, exc=err)
        self._deliver(err)
        # A dead engine is reaped here, not at shutdown(): a server lives on after its engine
        # died (answering 503) and had kept a zombie until it stopped.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(2.0)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self.outputs.put(item)

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # ------------------------------------------------------------------ API

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(request_ids=list(request_ids)))

    def _send(self, msg) -> None:
        self._check()
        try:
            # NOTE: the ring has one producer: requests, aborts and utility calls may come from
            # several threads (an appliance's workers, a /metrics scrape).
            with self._send_lock:
                self.channel.send(msg, timeout=5.0)
        except _ENCODE_ERRORS:
            raise  # the message is at fault (a utility argument msgpack cannot carry), not the engine
        except Exception as e:
            self._check()
            raise EngineDeadError(f"could not reach the engine: {e}") from e

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """Next step's outputs; None on timeout; raises EngineDeadError once the engine is gone."""
        try:
            item = self.outputs.get(timeout=timeout)
        except queue.Empty:
            self._check()
            return None
        if isinstance(item, EngineDeadError):
            self.outputs.put(item)  # every later caller sees it too
            raise item
        return item

    def call_utility_async(self, method: str, *args: Any) -> Future:
        fut: Future = Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._pending[call_id] = fut
        try:
            self._send(UtilityCall(call_id=call_id, method=method, args=list(args)))
        except BaseException:
            with self._lock:
                self._pending.pop(call_id, None)
            raise
        return fut

    def call_utility(self, method: str, *args: Any, timeout: float | None = 300.0) -> Any:
        return _typed(method, self.call_utility_async(method, *args).result(timeout=timeout))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close the channel (the engine sees it and exits), then reap the process."""
        if self._closing:
            return
        self._closing = True
        self.channel.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self._kill()
        self._receiver.join(timeout=2.0)
        self.listener.close()

    def _kill(self) -> None:
        _stop_process(self.proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class AsyncMPClient(SyncMPClient):
    """SyncMPClient whose outputs and utility results are awaited from one asyncio loop.

    NOTE: the receiver thread hands items to the loop with call_soon_threadsafe; the loop is
    captured at construction, so build the client inside the loop that will consume it.
    """

    def __init__(
        self,
        config: EngineConfig,
        startup_timeout: float = 300.0,
        engine_index: int = 0,
        loop: asyncio.AbstractEventLoop | None = None,
        launch: EngineLaunch | None = None,
    ) -> None:
        """``loop``: the consuming loop, for a client built in another thread (replicas)."""
        self._loop = loop or asyncio.get_running_loop()
        self._aqueue: asyncio.Queue = asyncio.Queue()
        super().__init__(config, startup_timeout, engine_index=engine_index, launch=launch)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        try:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get_output_async(self) -> EngineCoreOutputs:
        item = await self._aqueue.get()
        if isinstance(item, EngineDeadError):
            self._aqueue.put_nowait(item)
            raise item
        return item

    async def call_utility_coro(self, method: str, *args: Any) -> Any:
        return _typed(method, await asyncio.wrap_future(self.call_utility_async(method, *args)))


def _settle(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete a utility call's future unless its caller gave up on it.

    NOTE: a caller that timed out cancels the future (``asyncio.wait_for`` on a wrapped one
    does); setting it then raises InvalidStateError, which in the receiver thread had passed
    for a broken engine and declared a healthy one dead.
    """
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def _typed(method: str, result: Any) -> Any:
    from shm_engine.engine.core_proc import UTILITY_METHODS

    kind = UTILITY_METHODS.get(method)
    return result if kind is None or result is None else msgspec.convert(result, kind)
