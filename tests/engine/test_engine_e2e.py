"""End to end: the real default model behind real engine processes and shared-memory rings.

Slow (model load per engine process), so engines are shared per module where the test allows.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from native_kernels.test_kernels_gemm import blocked_signals

from shm_engine.engine.client import EngineDeadError, SyncMPClient, UtilityError
from shm_engine.engine.config import EngineConfig
from shm_engine.engine.protocol import EngineCoreRequest
from shm_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

DTYPE = os.environ.get("SHM_ENGINE_TEST_DTYPE", "int8")


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def config(**kw) -> EngineConfig:
    base = dict(dtype=DTYPE, num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=512)
    base.update(kw)
    return EngineConfig(**base)


def request(rid: str, tokens, max_tokens=8, **sp) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=np.asarray(tokens, dtype=np.int32),
        sampling_params=SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **sp}),
        arrival_time=time.time(),
    )


def collect(client, rids, timeout=120.0, abort_after: dict[str, int] | None = None):
    """Drive the client until every rid finished; returns {rid: (tokens, finish_reason, error)}."""
    tokens = {r: [] for r in rids}
    done: dict[str, tuple] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(rids):
        assert time.monotonic() < deadline, f"timed out; finished {sorted(done)}"
        out = client.get_output(timeout=1.0)
        if out is None:
            continue
        for err in out.errors:
            if err.request_id in rids and err.request_id not in done:
                done[err.request_id] = ([], "error", err.message)
        k = 0
        for row, (rid, n) in enumerate(zip(out.request_ids, out.num_new_tokens, strict=True)):
            k += n
            if rid not in tokens or rid in done:
                continue  # a late token of an aborted request, or another test's leftovers
            tokens[rid].extend(out.new_token_ids[k - n : k])
            if row in out.finished:
                done[rid] = (tokens[rid], out.finished[row], None)
            elif abort_after and len(tokens[rid]) >= abort_after.get(rid, 1 << 30):
                client.abort_requests([rid])
                done[rid] = (tokens[rid], "abort", None)
    return done


@pytest.fixture(scope="module")
def client():
    before = shm_entries()
    c = SyncMPClient(config())
    yield c
    c.shutdown()
    assert shm_entries() <= before


@pytest.fixture(scope="module")
def tokenizer():
    from shm_engine.model.loader import load_model

    return load_model(None).tokenizer


def test_handshake_reports_the_cache(client):
    assert client.ready.num_kv_blocks == 512
    assert client.ready.vocab_size == 49152
    assert client.ready.eos_token_ids
    # what the engine packed, for the server's start-up log ("auto": SmolLM2's Q4_1 layers stay
    # 4-bit on every kernel path but amx, their o, gate_up and down on 8-bit activations)
    if DTYPE == "int8":
        from shm_engine.model import kernels

        int4 = 0 if kernels.get_path() == "amx" else 120
        act8 = int4 * 3 // 4
        assert f"{int4} of 120 layer matrices int4, {act8} on 8-bit" in client.ready.weights


def test_64_concurrent_streams_all_finish(client, tokenizer):
    prompts = [tokenizer.encode(f"Question {i}: what is {i} plus {i}?") for i in range(64)]
    for i, p in enumerate(prompts):
        client.add_request(request(f"c{i}", p, max_tokens=12, ignore_eos=True))
    done = collect(client, [f"c{i}" for i in range(64)])
    assert all(len(t) == 12 and r == "length" for t, r, _ in done.values())
    stats = client.call_utility("get_stats")
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_batched_output_equals_single_request_output(client, tokenizer):
    p = tokenizer.encode("The capital of France is")
    client.add_request(request("solo", p, max_tokens=10))
    solo = collect(client, ["solo"])["solo"][0]
    for i in range(8):
        client.add_request(request(f"b{i}", tokenizer.encode(f"Noise prompt {i} " * (i + 1)), 10))
    client.add_request(request("batched", p, max_tokens=10))
    done = collect(client, [f"b{i}" for i in range(8)] + ["batched"])
    assert done["batched"][0] == solo
    assert "Paris" in tokenizer.decode(solo)


def test_abort_mid_stream_frees_blocks(client, tokenizer):
    p = tokenizer.encode("Write a long story about a dragon.")
    rids = [f"a{i}" for i in range(6)]
    for rid in rids:
        client.add_request(request(rid, p, max_tokens=200, ignore_eos=True))
    done = collect(client, rids, abort_after={rid: 3 for rid in rids})
    assert all(r == "abort" for _, r, _ in done.values())
    deadline = time.monotonic() + 5
    while client.call_utility("get_stats").kv_cache_usage > 0:
        assert time.monotonic() < deadline, "aborted requests kept their blocks"
        client.get_output(timeout=0.05)  # drain late outputs
        time.sleep(0.05)


def test_prefix_cache_hit_is_reported(client, tokenizer):
    system = tokenizer.encode("You are a helpful assistant. " * 8)
    client.add_request(request("p1", system + tokenizer.encode("Hi"), max_tokens=2))
    collect(client, ["p1"])
    client.add_request(request("p2", system + tokenizer.encode("Hello there"), max_tokens=2))
    cached = None
    deadline = time.monotonic() + 60
    while cached is None and time.monotonic() < deadline:
        out = client.get_output(timeout=1.0)
        if out and "p2" in out.request_ids:
            cached = out.num_cached_tokens.get(out.request_ids.index("p2"))
    collect_rest = client.call_utility("get_stats")
    assert cached is not None and cached >= 16 * (len(system) // 16) - 16
    assert collect_rest.prefix_cache_hits > 0


def test_bad_requests_get_errors_and_others_continue(client, tokenizer):
    p = tokenizer.encode("Hello")
    client.add_request(request("huge", [1] * 9000, max_tokens=4))  # longer than the context
    client.add_request(request("oov", [10**6], max_tokens=4))
    client.add_request(request("empty", [], max_tokens=4))
    client.add_request(request("good", p, max_tokens=4))
    done = collect(client, ["good", "huge", "oov", "empty"])
    assert done["good"][1] in ("stop", "length")
    assert "context length" in done["huge"][2]
    assert "token ids" in done["oov"][2]
    assert "empty" in done["empty"][2]
    # A duplicate id while the first is running is rejected; the first still runs to the end.
    client.add_request(request("dup", p, max_tokens=16, ignore_eos=True))
    client.add_request(request("dup", p, max_tokens=4))
    errors, tokens, finish = [], [], None
    deadline = time.monotonic() + 60
    while finish is None and time.monotonic() < deadline:
        out = client.get_output(timeout=1.0)
        if out is None:
            continue
        errors += [e.message for e in out.errors if e.request_id == "dup"]
        if "dup" in out.request_ids:
            row = out.request_ids.index("dup")
            tokens.append(out.new_token_ids[row])
            finish = out.finished.get(row)
    assert any("duplicate" in m for m in errors)
    assert finish == "length" and len(tokens) == 16


def test_an_abort_never_hits_a_later_request_with_the_same_id(client, tokenizer):
    prompt = tokenizer.encode("Count: one, two, three,")
    client.add_request(request("x", prompt, max_tokens=3))
    assert collect(client, ["x"])["x"][1] == "length"
    client.abort_requests(["x"])  # late (x finished): must not outlive this moment
    time.sleep(0.3)
    client.add_request(request("x", prompt, max_tokens=3))
    client.abort_requests(["z"])  # an abort that arrives before its request
    client.add_request(request("z", prompt, max_tokens=3))
    done = collect(client, ["x", "z"], timeout=60)
    assert done["x"][1] == "length" and done["z"][1] == "length"


def test_sampling_values_beyond_float32_and_int64_do_not_kill_the_engine(client, tokenizer):
    prompt = tokenizer.encode("Hello")
    client.add_request(request("tiny_p", prompt, max_tokens=3, top_p=1e-50, temperature=0.8))
    client.add_request(request("huge_k", prompt, max_tokens=3, top_k=2**64 - 1, temperature=0.8))
    client.add_request(request("greedy", prompt, max_tokens=3))
    done = collect(client, ["tiny_p", "huge_k", "greedy"], timeout=60)
    assert all(d[1] == "length" for d in done.values()), done
    assert done["tiny_p"][0] == done["greedy"][0]  # top_p that small keeps only the top token


def test_utility_calls(client):
    assert client.call_utility("echo", {"a": [1, 2]}) == {"a": [1, 2]}
    assert client.call_utility("is_sleeping") is False
    with pytest.raises(UtilityError, match="unknown utility"):
        client.call_utility("__init__")
    with pytest.raises(UtilityError, match="profiler is not running"):
        client.call_utility("profile", False)
    client.call_utility("execute_dummy_batch")
    assert client.call_utility("reset_prefix_cache") >= 0
    # An argument msgpack cannot carry is the caller's mistake, not a dead engine (it raised
    # EngineDeadError and left its future pending forever).
    pending = len(client._pending)
    with pytest.raises(NotImplementedError, match="cannot encode"):
        client.call_utility("echo", object())
    assert len(client._pending) == pending and not client.is_dead
    # Arguments msgpack carries but the engine's input thread cannot take apart: that call
    # fails, the thread goes on (its death had left every later call unanswered).
    deep: object = 7
    for _ in range(700):
        deep = [deep]
    with pytest.raises(UtilityError, match="nested too deeply"):
        client.call_utility("echo", deep)
    assert client.call_utility("echo", 7) == 7 and not client.is_dead
    # Array arguments and results outlive the receive that brought them (16 MB through a 4 MiB
    # ring: later calls reuse the ring space of earlier ones).
    arrays = [np.full(100_000, i, dtype=np.int32) for i in range(40)]
    futures = [client.call_utility_async("echo", a) for a in arrays]
    assert [int(np.asarray(f.result(timeout=60)).sum()) for f in futures] == [
        100_000 * i for i in range(40)
    ]


def test_a_utility_call_given_up_on_does_not_kill_the_client(client, tokenizer):
    # A caller that times out cancels the call's future (AsyncLLM.get_stats does, for
    # /metrics); the late reply must not pass for a broken engine.
    os.kill(client.proc.pid, signal.SIGSTOP)  # a long step: the reply comes late
    try:
        fut = client.call_utility_async("get_stats")
        assert fut.cancel()
    finally:
        os.kill(client.proc.pid, signal.SIGCONT)
    assert client.call_utility("echo", 7) == 7  # after the late reply
    client.add_request(request("after-cancel", tokenizer.encode("Hello"), max_tokens=4))
    assert collect(client, ["after-cancel"], timeout=60)["after-cancel"][1] == "length"
    assert not client.is_dead


def test_calls_from_several_threads_share_the_one_producer_ring(client):
    results: dict[int, list] = {}

    def worker(t: int) -> None:
        # 40 KB arrays: the copy into the ring runs in C without the GIL, so sends overlap.
        futures = [
            client.call_utility_async("echo", np.full(10_000, 1000 * t + i)) for i in range(100)
        ]
        results[t] = [int(np.asarray(f.result(timeout=60))[-1]) for f in futures]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert results == {t: [1000 * t + i for i in range(100)] for t in range(4)}
    assert not client.is_dead


def test_an_output_larger_than_the_ring_keeps_the_stream_in_order(client, tokenizer):
    # A 10 MB echo does not fit the 4 MiB ring: the busy loop's direct send leaves it half
    # written and the output thread finishes it, while later step outputs queue behind it.
    big = os.urandom(10 << 20)
    prompt = tokenizer.encode("Once upon a time")
    rids = [f"big-{i}" for i in range(4)]
    for rid in rids:
        client.add_request(request(rid, prompt, 24, ignore_eos=True))
    fut = client.call_utility_async("echo", big)
    done = collect(client, rids)
    assert fut.result(timeout=60) == big
    assert all(len(done[r][0]) == 24 and done[r][1] == "length" for r in rids)
    assert len({tuple(done[r][0]) for r in rids}) == 1  # same prompt, greedy: same tokens


def test_sleep_releases_and_wake_up_restores_the_cache(client, tokenizer):
    import psutil

    pid = client.proc.pid
    # A real step first: the model's per-cache state must not keep the memory alive.
    client.add_request(request("before-sleep", tokenizer.encode("Hello"), 4))
    collect(client, ["before-sleep"])
    rss_awake = psutil.Process(pid).memory_info().rss
    with pytest.raises(UtilityError, match="sleep level must be 1 or 2"):
        client.call_utility("sleep", "x")  # vLLM's levels; anything else had been taken
    assert client.call_utility("is_sleeping") is False
    client.call_utility("sleep")
    assert client.call_utility("is_sleeping") is True
    rss_asleep = psutil.Process(pid).memory_info().rss
    client.call_utility("wake_up")
    assert client.call_utility("is_sleeping") is False
    client.add_request(request("woke", tokenizer.encode("The capital of France is"), 4))
    assert collect(client, ["woke"])["woke"][1] in ("stop", "length")
    # 512 blocks of fp32 KV for 30 layers is 360 MiB: sleeping must give it back to the OS.
    assert rss_awake - rss_asleep > 40 * 2**20


@pytest.mark.parametrize("kv", ["auto", "int8"] if DTYPE == "int8" else ["auto"])
def test_preemption_keeps_greedy_output(kv, tokenizer):
    prompts = [tokenizer.encode(f"List the numbers from {i} to {i + 40}:") for i in range(4)]
    outs = {}
    for blocks in (512, 8):  # 8 blocks of 16 tokens cannot hold 4 sequences of ~52 tokens
        with SyncMPClient(config(num_kv_blocks=blocks, kv_cache_dtype=kv)) as c:
            for i, p in enumerate(prompts):
                c.add_request(request(f"r{i}", p, max_tokens=40, ignore_eos=True))
            outs[blocks] = collect(c, [f"r{i}" for i in range(4)], timeout=300)
            if blocks == 8:
                assert c.call_utility("get_stats").num_preemptions > 0
    for i in range(4):
        assert outs[8][f"r{i}"][0] == outs[512][f"r{i}"][0]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_engine_death_is_reported_within_a_second(sig, tokenizer):
    before = shm_entries()
    c = SyncMPClient(config(num_kv_blocks=64))
    try:
        c.add_request(request("x", tokenizer.encode("Tell me a long story"), 500, ignore_eos=True))
        assert c.get_output(timeout=60) is not None
        errors = []

        def waiter():
            try:
                while True:
                    c.get_output(timeout=5.0)
            except EngineDeadError as e:
                errors.append((time.monotonic(), e))

        t = threading.Thread(target=waiter)
        t.start()
        killed_at = time.monotonic()
        os.kill(c.proc.pid, sig)
        t.join(timeout=5)
        assert errors, "no EngineDeadError"
        assert errors[0][0] - killed_at < 1.0
        with pytest.raises(EngineDeadError):
            c.add_request(request("y", [1, 2, 3]))
        with pytest.raises(EngineDeadError):
            c.call_utility("get_stats")
        # reaped by the client without a shutdown() (a server outlives its engine)
        deadline = time.monotonic() + 5
        while c.proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.proc.returncode is not None
        with pytest.raises(ChildProcessError):
            os.waitpid(c.proc.pid, os.WNOHANG)  # no zombie left to reap
    finally:
        c.shutdown()
    assert c.proc.poll() is not None
    assert shm_entries() <= before


def test_a_terminal_ctrl_c_is_the_frontends_and_a_signal_in_shutdown_is_ignored(capfd):
    """A terminal's Ctrl-C reaches the foreground process group, which the engine is not in (its
    own group: chat stops a reply and goes on, and had lost its engine to the same keypress);
    SIGINT sent to the engine itself shuts it down (the test above). A signal that arrives while
    the engine shuts down is ignored (it had raised inside torch's atexit callbacks). In the
    frontend, signals are left to the main thread."""
    for delay in (None, 0.0, 0.003, 0.02):
        client = SyncMPClient(EngineConfig(dtype=DTYPE, num_kv_blocks=64))
        pid = client.proc.pid
        assert os.getpgid(pid) == pid != os.getpgrp()  # out of the terminal's Ctrl-C
        blocked = blocked_signals(client._receiver.native_id)
        assert blocked >> (signal.SIGINT - 1) & 1 and blocked >> (signal.SIGTERM - 1) & 1
        if delay is None:
            client.add_request(request("r", [1, 2, 3], max_tokens=2))
            assert collect(client, {"r"})["r"] and client.proc.poll() is None
        timer = threading.Timer(delay or 0.0, os.kill, (pid, signal.SIGINT))
        timer.start()
        client.shutdown()
        timer.join()
        assert client.proc.returncode == 0
    assert "Traceback" not in capfd.readouterr().err


def test_sigterm_exits_promptly_when_the_client_stopped_reading():
    """A full output ring must not hold the engine's exit: it flushes only while the client reads."""
    import queue

    before = shm_entries()
    stuck: queue.Queue = queue.Queue(maxsize=1)  # the receiver blocks on its second output
    c = SyncMPClient(
        config(num_kv_blocks=256, max_num_seqs=32), outputs=stuck, ring_capacity=1 << 16
    )
    try:
        for i in range(32):
            c.add_request(request(f"r{i}", [1, 2, 3 + i], 400, ignore_eos=True, logprobs=20))
        time.sleep(4)  # ~12 KB of outputs a step fill the 64 KiB ring in well under a second
        os.kill(c.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        assert c.proc.wait(10) == 0
        assert time.monotonic() - t0 < 2.0  # was 5.2 s: a 5 s join of the blocked output thread
    finally:
        while not stuck.empty():
            stuck.get_nowait()
        c.shutdown()
    assert shm_entries() <= before


def test_a_bad_ring_capacity_is_refused_before_an_engine_is_spawned():
    before = shm_entries()
    with pytest.raises(ValueError, match="power of two"):
        SyncMPClient(config(), ring_capacity=100_000)
    assert shm_entries() <= before


def test_a_corrupt_request_ring_fails_its_client_at_once():
    # The engine's input thread must not die silently: the client hears EngineDead and the
    # engine, left without clients, exits.
    before = shm_entries()
    c = SyncMPClient(config(num_kv_blocks=64))
    try:
        c.channel._mm[0:8] = b"garbage!"  # the client -> engine ring's magic
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="dropped this client"):
            while time.monotonic() - t0 < 10:
                c.get_output(timeout=0.5)
        assert time.monotonic() - t0 < 2.0
        assert c.proc.wait(timeout=30) == 0
    finally:
        c.shutdown()
    assert shm_entries() <= before


def test_async_llm_refuses_an_id_whose_handle_is_still_open():
    # The old handle's close would otherwise take the new request's stream with it (a hang).
    import asyncio

    from shm_engine.entrypoints.async_engine import AsyncLLM

    params = SamplingParams(temperature=0.0, max_tokens=3)

    async def run() -> None:
        engine = await AsyncLLM.create(config(num_kv_blocks=64))
        try:
            old = engine.add_request(None, [1, 2, 3], params, "a")
            await asyncio.sleep(0.5)  # finished by now, but nobody closed its handle
            with pytest.raises(ValueError, match="still open"):
                engine.add_request(None, [1, 2, 3], params, "a")
            assert [o.finished async for o in old.outputs()][-1]  # and closes it
            new = engine.add_request(None, [1, 2, 3], params, "a")
            outs = [o async for o in new.outputs()]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        finally:
            await engine.shutdown()

    before = shm_entries()
    asyncio.run(asyncio.wait_for(run(), 120))
    assert shm_entries() <= before


def test_llm_generate_matches_in_process_engine():
    from shm_engine import LLM

    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with LLM(dtype=DTYPE, num_kv_blocks=256) as llm:
        mp = llm.generate(prompts, params, use_tqdm=False)
        chat = llm.chat([{"role": "user", "content": "Say hello."}], params, use_tqdm=False)
    inproc = LLM(dtype=DTYPE, num_kv_blocks=256, in_process=True)
    ip = inproc.generate(prompts, params, use_tqdm=False)
    for a, b in zip(mp, ip, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.prompt_token_ids == b.prompt_token_ids
    assert "Paris" in mp[0].outputs[0].text
    assert chat[0].outputs[0].text and chat[0].finished
    stopped = inproc.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=30, stop=["8"]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "8"
    assert "8" not in stopped.text
    inproc.shutdown()
    # Overlapped scheduling (batch queue) must not change what is generated.
    overlapped = LLM(dtype=DTYPE, num_kv_blocks=256, in_process=True, batch_queue_size=2)
    bq = overlapped.generate(prompts, params, use_tqdm=False)
    overlapped.shutdown()
    for a, b in zip(bq, ip, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_an_in_process_llm_serves_several_threads():
    # The engine runs in the caller's process: threads take turns in it (unlocked, their steps
    # interleaved inside the scheduler and the model's scratch and gave garbage, no error).
    from shm_engine import LLM

    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "My colour is"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(dtype=DTYPE, num_kv_blocks=128, in_process=True) as llm:
        alone = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        got: dict[int, str] = {}

        def worker(i: int) -> None:
            for _ in range(3):
                got[i] = llm.generate(prompts[i], params, use_tqdm=False)[0].outputs[0].text
                assert got[i] == alone[i]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
    assert [got.get(i) for i in range(4)] == alone


@pytest.mark.skipif(DTYPE != "int8", reason="the int8 cache is the int8 path's")
def test_llm_stream_never_yields_text_a_stop_string_takes_back():
    from shm_engine import LLM

    prompt = "The capital of France is"
    with LLM(dtype=DTYPE, num_kv_blocks=128) as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), False)
        words = free[0].outputs[0].text.split()
        assert len(words) >= 4
        stop = f"{words[2]} {words[3]}"  # completed a few tokens after it starts
        params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
        whole = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        pieces = list(llm.stream(prompt, params))
    assert "".join(pieces) == whole and stop not in whole


def test_an_llm_dropped_without_shutdown_stops_its_engine():
    """An appliance that forgets shutdown() must not keep an engine process per LLM it made."""
    import gc

    from shm_engine import LLM

    llm = LLM(dtype=DTYPE, num_kv_blocks=64)
    proc, client = llm.client.proc, llm.client
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs
    del llm
    gc.collect()
    assert proc.wait(timeout=10) == 0  # shut down, not killed
    assert client.is_dead and not client._receiver.is_alive()


def test_llm_stream_paused_while_generate_runs_still_ends():
    # generate() pumps the engine for everyone: the paused stream's outputs, its last one
    # included, wait for it instead of being dropped (the stream used to block forever).
    from shm_engine import LLM

    llm = LLM(dtype=DTYPE, num_kv_blocks=128, in_process=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        whole = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].text
        stream = llm.stream("Hello", params)
        first = next(stream)
        llm.generate(["1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
        assert first + "".join(stream) == whole
        # A prompt that fails to register withdraws the ones sent before it.
        bad = SamplingParams()
        bad.temperature = -1.0  # assigned after construction: caught as it is added
        with pytest.raises(ValueError, match="temperature"):
            llm.generate(["a", "b"], [params, bad], use_tqdm=False)
        assert not llm.processor.has_unfinished() and not llm._latest
        # As vLLM's: a prompt that cannot fit raises before anything is sent.
        too_long = {"prompt_token_ids": [5] * llm.client.ready.max_model_len}
        out_of_vocab = {"prompt_token_ids": [1, llm.client.ready.vocab_size]}
        for prompt, match in (
            (too_long, "context length"),
            ({"prompt_token_ids": []}, "empty"),
            (out_of_vocab, "out of the vocabulary"),
        ):
            with pytest.raises(ValueError, match=match):
                llm.generate(["a", prompt], params, use_tqdm=False)
            assert not llm.processor.has_unfinished()
        assert llm.get_stats().num_running + llm.get_stats().num_waiting == 0
        # Ctrl-C as generate() processes a step: raised once the step is stored, so the paused
        # stream loses nothing (that step had been lost for every request; a lost finish had
        # left the stream waiting forever).
        stream = llm.stream("Hello", params)
        first = next(stream)
        real = llm.processor.process

        def pressed_ctrl_c(out):
            os.kill(os.getpid(), signal.SIGINT)
            return real(out)

        llm.processor.process = pressed_ctrl_c
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(["1, 2, 3,"], SamplingParams(max_tokens=20), use_tqdm=False)
        finally:
            llm.processor.process = real
        assert first + "".join(stream) == whole
    finally:
        llm.shutdown()


def test_int8_kv_cache_holds_more_tokens_and_serves():
    from shm_engine import LLM

    budget = 16 << 20
    params = SamplingParams(temperature=0.0, max_tokens=12)
    blocks = {}
    for kv in ("fp16", "int8"):
        llm = LLM(dtype=DTYPE, kv_cache_bytes=budget, kv_cache_dtype=kv, in_process=True)
        blocks[kv] = llm.client.ready.num_kv_blocks
        out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
        llm.shutdown()
        assert "Paris" in out.text, (kv, out.text)
    # int8 rows (64 bytes) plus a scale row per 16 positions, against 128-byte fp16 rows
    assert blocks["int8"] / blocks["fp16"] == pytest.approx(128 / 68, rel=0.02)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="fp32 KV cache"):
        EngineConfig(dtype="float32", kv_cache_dtype="int8")


def test_int8_activations_serve():
    """activation_dtype="int8": on path vnni the engine smooths the weights (a calibration
    forward at load) and marks the layers for 8-bit activations; on avx2 and portable it marks
    the 4-bit layers (SmolLM2's Q4_1 ones, unsmoothed: W4 x A8); the answer stays right, and a
    request's tokens do not depend on what else shares its steps (every row count takes the
    same kernel)."""
    from shm_engine import LLM
    from shm_engine.model import kernels

    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is"] + [f"Count from {i} to {i + 5}:" for i in range(5)]
    with LLM(dtype=DTYPE, activation_dtype="int8", in_process=True) as llm:
        model = llm.client.core.runner.model
        path = kernels.get_path()
        assert model.smoothed == (path == "vnni")
        assert model.layers[0].gate_up.act8 == (path != "amx")
        assert model.layers[0].gate_up.w4 == (path in ("avx2", "portable"))
        together = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert "Paris" in together[0].outputs[0].text, together[0].outputs[0].text
    for a, b in zip(together, alone, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="activation_dtype"):
        EngineConfig(activation_dtype="fp8")
    with pytest.raises(ValueError, match="int8 model only"):
        EngineConfig(dtype="float32", activation_dtype="int8")
    EngineConfig(dtype="float32")  # the default "auto" is no request of 8 bits


def test_data_parallel_replicas_share_the_work():
    import psutil

    from shm_engine import LLM

    prompts = [f"Count from {i} to {i + 5}:" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = shm_entries()
    with LLM(dtype=DTYPE, num_kv_blocks=128, data_parallel_size=2) as llm:
        dp = llm.generate(prompts, params, use_tqdm=False)
        stats = [e.call_utility("get_stats") for e in llm.client.engines]
        merged = llm.get_stats()  # one engine's stats, as without replicas
        affinities = [psutil.Process(e.proc.pid).cpu_affinity() for e in llm.client.engines]
        assert [e.engine_index for e in llm.client.engines] == [0, 1]
        # An id reused after an abort: the first request's late output is neither taken for
        # the second's nor releases it, so aborting the second still reaches its replica.
        c = llm.client
        c.add_request(request("X", [1, 2, 3], max_tokens=1))
        time.sleep(0.5)  # finished in its replica; the output is not read yet
        c.abort_requests(["X"])
        c.add_request(request("X", [1, 2, 3], max_tokens=200, ignore_eos=True))
        first = c.get_output(timeout=5)
        assert first is not None and "X" not in first.request_ids
        c.abort_requests(["X"])
        late = 0
        for _ in range(10):
            out = c.get_output(timeout=0.2)
            late += out.request_ids.count("X") if out else 0
        assert late <= 2 and c.router.load == [0, 0]
    assert len(stats) == 2 and all(s.step_count > 0 for s in stats)
    assert merged.step_count == sum(s.step_count for s in stats)
    assert affinities[0] and affinities[1] and not set(affinities[0]) & set(affinities[1])
    single = LLM(dtype=DTYPE, num_kv_blocks=128, in_process=True)
    ref = single.generate(prompts, params, use_tqdm=False)
    single.shutdown()
    for a, b in zip(dp, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert shm_entries() <= before


def test_one_engine_serves_two_clients_on_their_own_rings(tokenizer):
    """Two frontends (e.g. API-server processes), each with its own channel to one engine."""
    import subprocess
    import sys

    from shm_engine.engine.protocol import EngineHello, EngineMessage, EngineReady, EngineStartup
    from shm_engine.ipc import ChannelListener

    before = shm_entries()
    listeners = [ChannelListener(), ChannelListener()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shm_engine.engine.core_proc", *(x.address for x in listeners)]
    )
    recv_type = EngineMessage | EngineHello | EngineReady
    try:
        chans = [x.accept(timeout=60, recv_type=recv_type) for x in listeners]
        assert all(isinstance(c.recv(timeout=60), EngineHello) for c in chans)
        chans[0].send(EngineStartup(config=config(num_kv_blocks=64)))
        assert all(isinstance(c.recv(timeout=120), EngineReady) for c in chans)
        prompt = tokenizer.encode("The capital of France is")
        for i, c in enumerate(chans):
            for j in range(3):
                c.send(request(f"client{i}-{j}", prompt, max_tokens=5))
        for i, c in enumerate(chans):
            seen: dict[str, int] = {}
            while len([r for r, n in seen.items() if n == 5]) < 3:
                out = c.recv(timeout=60)
                for rid in out.request_ids:
                    assert rid.startswith(f"client{i}-"), "an output went to the wrong client"
                    seen[rid] = seen.get(rid, 0) + 1
        # One client leaving aborts only its own requests; the engine keeps serving the other.
        chans[0].send(request("orphan", prompt, max_tokens=400, ignore_eos=True))
        chans[0].close()
        chans[1].send(request("survivor", prompt, max_tokens=3))
        got = 0
        while got < 3:
            got += chans[1].recv(timeout=60).request_ids.count("survivor")
        chans[1].close()
        assert proc.wait(timeout=30) == 0  # the last client gone: the engine exits cleanly
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for x in listeners:
            x.close()
    assert shm_entries() <= before


def test_a_sequence_cannot_outgrow_the_cache(tokenizer):
    """With a tiny cache, the context is capped at the cache size: the request ends by length."""
    with SyncMPClient(config(num_kv_blocks=4)) as c:  # 64 tokens in all
        assert c.ready.max_model_len == 64
        p = tokenizer.encode("Tell me a story")
        c.add_request(request("long", p, max_tokens=500, ignore_eos=True))
        tokens, reason, _ = collect(c, ["long"], timeout=120)["long"]
        assert reason == "length" and len(p) + len(tokens) == 64


def test_malformed_and_unknown_messages_are_reported_and_serving_goes_on(tokenizer):
    import subprocess
    import sys

    import msgspec

    from shm_engine.engine.protocol import EngineHello, EngineMessage, EngineReady, EngineStartup
    from shm_engine.ipc import ChannelListener

    listener = ChannelListener()
    proc = subprocess.Popen([sys.executable, "-m", "shm_engine.engine.core_proc", listener.address])
    try:
        chan = listener.accept(timeout=60, recv_type=EngineMessage | EngineHello | EngineReady)
        assert isinstance(chan.recv(timeout=60), EngineHello)
        chan.send(EngineStartup(config=config(num_kv_blocks=64)))
        assert isinstance(chan.recv(timeout=120), EngineReady)
        chan.send_bytes([b"\xc1 not msgpack"])  # malformed frame
        chan.send_bytes([msgspec.msgpack.encode(["NoSuchRequestType", 1, 2])])  # unknown type
        bad = request("bad", tokenizer.encode("Hello"), max_tokens=2)
        bad.sampling_params.max_tokens = 2.5  # fails the engine's decode, not the encoder
        chan.send(bad)
        chan.send(request("ok", tokenizer.encode("Hello"), max_tokens=2))
        errors, finished = [], False
        while not finished:
            out = chan.recv(timeout=60)
            errors += [(e.request_id, e.message) for e in out.errors]
            finished = "ok" in out.request_ids and bool(out.finished)
        assert len(errors) == 3 and all("bad message" in m for _, m in errors)
        # The request that failed to decode is still named, so its sender can fail it.
        assert [r for r, _ in errors] == ["", "", "bad"]
        chan.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()


def test_an_engine_that_cannot_start_says_why():
    before = shm_entries()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="does not exist"):
        SyncMPClient(config(model="/nonexistent/model.gguf"))
    assert time.monotonic() - t0 < 60
    assert shm_entries() <= before


def test_llm_on_an_unreadable_model_raises_the_read_error(tmp_path):
    """LLM starts its engine, then reads the model's tokenizer; a file it cannot read raises the
    reader's own error and stops the engine at once; a missing path spawns nothing."""
    import psutil

    from shm_engine import LLM

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    before, children = shm_entries(), set(psutil.Process().children())
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(bad), dtype=DTYPE, num_kv_blocks=32)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"), dtype=DTYPE, num_kv_blocks=32)
    # more replicas than cores: refused before any engine starts
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="replicas need"):
        LLM(dtype=DTYPE, num_kv_blocks=32, data_parallel_size=cores + 1)
    for size, in_process in ((0, False), (-3, False), (2, True)):  # had run one engine quietly
        with pytest.raises(ValueError, match="data_parallel_size must be"):
            LLM(dtype=DTYPE, num_kv_blocks=32, data_parallel_size=size, in_process=in_process)
    assert set(psutil.Process().children()) <= children
    assert shm_entries() <= before


def test_an_engine_started_ahead_is_adopted_once_or_stopped():
    """EngineLaunch: a client adopts the process (once); close() stops one nobody adopted and
    leaves an adopted one alone; launch_engines starts one a replica, close_launches stops them."""
    from shm_engine.engine.client import EngineLaunch, close_launches, launch_engines

    replicas = launch_engines(2)
    assert [x.engine_index for x in replicas] == [0, 1]
    close_launches(replicas)
    assert all(x.proc.poll() is not None for x in replicas)

    before = shm_entries()
    unused = EngineLaunch()
    unused.close()
    assert unused.proc.poll() is not None
    unused.close()  # again: nothing
    with pytest.raises(RuntimeError, match="adopted or closed"):
        SyncMPClient(config(num_kv_blocks=32), launch=unused)
    launch = EngineLaunch(engine_index=3)
    with SyncMPClient(config(num_kv_blocks=32), launch=launch) as client:
        assert client.proc is launch.proc and client.engine_index == 3
        launch.close()
        assert client.call_utility("echo", 7) == 7
    assert launch.proc.poll() is not None
    assert shm_entries() <= before


def test_engine_exits_when_its_client_is_killed():
    """A frontend killed with SIGKILL leaves no orphan engine and nothing in /dev/shm."""
    import subprocess
    import sys

    import psutil

    before = shm_entries()
    code = (
        "import sys, time\n"
        "from shm_engine.engine.client import SyncMPClient\n"
        "from shm_engine.engine.config import EngineConfig\n"
        f"c = SyncMPClient(EngineConfig(dtype={DTYPE!r}, num_kv_blocks=32))\n"
        "print(c.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(client.stdout.readline())
        engine = psutil.Process(engine_pid)
        client.kill()
        client.wait()
        engine.wait(timeout=10)  # psutil raises TimeoutExpired if the engine lingers
    finally:
        if client.poll() is None:
            client.kill()
    assert shm_entries() <= before


def test_an_engine_started_ahead_exits_quietly_when_its_frontend_dies_first():
    """A frontend killed after EngineLaunch but before it accepted the engine (serve's imports,
    say): the engine finds no one to connect to, exits without a traceback, leaves nothing."""
    import subprocess
    import sys

    import psutil

    before = shm_entries()
    code = (
        "import time\n"
        "from shm_engine.engine.client import EngineLaunch\n"
        "launch = EngineLaunch()\n"
        "print(launch.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    client = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        engine = psutil.Process(int(client.stdout.readline()))
        client.kill()
        client.wait()
        engine.wait(timeout=60)  # psutil raises TimeoutExpired if the engine lingers
        assert "Traceback" not in client.stderr.read()  # the engine shared the pipe
    finally:
        if client.poll() is None:
            client.kill()
    assert shm_entries() <= before


def test_llm_takes_the_models_generation_config_defaults(tmp_path) -> None:
    """LLM.generate without SamplingParams samples as the model's generation_config.json says
    (vLLM's generation_config="auto"); given SamplingParams are used as they are."""
    import json

    from model.conftest import tiny_config, tiny_tokenizer_metadata, tiny_weights

    from shm_engine import LLM
    from shm_engine.model.hf_loader import save_hf_model
    from shm_engine.model.tokenizer import Tokenizer

    config = tiny_config()
    save_hf_model(tmp_path, config, tiny_weights(config))
    tok = Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata())
    (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
    gen = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    with LLM(str(tmp_path), dtype=DTYPE, num_kv_blocks=16, in_process=True) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.repetition_penalty, d.top_p) == (0.0, 1.3, 1.0)
        runs = [llm.generate("hello", use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
        assert runs[0] == runs[1] == runs[2]  # greedy, from the model's defaults
        assert len(runs[0]) == 5 == d.max_tokens  # max_new_tokens, as vLLM maps it
        same = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3)
        assert llm.generate("hello", same, use_tqdm=False)[0].outputs[0].token_ids == runs[0][:4]
        plain = SamplingParams(max_tokens=4, temperature=0.0)  # no penalty: this model repeats
        assert llm.generate("hello", plain, use_tqdm=False)[0].outputs[0].token_ids != runs[0][:4]


def test_an_engine_stops_loading_when_its_frontend_dies():
    """A frontend killed while its engine loads the model: the engine stops within a second,
    not once the load is done (nothing read its channels then; ~8 s on this machine)."""
    import subprocess
    import sys

    import psutil

    before = shm_entries()
    code = (
        "from shm_engine.engine.client import SyncMPClient\n"
        "from shm_engine.engine.config import EngineConfig\n"
        f"SyncMPClient(EngineConfig(dtype={DTYPE!r}, num_kv_blocks=64))\n"
    )
    front = subprocess.Popen([sys.executable, "-c", code])
    try:
        engine, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:  # until the engine has the model file open
            kids = psutil.Process(front.pid).children()
            engine = next((p for p in kids if "core_proc" in " ".join(p.cmdline())), engine)
            if engine is not None and any(f.path.endswith(".gguf") for f in engine.open_files()):
                break
            time.sleep(0.02)
        assert engine is not None, "no engine process"
        front.kill()
        front.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 30 and _running(engine):
            time.sleep(0.02)
        assert time.monotonic() - killed < 2.0
    finally:
        front.kill()
        front.wait()
    assert shm_entries() <= before


def _running(p) -> bool:
    """Alive and not a zombie (an orphan's reaper may take its time)."""
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_llm_prompt_cache_salt_and_priority():
    """vLLM's prompt-dict cache_salt keeps prefix-cache blocks apart (it had been dropped, so
    tenants shared them); generate takes one priority a prompt."""
    from shm_engine import LLM

    text = "Tell me about the history of the city of Paris in a few short sentences. " * 2
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(dtype=DTYPE, num_kv_blocks=128, in_process=True) as llm:

        def cached(salt: str | None) -> int:
            prompt = {"prompt": text} if salt is None else {"prompt": text, "cache_salt": salt}
            return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

        assert cached("tenant-a") == 0
        assert cached("tenant-b") == 0 and cached(None) == 0  # other salts share nothing
        assert cached("tenant-a") > 0
        with pytest.raises(ValueError, match="cache_salt"):
            cached("")
        assert len(llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 0])) == 2
        for bad, why in (([1], "one priority per prompt"), ([1.5, 0], "integers"),
                         ([1, 0], "scheduling_policy='priority'")):  # fmt: skip
            with pytest.raises(ValueError, match=why):
                llm.generate(["a", "b"], params, use_tqdm=False, priority=bad)
        with pytest.raises(ValueError, match="may not set messages"):
            llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"messages": []})


