"""EngineCoreProc: EngineCore in its own process, talking to its clients over shared-memory rings.

Threads:
- one input thread per client: ring -> decode -> validate -> input queue (aborts also go to an
  eager abort queue, applied right after the model runs so no extra token is produced);
- the main thread's busy loop: input queue -> EngineCore.step() -> the client's ring; it blocks
  on the input queue when there is no work, so an idle engine burns no CPU;
- outputs are encoded and written to the client's ring by whichever thread produced them (the
  busy loop, mostly): a hand-off to another thread would wait for the GIL behind the next step's
  Python work. Only when a ring is full does the message go to the output thread, which blocks
  on it, so a slow client never stalls the busy loop (or the other clients).

A fatal error sends EngineDead to every client before the process exits; SIGTERM/SIGINT shut down
gracefully (channels closed, so clients see the engine go away at once). The process has a group
of its own (EngineLaunch): a terminal's Ctrl-C is the frontend's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterator

import msgspec

from shm_engine.engine.config import EngineConfig
from shm_engine.engine.core import EngineCore
from shm_engine.engine.protocol import (
    ROW_COLUMNS,
    AbortRequests,
    ClientMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineHello,
    EngineStartup,
    RequestError,
    SchedulerStats,
    UtilityCall,
    UtilityOutput,
)
from shm_engine.ipc import (
    Channel,
    ChannelClosedError,
    IPCError,
    MalformedMessage,
    PeerDeadError,
    detach,
)

logger = logging.getLogger(__name__)


class _Abort:
    """An abort on its way to the busy loop, which takes it twice: from the eager queue (right
    after the model ran, so an aborted request gets no further token) and in order from the
    input queue.

    NOTE: whichever comes first aborts the requests it finds and removes them from ``ids``; the
    in-order copy aborts the rest and empties the set. So a late eager copy never hits a request
    that arrived after the abort (a reused id), and an abort that overtook its request's add is
    still applied in order.
    """

    __slots__ = ("client", "ids")

    def __init__(self, client: int, ids: list[str]) -> None:
        self.client = client
        self.ids = set(ids)


# Only these EngineCore methods may be called by name from a client, with the type their result
# is converted back to on the client (results cross the ring as plain msgpack).
UTILITY_METHODS: dict[str, type | None] = {
    "get_stats": SchedulerStats,
    "get_timing": None,
    "reset_prefix_cache": int,
    "sleep": None,
    "wake_up": None,
    "is_sleeping": bool,
    "profile": None,
    "execute_dummy_batch": None,
    "echo": None,
}

_SHUTDOWN = object()
_FLUSH = object()  # output-thread item: finish the message a direct send left half written


class EngineCoreProc:
    def __init__(
        self, addresses: list[str], engine_index: int = 0, handshake_timeout: float = 60.0
    ):
        # NOTE: the model runner's imports (torch, ~1.5 s) before the handshake: a frontend
        # that started this process ahead (EngineLaunch: LLM, serve) does its own imports and
        # reads meanwhile and accepts the connection once done.  No thread starts here, so the
        # CPU mask set below still reaches every thread the engine creates.
        import shm_engine.engine.model_runner  # noqa: F401
        from shm_engine.ipc import connect

        self.engine_index = engine_index
        self.channels = [
            connect(addr, timeout=handshake_timeout, recv_type=ClientMessage | EngineStartup)
            for addr in addresses
        ]
        for chan in self.channels:
            chan.send(EngineHello(pid=os.getpid(), engine_index=engine_index))
        startup = self.channels[0].recv(timeout=handshake_timeout)
        if not isinstance(startup, EngineStartup):
            raise RuntimeError(
                f"expected EngineStartup in the handshake, got {type(startup).__name__}"
            )
        self.config: EngineConfig = startup.config
        if self.config.cpu_ids:
            # NOTE: before the model loads, so every thread created later (kernel pool, torch,
            # IO threads) inherits the mask.
            os.sched_setaffinity(0, self.config.cpu_ids)
        try:
            with _stop_if_clients_leave(self.channels):
                self.core = EngineCore(self.config)
        except BaseException as e:
            # Tell the clients why, instead of leaving them to see only a dead peer.
            message = f"engine failed to start: {type(e).__name__}: {e}"
            for chan in self.channels:
                with contextlib.suppress(IPCError):  # a client that is gone
                    chan.send(EngineDead(message=message))
            raise
        self.core.before_update = self._apply_eager_aborts
        # NOTE: this process is the engine's alone, so its long-lived heap (model, tokenizer,
        # tables) can leave the collector's generations: the full collections that the per-step
        # lists and tuples trigger then no longer walk it on the hot path (~2% of a decode step).
        gc.collect()
        gc.freeze()
        ready = self.core.ready_info()
        for chan in self.channels:
            chan.send(ready)
        self.input_queue: queue.Queue = queue.Queue()
        self.abort_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        # Per client: messages handed to the output thread and not yet written. While non-zero
        # only the output thread writes that client's ring (single producer, order kept).
        self._backlog = [0] * len(self.channels)
        self._sent = 0  # items the output thread has finished with (shutdown watches progress)
        self._draining = False
        self._emit_lock = threading.Lock()
        self.request_client: dict[str, int] = {}
        self.closed_clients: set[int] = set()
        self._stop = threading.Event()
        self.input_threads = [
            threading.Thread(target=self._input_loop, args=(i,), name=f"input-{i}", daemon=True)
            for i in range(len(self.channels))
        ]
        self.output_thread = threading.Thread(target=self._output_loop, name="output", daemon=True)

    # ------------------------------------------------------------------ IO threads

    def _input_loop(self, client: int) -> None:
        chan = self.channels[client]
        while not self._stop.is_set():
            try:
                msgs = chan.recv_all(timeout=0.5)
            except TimeoutError:
                continue
            except (ChannelClosedError, PeerDeadError):
                logger.info("client %d went away; aborting its requests", client)
                self.input_queue.put((client, _SHUTDOWN))
                return
            except Exception as e:  # e.g. a corrupt ring: this client cannot be served any more
                logger.exception("client %d's channel failed; dropping the client", client)
                self._emit(client, EngineDead(message=f"engine dropped this client: {e}"))
                self.input_queue.put((client, _SHUTDOWN))
                return
            for msg in msgs:
                try:
                    self._accept(client, msg)
                except Exception as e:
                    # NOTE: a message fails, not this thread: its death would leave the
                    # client's later messages unread, with no EngineDead to say so.
                    logger.exception("client %d's message could not be accepted", client)
                    self._reject(client, msg, f"{type(e).__name__}: {e}")

    def _accept(self, client: int, msg) -> None:
        if isinstance(msg, MalformedMessage):
            # Report it and keep serving: the channel already kept the rest of the batch.
            logger.warning(
                "client %d sent a message that could not be decoded: %s", client, msg.error
            )
            rid = _request_id_of(msg.body)
            self._emit(client, _error_output(rid, f"bad message: {msg.error}"))
            return
        if isinstance(msg, EngineCoreRequest):
            try:
                msg = self.core.preprocess(msg)
            except (ValueError, TypeError) as e:
                self._emit(client, _error_output(msg.request_id, str(e)))
                return
            except Exception as e:  # a bug or a resource (the grammar thread could not start)
                # NOTE: the request fails, not this thread: its death would leave the client's
                # later requests and aborts unread.
                logger.exception("request %r could not be prepared", msg.request_id)
                self._emit(client, _error_output(msg.request_id, f"{type(e).__name__}: {e}"))
                return
        elif isinstance(msg, AbortRequests):
            msg = _Abort(client, msg.request_ids)
            self.abort_queue.put(msg)
        elif isinstance(msg, UtilityCall):
            # NOTE: the busy loop runs it after this thread's next receive, which hands the
            # ring space of arrays in its arguments back (a request's ids were copied above).
            try:
                msg.args = detach(msg.args)
            except RecursionError:
                self._reject(client, msg, "its arguments are nested too deeply")
                return
        self.input_queue.put((client, msg))

    def _reject(self, client: int, msg, why: str) -> None:
        """Tell the client that ``msg`` failed, in the reply it waits for."""
        if isinstance(msg, UtilityCall):
            failed = UtilityOutput(msg.call_id, failure_message=f"{msg.method}: {why}")
            self._emit(client, EngineCoreOutputs(utility_output=failed))
        elif isinstance(msg, EngineCoreRequest):
            self._emit(client, _error_output(msg.request_id, why))

    def _emit(self, client: int, out) -> None:
        """Send ``out`` to one client now if its ring has room, else queue it for the output thread.

        NOTE: the ring has a single producer. A thread writes it directly only under the lock
        and only while that client's backlog is empty; the output thread writes it only while the
        backlog is non-zero and lowers the count after each write, so frames stay in order.
        """
        with self._emit_lock:
            if not self._backlog[client]:
                chan = self.channels[client]
                try:
                    chan.send(out, timeout=0)
                    return
                except TimeoutError:
                    # Ring full. Either nothing went out (the whole message is queued) or the
                    # first fragments of a large one did (the channel keeps the rest pending and
                    # the output thread completes it).
                    out = _FLUSH if chan.has_pending_send() else out
                except Exception:
                    logger.warning("could not send to client %d", client, exc_info=True)
                    return
            self._backlog[client] += 1
            self.output_queue.put((client, out))  # under the lock: queue order = emit order

    def _output_loop(self) -> None:
        while True:
            item = self.output_queue.get()
            if item is _SHUTDOWN:
                return
            client, out = item
            chan = self.channels[client]
            try:
                if chan.closed:
                    pass  # shutdown gave up on this client: drop what is still queued for it
                elif out is _FLUSH:
                    chan.flush()
                else:
                    chan.send(out)
            except ChannelClosedError:
                pass  # closed by shutdown while this send waited for room, or by the client
            except Exception:
                logger.warning("could not send to client %d", client, exc_info=True)
            with self._emit_lock:
                self._backlog[client] -= 1
                self._sent += 1

    # ------------------------------------------------------------------ busy loop

    def run_busy_loop(self) -> None:
        for t in self.input_threads:
            t.start()
        self.output_thread.start()
        while not self._stop.is_set():
            self._process_input_queue()
            if self.core.batch_queue_size > 1:
                out = self.core.step_with_batch_queue()
            else:
                out = self.core.step()
            if out is not None and out.request_ids:
                self._route(out)

    def _process_input_queue(self) -> None:
        block = not self.core.has_work()
        while True:
            try:
                client, msg = self.input_queue.get(block=block, timeout=None)
            except queue.Empty:
                return
            block = False
            self._handle(client, msg)
            if self._stop.is_set():
                return

    def _handle(self, client: int, msg) -> None:
        from shm_engine.engine.request import Request

        if isinstance(msg, Request):
            try:
                self.core.add_request(msg)
                self.request_client[msg.request_id] = client
            except (ValueError, RuntimeError) as e:
                self._emit(client, _error_output(msg.request_id, str(e)))
        elif isinstance(msg, _Abort):
            self._abort(msg, in_order=True)
        elif isinstance(msg, UtilityCall):
            self._emit(client, EngineCoreOutputs(utility_output=self._call(msg)))
        elif msg is _SHUTDOWN:
            mine = [r for r, c in self.request_client.items() if c == client]
            self._abort(_Abort(client, mine), in_order=True)
            self.closed_clients.add(client)
            if len(self.closed_clients) == len(self.channels):
                self._stop.set()
        else:
            logger.error("unknown message type %s from client %d", type(msg).__name__, client)

    def _call(self, msg: UtilityCall) -> UtilityOutput:
        if msg.method not in UTILITY_METHODS:
            return UtilityOutput(
                msg.call_id, failure_message=f"unknown utility method {msg.method!r}"
            )
        try:
            return UtilityOutput(msg.call_id, result=getattr(self.core, msg.method)(*msg.args))
        except Exception as e:
            logger.exception("utility call %s failed", msg.method)
            return UtilityOutput(msg.call_id, failure_message=f"{msg.method} failed: {e}")

    def _abort(self, abort: _Abort, in_order: bool) -> None:
        """Abort the requests of ``abort.ids`` its client owns (see _Abort for the two copies)."""
        owner = self.request_client
        mine = [r for r in abort.ids if owner.get(r) == abort.client]
        for rid in self.core.abort_requests(mine):
            owner.pop(rid, None)
            abort.ids.discard(rid)
        if in_order:
            abort.ids.clear()

    def _apply_eager_aborts(self) -> None:
        while True:
            try:
                abort = self.abort_queue.get_nowait()
            except queue.Empty:
                return
            self._abort(abort, in_order=False)

    def _route(self, out: EngineCoreOutputs) -> None:
        """Send each client the rows of its own requests."""
        if self.config.log_stats:
            out.scheduler_stats = self.core.get_stats()
        if len(self.channels) == 1:
            self._emit(0, out)
        else:
            for client, part in _split_by_client(out, self.request_client).items():
                self._emit(client, part)
        # NOTE: only after the split, which needs the owners of the finishing requests too.
        for row in out.finished:
            self.request_client.pop(out.request_ids[row], None)

    # ------------------------------------------------------------------ lifecycle

    def send_engine_dead(self, message: str) -> None:
        for client in range(len(self.channels)):
            self._emit(client, EngineDead(message=message))
        self._drain_outputs()

    def _drain_outputs(self, stall: float = 0.5) -> None:
        """Let the output thread write what is queued for as long as the clients keep reading.

        NOTE: a client that stopped reading (stuck, or gone without hanging up its liveness
        socket) must not hold the exit: once nothing has gone out for ``stall`` seconds we stop
        waiting, and closing the channels then ends a send blocked on a full ring within one
        wait slice.
        """
        if self._draining or not self.output_thread.is_alive():
            return
        self._draining = True
        self.output_queue.put(_SHUTDOWN)
        sent = -1
        while self.output_thread.is_alive() and self._sent != sent:
            sent = self._sent
            self.output_thread.join(timeout=stall)

    def shutdown(self) -> None:
        self._stop.set()
        self._drain_outputs()
        for chan in self.channels:
            chan.close()
        self.output_thread.join(timeout=1.0)
        self.core.shutdown()


def _request_id_of(body: bytes | None) -> str:
    """The request id of an EngineCoreRequest that failed to decode, if it can still be read.

    Reported with the error, so the client fails that request instead of letting it wait.
    """
    try:
        raw = msgspec.msgpack.decode(body) if body else None
    except msgspec.DecodeError:
        return ""
    # array_like and tagged: [tag, request_id, ...]
    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "EngineCoreRequest":
        return raw[1] if isinstance(raw[1], str) else ""
    return ""


def _error_output(request_id: str, message: str) -> EngineCoreOutputs:
    return EngineCoreOutputs(errors=[RequestError(request_id, message)], timestamp=time.time())


@contextlib.contextmanager
def _stop_if_clients_leave(channels: list[Channel]) -> Iterator[None]:
    """While the model loads, SIGTERM this process once every client has hung up.

    NOTE: nothing reads the channels during the load (seconds), so a frontend killed then left
    its engine loading on until the ready message found it gone, both cores busy for nobody
    while a restarted frontend's new engine loaded beside it.
    """
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            if all(chan.peer_hung_up() for chan in channels):
                os.kill(os.getpid(), signal.SIGTERM)  # the main thread's handler ends the load
                return

    watcher = threading.Thread(target=watch, name="load-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _split_by_client(out: EngineCoreOutputs, owner: dict[str, int]) -> dict[int, EngineCoreOutputs]:
    parts: dict[int, EngineCoreOutputs] = {}
    k = 0
    for row, (rid, n) in enumerate(zip(out.request_ids, out.num_new_tokens, strict=True)):
        client = owner.get(rid, 0)
        part = parts.get(client)
        if part is None:
            part = parts[client] = EngineCoreOutputs(
                scheduler_stats=out.scheduler_stats, timestamp=out.timestamp
            )
        new_row = len(part.request_ids)
        part.request_ids.append(rid)
        part.num_new_tokens.append(n)
        part.new_token_ids.extend(out.new_token_ids[k : k + n])
        k += n
        for column in ROW_COLUMNS:
            src = getattr(out, column)
            if row in src:
                getattr(part, column)[new_row] = src[row]
    return parts


def run_engine_core(addresses: list[str], engine_index: int = 0) -> None:
    """Process entry point (spawned by the client)."""
    try:
        import setproctitle

        setproctitle.setproctitle(f"shm_engine::EngineCore_{engine_index}")
    except ImportError:
        pass
    logging.basicConfig(level=os.environ.get("SHM_ENGINE_LOG", "WARNING"))

    stopping = False

    def on_signal(signum, frame):
        # NOTE: only the first signal ends the busy loop; a later one (Ctrl-C twice, SIGTERM
        # after SIGINT, a signal as the client hangs up) must not cut short the shutdown, nor
        # the interpreter's exit after it (it had raised inside torch's atexit callbacks).
        nonlocal stopping
        if not stopping:
            stopping = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # NOTE: EngineLaunch starts this process in a process group of its own, out of the
    # terminal's Ctrl-C; with `stty tostop`, such a background group's log lines to the
    # terminal would stop it (SIGTTOU), unless ignored.
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    proc = None
    try:
        try:
            proc = EngineCoreProc(addresses, engine_index)
            proc.run_busy_loop()
        finally:
            stopping = True
            for sig in (signal.SIGTERM, signal.SIGINT):  # also through the interpreter's exit
                signal.signal(sig, signal.SIG_IGN)
    except SystemExit:
        logger.info("engine %d: shutting down on a signal", engine_index)
    except BaseException as e:
        if proc is None and isinstance(e, ValueError):
            # A configuration it cannot start with (its clients get the message): one line.
            logger.error("engine %d: cannot start: %s", engine_index, e)
        elif proc is None and isinstance(e, ConnectionError):
            # NOTE: a frontend that started this process ahead (EngineLaunch) and exited before
            # accepting it (a bad flag, Ctrl-C, a kill): nobody to tell, nothing to clean up.
            logger.info("engine %d: its client went away before the handshake", engine_index)
        else:
            logger.exception("engine %d: fatal error", engine_index)
        if proc is not None:
            proc.send_engine_dead(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}")
            proc.shutdown()
        raise SystemExit(1) from e
    if proc is not None:
        proc.shutdown()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="an engine process serving one or more clients")
    parser.add_argument(
        "addresses", nargs="+", help="client listener addresses; the first sends the config"
    )
    parser.add_argument("--engine-index", type=int, default=0)
    cli = parser.parse_args()
    run_engine_core(cli.addresses, cli.engine_index)
