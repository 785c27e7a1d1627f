"""The engine in a process of its own (serving/process_client.py, serving/core_process.py), on a
tiny model, without HTTP: its outputs are exactly the in-process engine's (the front end
detokenizes and finds stop strings from the engine's token ids), aborts free the engine's
blocks, and a killed engine process fails its requests with an error and is restarted."""
import asyncio
import dataclasses
import os
import re
import signal
import threading
import time

import psutil
import pytest

from pagedllm.config import EngineConfig
from pagedllm.core.request import FinishReason, QueuePosition, SamplingParams, TokenLogprob
from pagedllm.engine import wire
from pagedllm.errors import EngineDeadError, ModelLoadError
from pagedllm.serving.engine_keeper import RestartBackoff
from pagedllm.serving.engine_process import PROCESS_NAME
from pagedllm.serving.process_client import ProcessEngineClient
from pagedllm.structured.spec import GrammarSpec


@pytest.fixture(scope="module")
def config(tiny_llama_folder):
    return EngineConfig(tiny_llama_folder, dtype="float32", kv_cache_memory=4 << 20,
                        max_num_seqs=4)


@pytest.fixture(scope="module")
def process_client(config):
    yield from _running(ProcessEngineClient(config))


def _running(client):
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    yield client
    client.shutdown()
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def local_client(config):
    from pagedllm.serving.local import LocalEngineClient

    client = LocalEngineClient.load(config, start_thread=True)
    yield client
    client.shutdown()


async def _run(client, prompt, params, report_position=False):
    request = client.make_request(None, prompt, params)
    return [item async for item in client.submit(request, report_position)]


def _answers(client, cases):
    async def main():
        return await asyncio.gather(*(_run(client, prompt, params) for prompt, params in cases))
    return asyncio.run(main())


def near_float32(value):
    return pytest.approx(value, rel=1e-5, abs=1e-6)


def _comparable(outputs, near=lambda value: value):
    """Everything but the logprobs' values exactly; those within float32 rounding: the two
    engines see the concurrent requests arrive in different steps, and a batch of another
    size may round the last bit differently (seen in the full suite on a loaded host); near
    wraps one side's values in pytest.approx."""
    def logprobs(o):
        if o.logprobs is None:
            return None
        return [(lp.token_id, near(lp.logprob),
                 [(t, near(v)) for t, v in lp.top])
                for lp in o.logprobs]
    return [(o.token_ids, o.text, o.new_text, o.finish_reason, o.stop_string, logprobs(o))
            for o in outputs]


def test_every_message_comes_back_as_it_was_sent():
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=["a", "bc"],
                            logit_bias={4: -100.0}, logprobs=2,
                            guided=GrammarSpec("regex", "[ab]+"))
    messages = [wire.AddRequest("r1", [1, 2, 3], params, [2], 7, "alice", "salt", 12.5, True),
                wire.AbortRequests(["r1", "r2"]), wire.AbortAll(),
                wire.SetUserPolicies({"alice": 2.0}, {"bob": 1}), wire.AskSnapshot(9),
                wire.Stop()]
    for message in messages:
        assert wire.to_engine.decode(wire.encoder.encode(message)) == message
    delta = wire.TokenDelta("r1", [5, 6], "stop", 3, [TokenLogprob(5, -0.25, [(5, -0.25), (6, -2.0)])],
                            0.5, None)
    assert wire.from_engine.decode(wire.encoder.encode(wire.EngineDead("why"))) == \
        wire.EngineDead("why")
    sent = wire.StepOutputs([delta], wire.QueuePositions(["r2"], [1], 3), _stats(), {"bob": 1})
    assert wire.from_engine.decode(wire.encoder.encode(sent)) == sent
    with pytest.raises(Exception):
        wire.to_engine.decode(wire.encoder.encode(sent))  # an engine takes only its own kinds


def _stats():
    from pagedllm.core.snapshot import EngineStats

    return EngineStats(1, 2, 3, 4, 0.5, 6, 7, 8, 9, 10, 11, spec_accepted_per_position=(1, 2))


def test_restarts_wait_longer_while_the_engine_keeps_dying():
    backoff = RestartBackoff(cap=8.0, settled=60.0)
    pauses = [backoff.after_crash(ran_for=1.0) for _ in range(6)]
    assert pauses == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff.after_crash(ran_for=600.0) == 0.0  # it ran a while: a fresh start
    assert backoff.crashes_in_a_row == 1


