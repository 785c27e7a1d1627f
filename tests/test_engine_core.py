"""The engine core (engine/core.py) without a model or a transport: an engine that records
what it is told, steps as told, and fails as told. Both transports (the loop thread, the
engine-core process) hand the core the same messages; these are the decisions they share."""
from pagedllm.config import SchedulerConfig
from pagedllm.core.request import FinishReason, Request, RequestOutput, SamplingParams
from pagedllm.engine import wire
from pagedllm.engine.core import MAX_CONSECUTIVE_FAULTS, EngineCore
from pagedllm.structured.spec import json_schema_spec


class FakeEngine:
    """Waiting requests in a list; each step finishes the first one, or raises `fail`."""

    def __init__(self):
        self.waiting: list[str] = []
        self.fail: Exception | None = None
        self.refuse: Exception | None = None
        self.policies = None
        self.loras = None
        self.scheduler_config = SchedulerConfig(max_model_len=64)
        self.grammars = None
        self.snapshots = 0

    def add(self, request: Request) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.waiting.append(request.request_id)

    def abort_request(self, request_id: str):
        if request_id not in self.waiting:
            return None
        self.waiting.remove(request_id)
        return _final(request_id, FinishReason.ABORT)

    def request_ids(self) -> list[str]:
        return list(self.waiting)

    def queue_positions(self) -> list[str]:
        return list(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def set_user_policies(self, weights, max_running) -> None:
        self.policies = (weights, max_running)

    def snapshot(self):
        self.snapshots += 1
        if self.fail is not None:
            raise self.fail
        return None

    def step(self) -> list[RequestOutput]:
        if self.fail is not None:
            raise self.fail
        return [_final(self.waiting.pop(0), FinishReason.LENGTH)]


def _final(request_id: str, reason: FinishReason) -> RequestOutput:
    return RequestOutput(request_id, [1], [2], "", [2], "", True, reason.value)


def _request(request_id: str) -> Request:
    return Request(request_id, [1, 2], SamplingParams(max_tokens=1), max_model_len=64)


def _add_message(request_id: str, report_position: bool = False) -> wire.AddRequest:
    return wire.AddRequest.of(_request(request_id), report_position)


def test_requests_added_stepped_and_aborted_come_out_in_order():
    engine = FakeEngine()
    core = EngineCore(engine)
    for rid in ("a", "b", "c"):
        core.apply(_add_message(rid))
    assert engine.waiting == ["a", "b", "c"] and core.has_work
    core.step()
    core.apply(wire.AbortRequests(["b", "unknown"]))
    out = core.take()
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("a", "length"),
                                                                     ("b", "abort")]
    core.apply(wire.AbortAll())
    assert [o.request_id for o in core.take().outputs] == ["c"] and not core.has_work
    assert core.take().outputs == []  # taken once


def test_a_request_the_engine_refuses_ends_alone_with_the_reason():
    engine = FakeEngine()
    core = EngineCore(engine)
    engine.refuse = RuntimeError("the adapter sql is not loaded")
    core.add(_request("a"))
    engine.refuse = None
    core.add(_request("b"))
    [refused] = core.take().outputs
    assert refused.request_id == "a" and refused.finished
    assert refused.finish_reason == "error" and "sql is not loaded" in refused.error
    assert engine.waiting == ["b"] and core.dead is None


def test_steps_failing_in_a_row_fail_every_request_then_mark_the_engine_dead():
    engine = FakeEngine()
    core = EngineCore(engine)
    engine.fail = RuntimeError("scheduler broke")
    for attempt in range(1, MAX_CONSECUTIVE_FAULTS + 1):
        core.add(_request(f"r{attempt}"))
        core.step()
        out = core.take()
        assert out.failed == [f"r{attempt}"] and "scheduler broke" in out.error
        assert engine.waiting == []  # freed, not left behind
        assert (core.dead is not None) == (attempt == MAX_CONSECUTIVE_FAULTS)
    assert f"{MAX_CONSECUTIVE_FAULTS} engine steps failed in a row" in core.dead


def test_a_good_step_resets_the_fault_count():
    engine = FakeEngine()
    core = EngineCore(engine)
    for _ in range(MAX_CONSECUTIVE_FAULTS - 1):
        engine.fail = RuntimeError("once")
        core.add(_request("x"))
        core.step()
    engine.fail = None
    core.add(_request("y"))
    core.step()
    assert core.consecutive_faults == 0
    engine.fail = RuntimeError("again")
    core.add(_request("z"))
    core.step()
    assert core.dead is None and core.consecutive_faults == 1


def test_positions_go_to_those_who_asked_only_when_they_change():
    engine = FakeEngine()
    core = EngineCore(engine)
    core.apply(_add_message("a", report_position=True))
    core.apply(_add_message("b"))
    core.apply(_add_message("c", report_position=True))
    core.take()
    first = core.positions()
    assert (first.request_ids, first.positions, first.queue_length) == (["a", "c"], [1, 3], 3)
    assert core.positions() is None  # nothing changed
    core.step()  # a finishes: c moves up
    core.take()
    moved = core.positions()
    assert (moved.request_ids, moved.positions, moved.queue_length) == (["c"], [2], 2)
    assert "a" not in core.reporting


def test_snapshots_policies_adapters_and_stop():
    engine = FakeEngine()
    core = EngineCore(engine)
    core.apply(wire.AskSnapshot(7))
    engine.fail = RuntimeError("mid-change")
    core.apply(wire.AskSnapshot(8))
    good, bad = core.take().replies
    assert (good.ask_id, good.error) == (7, None)
    assert (bad.ask_id, bad.snapshot) == (8, None) and "mid-change" in bad.error
    core.apply(wire.SetUserPolicies({"alice": 2.0}, {"bob": 1}))
    assert engine.policies == ({"alice": 2.0}, {"bob": 1})
    core.apply(wire.LoadAdapter("sql", "/nowhere"))  # no adapters here: logged, not raised
    core.apply(wire.Stop())
    assert core.stopped and not core.has_work


def test_an_add_message_whose_grammar_cannot_be_rebuilt_fails_alone():
    """Matchers do not travel: the engine's side builds one from the spec; when it cannot,
    that request ends with the reason and the core goes on."""
    class BrokenGrammars:
        def matcher(self, spec):
            raise RuntimeError("grammar cache gone")

    engine = FakeEngine()
    engine.grammars = BrokenGrammars()
    core = EngineCore(engine)
    request = Request("a", [1, 2], SamplingParams(max_tokens=1, guided=json_schema_spec(
        {"type": "object"}, "response_format")), max_model_len=64)
    core.apply(wire.AddRequest.of(request, False))
    [failed] = core.take().outputs
    assert (failed.request_id, failed.finish_reason) == ("a", "error")
    assert "grammar cache gone" in failed.error
    core.apply(_add_message("b"))
    assert engine.waiting == ["b"]