def test_llm_generate_raises_what_the_engine_refused():
    """A request the engine refuses (here: it sleeps) makes generate raise, as vLLM's LLM does,
    instead of returning an output with an error; nothing is left running, and the next
    generate after wake_up works."""
    from shm_engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(dtype=DTYPE, num_kv_blocks=64, in_process=True) as llm:
        llm.sleep()
        with pytest.raises(ValueError, match="sleeping"):
            llm.generate(["a", "b"], params, use_tqdm=False)
        llm.wake_up()
        stats = llm.get_stats()
        assert stats.num_running == stats.num_waiting == 0
        outs = llm.generate(["a", "b"], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


COPY_TEXT = (
    "The committee met on Tuesday to review the budget for the next fiscal year. After a long "
    "discussion, the members agreed to increase funding for public libraries and to reduce "
    "spending on administrative travel."
)


@pytest.mark.skipif(DTYPE != "int8", reason="the int8 model's rows do not depend on their batch")
def test_speculative_decoding_leaves_every_token_as_it_was():
    """Each row is sampled as a plain decode step samples its position, from the same logits
    (a row's result never depends on its batch), the same penalties and EOS mask and, for a
    seeded request, the same draw: the tokens and logprobs are the same with or without
    drafts, greedy or sampled."""
    from shm_engine import LLM

    prompts = [
        f"Repeat the following paragraph word for word:\n\n{COPY_TEXT}",
        "def fibonacci(n):",
        f"Rewrite this in capital letters: {COPY_TEXT}",
        "The capital of France is",
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=24)
    with_logprobs = SamplingParams(temperature=0.5, seed=1, logprobs=2, max_tokens=24)
    min_tokens = SamplingParams(temperature=0.0, min_tokens=30, max_tokens=40)  # EOS masked
    penalized = SamplingParams(
        temperature=0.0, max_tokens=32, frequency_penalty=0.3, repetition_penalty=1.05
    )
    # " the" banned and "." favoured at every row, drafts' rows included
    biased = SamplingParams(
        temperature=0.7, seed=3, max_tokens=24, logit_bias={260: -100.0, 30: 1.0}
    )
    outs, logprobs = {}, {}
    for spec, depth in ((0, 1), (4, 1), (4, 2)):
        with LLM(
            dtype=DTYPE, num_kv_blocks=256, in_process=True, batch_queue_size=depth,
            # vLLM's spelling of the settings
            speculative_config={"method": "ngram", "num_speculative_tokens": spec,
                                "prompt_lookup_min": 1},
        ) as llm:  # fmt: skip
            chats = [
                llm.get_tokenizer().apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in prompts
            ]
            got = llm.generate(chats, greedy, use_tqdm=False)
            got += llm.generate(chats[:2], sampled, use_tqdm=False)
            got += llm.generate(chats[3:], min_tokens, use_tqdm=False)
            got += llm.generate(chats[:2], penalized, use_tqdm=False)
            got += llm.generate(chats[:1], biased, use_tqdm=False)
            got += llm.generate(chats[:1], with_logprobs, use_tqdm=False)
            outs[spec, depth] = [o.outputs[0].token_ids for o in got]
            logprobs[spec, depth] = got[-1].outputs[0].logprobs
            stats = llm.get_stats()
        if spec:
            # the copying prompts' drafts are mostly right
            assert stats.spec_accepted_tokens > 0.4 * stats.spec_draft_tokens > 0, stats
    assert outs[4, 1] == outs[0, 1]
    assert outs[4, 2] == outs[0, 1]
    assert logprobs[4, 1] == logprobs[0, 1] and len(logprobs[0, 1]) == len(outs[0, 1][-1])


def test_structured_outputs_in_a_mixed_batch():
    """Constrained and plain requests share steps: each constrained output parses, n=2 seeded
    children each follow the constraint, and a plain request's tokens are those it gets alone
    (the masks are per row)."""
    import json

    from shm_engine import LLM, StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    with LLM(dtype=DTYPE, num_kv_blocks=256, batch_queue_size=2) as llm:
        alone = llm.generate(["The capital of France is"], plain, use_tqdm=False)[0]
        outs = llm.generate(
            ["The capital of France is", "A person as JSON:", "Pick a colour:"],
            [
                plain,
                SamplingParams(
                    temperature=0.0,
                    max_tokens=60,
                    structured_outputs=StructuredOutputsParams(
                        json=schema, disable_any_whitespace=True
                    ),
                ),
                SamplingParams(
                    n=2,
                    temperature=1.0,
                    seed=11,
                    max_tokens=8,
                    structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]),
                ),
            ],
            use_tqdm=False,
        )
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    person = json.loads(outs[1].outputs[0].text)
    assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120
    assert outs[1].outputs[0].finish_reason == "stop"
    assert len(outs[2].outputs) == 2
    assert all(c.text in ("red", "green", "blue") for c in outs[2].outputs)