@pytest.fixture(scope="module")
def overlapped_process_client(config):
    """An engine process whose steps overlap (engine/overlap.py: off by default on a CPU)."""
    yield from _running(ProcessEngineClient(dataclasses.replace(config, overlap_steps=True)))


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_are_exactly_the_in_process_engines(request, local_client, overlap):
    """Greedy, seeded sampling, logprobs, stop tokens and stop strings (found on text in the
    front end, split across tokens or not): token ids, text, deltas and finish reasons equal;
    also when the engine process overlaps its steps (a stop string then ends a request a
    step later in the engine, never in what the client gets)."""
    process_client = request.getfixturevalue(
        "overlapped_process_client" if overlap else "process_client")
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def seeded(**stops):
        return SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True, **stops)
    base = _answers(local_client, [("hello world", seeded())])[0][-1]
    assert len(base.text) > 8
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 2]  # occurs mid-answer
    cases = [
        ("hello world", greedy),
        ("hello world", seeded()),
        ("hello world", seeded(stop=[stop])),
        ("hello world", seeded(stop=["never here", base.text[3:6]])),
        ([7, 8, 9], SamplingParams(max_tokens=16, temperature=0.9, seed=11, logprobs=3)),
        ([7, 8, 9], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                   stop_token_ids=[base.token_ids[5]])),
        ("x", SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=5,
                             skip_special_tokens=False)),
    ]
    local = _answers(local_client, cases)
    remote = _answers(process_client, cases)
    for here, there in zip(local, remote):
        assert _comparable(there) == _comparable(here, near_float32)
    assert remote[2][-1].stop_string == stop and remote[2][-1].finish_reason == "stop"


def test_structured_output_through_the_engine_process(process_client, local_client):
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=2,
                            guided=GrammarSpec("regex", "(ab|cd)+"))
    local = _answers(local_client, [("go", params)])[0][-1]
    remote = _answers(process_client, [("go", params)])[0][-1]
    assert remote.text == local.text
    # The tiny model's EOS is byte 0 of its byte-level vocabulary: the grammar's end.
    assert re.fullmatch("(ab|cd)+", remote.text.rstrip("\x00"))


def test_an_abort_frees_the_engines_blocks(process_client):
    async def main():
        request = process_client.make_request(None, [1, 2, 3, 4],
                                              SamplingParams(max_tokens=400, ignore_eos=True))
        seen = []
        async for out in process_client.submit(request):
            seen.append(out)
            if len(out.token_ids) >= 3:
                process_client.abort(request.request_id)
        assert seen[-1].finished and seen[-1].finish_reason == "abort"
        snapshot = await process_client.snapshot()
        assert snapshot.requests == [] and "2" not in snapshot.blocks
        # Leaving a stream early aborts too (a client that went away).
        request = process_client.make_request(None, [5, 6], SamplingParams(max_tokens=400,
                                                                           ignore_eos=True))
        async for out in process_client.submit(request):
            if len(out.token_ids) >= 2:
                break
        for _ in range(200):
            snapshot = await process_client.snapshot()
            if not snapshot.requests:
                break
            await asyncio.sleep(0.05)
        assert snapshot.requests == [] and "2" not in snapshot.blocks
        assert process_client.num_in_flight == 0
    asyncio.run(main())


def test_queue_positions_policies_and_figures(process_client):
    async def main():
        process_client.set_user_policies({"alice": 3.0}, {})
        long = [process_client.make_request(None, [i, 2], SamplingParams(max_tokens=300,
                                                                         ignore_eos=True))
                for i in range(4)]
        streams = [process_client.submit(r) for r in long]
        waiting = process_client.make_request(None, [9], SamplingParams(max_tokens=2),
                                              user="alice")
        items = []
        async for item in process_client.submit(waiting, report_position=True):
            items.append(item)
            if isinstance(item, QueuePosition):
                snapshot = await process_client.snapshot()
                assert snapshot.fair_share["alice"]["weight"] == 3.0
                assert process_client.figures()[0].stats.num_waiting >= 1
                process_client.abort_all()
        assert isinstance(items[0], QueuePosition) and items[0].position == 1
        assert items[-1].finish_reason == "abort"
        for stream in streams:
            assert [o async for o in stream][-1].finish_reason == "abort"
    asyncio.run(main())


