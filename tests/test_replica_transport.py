"""A replica sends deltas, several steps at once; the ingress rebuilds exactly the outputs
the local engine gives (cumulative tokens, text and logprobs)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra pagedllm[ray]")

from pagedllm.core.request import QueuePosition  # noqa: E402
from pagedllm.core.request import RequestOutput, TokenLogprob  # noqa: E402
from pagedllm.replicas.transport import pack, unpack  # noqa: E402

PROMPT = [1, 2, 3]


def engine_outputs(with_logprobs: bool) -> list[RequestOutput]:
    """What the engine gives over five steps (cumulative fields + each step's delta)."""
    pieces = [(10, "Hel"), (11, "lo"), (12, ","), (13, " world"), (14, "!")]
    outputs, tokens, text, lps = [], [], "", []
    for step, (token, piece) in enumerate(pieces):
        tokens, text = tokens + [token], text + piece
        new_lp = [TokenLogprob(token, -0.1 * step, [(token, -0.1 * step)])] if with_logprobs else None
        lps = lps + new_lp if with_logprobs else None
        last = step == len(pieces) - 1
        outputs.append(RequestOutput("r", PROMPT, tokens, text, [token], piece, last,
                                     "stop" if last else None, 2, lps, new_lp, 0.01))
    return outputs


@pytest.mark.parametrize("with_logprobs", [False, True])
@pytest.mark.parametrize("groups", [[1, 1, 1, 1, 1], [2, 3], [5], [1, 4]])
def test_packed_groups_rebuild_the_same_outputs(groups, with_logprobs):
    outputs = engine_outputs(with_logprobs)
    received, last, start = [], None, 0
    for size in groups:
        batch = pack(outputs[start:start + size])
        assert len(batch) == 1 and batch[0].token_ids == [] and batch[0].prompt_token_ids == []
        last = unpack(batch[0], last, PROMPT)
        received.append(last)
        start += size
    ends = [sum(groups[:i + 1]) - 1 for i in range(len(groups))]
    cumulative = lambda o: (o.prompt_token_ids, o.token_ids, o.text, o.logprobs, o.finished,  # noqa: E731
                            o.finish_reason, o.num_cached_tokens)
    # after each batch: exactly the engine's cumulative output at that step
    assert [cumulative(o) for o in received] == [cumulative(outputs[i]) for i in ends]
    # and the batch's delta is every step's delta in it, in order
    starts = [0] + [e + 1 for e in ends[:-1]]
    for got, first, end in zip(received, starts, ends):
        assert got.new_token_ids == [t for o in outputs[first:end + 1] for t in o.new_token_ids]
        assert got.new_text == "".join(o.new_text for o in outputs[first:end + 1])


def test_queue_positions_pass_through_before_the_output():
    outputs = engine_outputs(False)
    batch = pack([QueuePosition(2, 3), QueuePosition(1, 3), outputs[0], outputs[1]])
    assert batch[:2] == [QueuePosition(2, 3), QueuePosition(1, 3)]
    assert batch[2].new_token_ids == [10, 11] and batch[2].new_text == "Hello"
