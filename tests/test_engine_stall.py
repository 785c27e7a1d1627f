"""An engine process that stops making progress (serving/stall_watch.py): noticed while
requests wait (503 engine_stalled with how long, in the log), forgiven when it goes on,
killed and restarted as after a crash when it does not; an abort (a request timeout, a
client gone) ends the stream at once whatever the engine does; and a request in the instant
after a crash is refused as while restarting, not failed."""
import asyncio
import os
import signal
import threading
import time

import pytest

from pagedllm.config import EngineConfig
from pagedllm.core.request import SamplingParams
from pagedllm.engine.faults import Faults
from pagedllm.errors import EngineDeadError, EngineUnavailableError
from pagedllm.serving.process_client import ProcessEngineClient
from pagedllm.serving.stall_watch import StallWatch

from probes import wait_for


SLOW = Faults(step_delay=0.02)  # 500 tokens take 10 s: the answer is caught mid-way


@pytest.fixture()
def config(tiny_llama_folder):
    return EngineConfig(tiny_llama_folder, dtype="float32", kv_cache_memory=4 << 20,
                        max_num_seqs=4)


def test_the_watch_counts_silence_only_while_requests_wait(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    watch = StallWatch(stall_after=10, restart_after=40)
    now[0] += 500
    assert not watch.check(0) and watch.reason() is None  # idle: silence is fine
    now[0] += 9
    assert not watch.check(2) and watch.reason() is None
    now[0] += 2
    assert not watch.check(2) and "no progress for 11 s" in watch.reason()
    now[0] += 30
    assert watch.check(2)  # 41 s: restart it
    watch.heard()
    assert watch.reason() is None and not watch.check(2)


def _serving(client):
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    return thread


async def _stopped_mid_answer(client, pid: int):
    """A long answer begun, then its engine process stopped: (the request, its outputs)."""
    request = client.make_request(None, [1, 2, 3], SamplingParams(max_tokens=500,
                                                                  ignore_eos=True))
    outputs = aiter(client.submit(request))
    await anext(outputs)
    os.kill(pid, signal.SIGSTOP)
    return request, outputs


def test_a_stopped_engine_is_noticed_forgiven_and_an_abort_ends_its_stream(config):
    client = ProcessEngineClient(config, SLOW, stall_watch=StallWatch(1.0, 600.0))
    thread = _serving(client)
    pid = client.engine_pid
    try:
        async def main():
            request, outputs = await _stopped_mid_answer(client, pid)
            stalled = await asyncio.to_thread(wait_for, lambda: client.stalled, 60,
                                              "the stall noticed")
            assert "no progress for" in stalled
            client.abort(request.request_id)  # what --request-timeout does
            final = await asyncio.wait_for(_last(outputs), 60)  # at once, bounded for a busy CI
            assert final.finished and final.finish_reason == "abort"
            os.kill(pid, signal.SIGCONT)
            await asyncio.to_thread(wait_for, lambda: client.stalled is None, 60,
                                    "the stall forgiven")
        asyncio.run(main())
        assert client.restarts == 0 and client.engine_pid == pid
    finally:
        os.kill(pid, signal.SIGCONT)
        client.shutdown()
        thread.join(30)


async def _last(outputs):
    last = None
    async for last in outputs:
        pass
    return last


def test_an_engine_that_stays_stopped_is_killed_and_restarted(config):
    client = ProcessEngineClient(config, SLOW, stall_watch=StallWatch(0.5, 2.0))
    thread = _serving(client)
    pid = client.engine_pid
    try:
        async def main():
            _, outputs = await _stopped_mid_answer(client, pid)
            with pytest.raises(EngineDeadError, match="made no progress for .* and was killed"):
                await asyncio.wait_for(_last(outputs), 120)
        asyncio.run(main())
        wait_for(lambda: client.restarts == 1 and client.restarting is None, 600,
                 "the engine process restarted")
        assert client.engine_pid != pid and client.stalled is None
    finally:
        client.shutdown()
        thread.join(30)


def test_a_request_in_the_instant_after_a_crash_is_not_submitted(config):
    client = ProcessEngineClient(config)
    try:
        engine = client._keeper.engine
        os.kill(engine.pid, signal.SIGKILL)
        engine.process.join(10)  # dead, and run() has not seen it yet

        async def main():
            request = client.make_request(None, [1], SamplingParams(max_tokens=2))
            with pytest.raises(EngineUnavailableError, match="not running"):
                client.submit(request)
            assert client.num_in_flight == 0
        asyncio.run(main())
    finally:
        client.shutdown()
        client.run()  # sees it gone, returns: stopped
