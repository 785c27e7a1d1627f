"""The engine loop thread and per-request streams, on a tiny model (no HTTP)."""
import asyncio

import pytest

from pagedllm.engine.async_engine import AsyncEngine, QueuePosition
from pagedllm.engine.engine import LLMEngine
from pagedllm.core.request import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_folder):
    return LLMEngine(tiny_llama_folder, kv_cache_memory=4 << 20, max_num_seqs=1)


def test_stream_until_finished_and_abort_on_early_exit(engine):
    async def main():
        async_engine = AsyncEngine(engine)
        try:
            request = engine.make_request(None, [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
            outputs = [out async for out in async_engine.submit(request)]
            assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4, 5]
            assert outputs[-1].finished and outputs[-1].finish_reason == "length"

            long = engine.make_request(None, [1, 2], SamplingParams(max_tokens=300, ignore_eos=True))
            async for out in async_engine.submit(long):
                if len(out.token_ids) == 3:
                    break  # the consumer leaves: the request must be aborted
            for _ in range(100):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert not engine.has_unfinished_requests()
            assert engine.kv_manager.pool.num_used_blocks == 0
        finally:
            async_engine.shutdown()

    asyncio.run(main())


def test_queue_position_then_abort_all(engine):
    async def main():
        async_engine = AsyncEngine(engine)
        try:
            first = engine.make_request(None, [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            second = engine.make_request(None, [4, 5, 6], SamplingParams(max_tokens=2))
            first_stream = async_engine.submit(first)
            second_stream = async_engine.submit(second, report_position=True)
            seen = []
            async for item in second_stream:
                seen.append(item)
                if isinstance(item, QueuePosition):
                    async_engine.abort_all()  # like the end of a shutdown grace period
            assert isinstance(seen[0], QueuePosition)
            assert 1 <= seen[0].position <= seen[0].queue_length <= 2
            assert seen[-1].finish_reason == "abort"
            finals = [o async for o in first_stream if o.finished]
            assert finals[0].finish_reason == "abort"
        finally:
            async_engine.shutdown()

    asyncio.run(main())


def test_snapshots_between_steps_and_a_cancelled_asker_breaks_nothing(engine):
    """A snapshot is answered on the loop thread; one whose asker went away (a closed page
    cancels its wait) is skipped, and the loop goes on serving."""
    async def main():
        async_engine = AsyncEngine(engine)
        try:
            abandoned = async_engine.ask_snapshot()
            abandoned.cancel()
            request = engine.make_request(None, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            stream = async_engine.submit(request)
            snapshot = await async_engine.snapshot()
            assert len(snapshot.blocks) == engine.cache_config.num_blocks
            outputs = [out async for out in stream]
            assert outputs[-1].finished and len(outputs[-1].token_ids) == 4
            assert async_engine.dead is None and (await async_engine.snapshot()).requests == []
        finally:
            async_engine.shutdown()

    asyncio.run(main())