def test_a_killed_engine_process_fails_its_requests_and_is_restarted(config):
    client = ProcessEngineClient(config)
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    try:
        first_pid = client.engine_pid
        assert psutil.Process(first_pid).name() == PROCESS_NAME

        async def main():
            request = client.make_request(None, [1, 2, 3],
                                          SamplingParams(max_tokens=400, ignore_eos=True))
            with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
                async for out in client.submit(request):
                    if psutil.pid_exists(first_pid) and len(out.token_ids) >= 2:
                        os.kill(first_pid, signal.SIGKILL)
            assert client.num_in_flight == 0
        asyncio.run(main())
        for _ in range(600):  # the restart loads the model again
            if client.restarting is None and client.restarts == 1:
                break
            time.sleep(0.1)
        assert client.restarts == 1 and client.restarting is None
        assert client.engine_pid != first_pid and not psutil.pid_exists(first_pid)
        answer = _answers(client, [([4, 5], SamplingParams(max_tokens=3, ignore_eos=True))])[0]
        assert answer[-1].finish_reason == "length" and len(answer[-1].token_ids) == 3
    finally:
        client.shutdown()
        thread.join(30)
    assert client.engine_pid is None


def test_while_it_restarts_a_request_gets_the_reason_at_once(config):
    client = ProcessEngineClient(config)
    try:
        engine = client._keeper.engine
        os.kill(engine.pid, signal.SIGKILL)
        engine.process.join(10)
        client._on_engine_exit(engine)  # what run() does on seeing it gone
        assert "killed by SIGKILL" in client.restarting

        async def main():
            request = client.make_request(None, [1], SamplingParams(max_tokens=2))
            with pytest.raises(EngineDeadError, match="restarting"):
                async for _ in client.submit(request):
                    pass
            with pytest.raises(EngineDeadError):
                await client.snapshot()
        asyncio.run(main())
    finally:
        client.shutdown()
        client.run()  # returns at once: stopped


def test_a_model_that_cannot_load_is_said_as_in_process(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        ProcessEngineClient(EngineConfig(str(bad)))
    engines = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and p.name() == PROCESS_NAME and p.is_running()
               and p.status() != psutil.STATUS_ZOMBIE]
    assert engines == []


def test_the_ready_line_says_where_the_engine_runs(process_client):
    import dataclasses

    from pagedllm.server.runner import ready_message

    info = process_client.info
    assert info.compute.endswith("in the engine process (--threads)")
    cpu_line = ready_message(info, "127.0.0.1", 8000, "tiny").splitlines()[-1]
    assert cpu_line.startswith("  device: cpu; CPU: ") and "engine process" in cpu_line
    gpu = dataclasses.replace(info, device="cuda", device_name="NVIDIA H200, 140 GiB")
    gpu_line = ready_message(gpu, "127.0.0.1", 8000, "tiny").splitlines()[-1]
    assert gpu_line.startswith("  device: cuda (NVIDIA H200, 140 GiB); host: ")
    assert "kernels" not in gpu_line  # a GPU server's CPU level is not what it serves with


def test_a_draft_request_without_a_draft_model_is_refused_in_the_front_end(process_client):
    from pagedllm.core.request import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="no draft model"):
        process_client.make_request(None, [1, 2], SamplingParams(speculative="draft"))


def test_the_front_end_text_follows_the_engines_tokens(tiny_llama_folder):
    """RequestTextState.follow, without processes: text and stop strings from token ids,
    a stop string ending the request before the engine knows (True: tell it), a token-level
    finish on the same token winning, logprobs kept only for the tokens taken."""
    from pagedllm.core.output_processor import RequestTextState
    from pagedllm.core.request import Request
    from pagedllm.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tiny_llama_folder)
    ids = tok.encode("ab|cd", add_special_tokens=False)

    def state(stop):
        request = Request("r", [1], SamplingParams(stop=stop, logprobs=0), max_model_len=64,
                          arrival_time=5.0)
        return request, RequestTextState(request, tok)

    request, text = state(["|"])
    logprobs = [TokenLogprob(t, -1.0, []) for t in ids]
    assert text.follow(ids, None, 3, logprobs, 0.5) is True  # "|" ends it here
    out = text.make_output()
    assert out.finished and out.finish_reason == "stop" and out.text == "ab"
    assert out.stop_string == "|" and len(out.logprobs) == len(out.token_ids) == 3
    assert out.num_cached_tokens == 3 and out.queue_time == 0.5
    request, text = state(["|"])
    assert text.follow(ids[:3], "length", 0) is False  # the engine's own finish wins
    assert text.make_output().finish_reason == "length"
    request, text = state([])
    assert text.follow(ids[:2], None) is False and not text.make_output().finished
    last = text.last_output(FinishReason.ABORT)
    assert last.finished and last.finish_reason == "abort" and last.text == "ab"
