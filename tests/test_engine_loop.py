# tests/test_engine_loop.py
#
# EngineLoop against a scripted stand-in for dflash._core.Session: batches are added all or
# nothing, a sink that asks to stop ends its request, a failing step fails the live requests
# and the loop goes on serving, close() aborts what runs and refuses new work, and the idle loop
# never touches the session.
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dflash.engine_loop import EngineLoop
from dflash.errors import DFlashError


class ScriptedCore:
    """Each request input is a list of steps (token lists); the request ends after its last
    ("forever": one token per step, never ending). Records every call; `fail_next_step` makes
    step() raise once."""

    def __init__(self):
        self.calls = []
        self.live = {}  # id -> remaining steps
        self.done = {}  # id -> (tokens, reason)
        self.tokens = {}
        self.next_id = 0
        self.fail_next_step = False

    def add_request(self, steps):
        self.calls.append("add")
        if steps == "bad":
            raise ValueError("bad request")
        rid, self.next_id = self.next_id, self.next_id + 1
        self.live[rid] = None if steps == "forever" else list(steps)
        self.tokens[rid] = []
        return rid

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        self.calls.append("step")
        if self.fail_next_step:
            self.fail_next_step = False
            raise DFlashError("device lost")
        outs = []
        for rid in list(self.live):
            new = [0] if self.live[rid] is None else self.live[rid].pop(0)
            self.tokens[rid] += new
            finished = self.live[rid] == []
            if finished:
                del self.live[rid]
                self.done[rid] = "length"
            outs.append(SimpleNamespace(request_id=rid, new_tokens=new, finished=finished))
        return outs

    def abort(self, rid):
        self.calls.append("abort")
        if rid in self.live:
            del self.live[rid]
            self.done[rid] = "abort"
            return True
        return False

    def take_result(self, rid):
        self.calls.append("take")
        if rid not in self.done:
            raise ValueError(f"request {rid} is not finished")
        return SimpleNamespace(request_id=rid, token_ids=self.tokens[rid], finish_reason=self.done.pop(rid))


class Sink:
    def __init__(self, stop_after=None):
        self.request_id = -1
        self.tokens = []
        self.result = None
        self.error = None
        self.ended = threading.Event()
        self.stop_after = stop_after

    def on_tokens(self, token_ids):
        self.tokens += token_ids
        return self.stop_after is not None and len(self.tokens) >= self.stop_after

    def on_finish(self, result):
        self.result = result
        self.ended.set()

    def on_error(self, error):
        self.error = error
        self.ended.set()


@pytest.fixture
def core_and_loop():
    core = ScriptedCore()
    loop = EngineLoop(core, thread_name="test-engine")
    yield core, loop
    loop.close()


def test_requests_run_to_their_results(core_and_loop):
    core, loop = core_and_loop
    sinks = [Sink(), Sink()]
    ids = loop.submit([[[1], [2, 3]], [[4]]], sinks).result(timeout=30)
    assert [s.request_id for s in sinks] == ids
    for s in sinks:
        assert s.ended.wait(30)
    assert [(s.tokens, s.result.finish_reason) for s in sinks] == [([1, 2, 3], "length"), ([4], "length")]


def test_a_batch_is_added_all_or_nothing(core_and_loop):
    core, loop = core_and_loop
    first = Sink()
    with pytest.raises(ValueError, match="bad request"):
        loop.submit([[[1], [2]], "bad"], [first, Sink()]).result(timeout=30)
    assert not core.live and not core.done and not first.ended.is_set()
    assert core.calls == ["add", "add", "abort", "take"]


def test_a_sink_that_asks_to_stop_ends_its_request(core_and_loop):
    core, loop = core_and_loop
    sink = Sink(stop_after=2)
    loop.submit([[[1], [2], [3], [4]]], [sink]).result(timeout=30)
    assert sink.ended.wait(30)
    assert sink.tokens == [1, 2] and sink.result.finish_reason == "abort" and not core.live


def test_abort_ends_a_request_and_says_whether_it_ran(core_and_loop):
    core, loop = core_and_loop
    sink = Sink()
    rid = loop.submit(["forever"], [sink]).result(timeout=30)[0]
    assert loop.abort([rid, 999]).result(timeout=30) == [True, False]
    assert sink.ended.is_set() and sink.result.finish_reason == "abort"  # before abort()'s future
    assert loop.abort([rid]).result(timeout=30) == [False]


def test_a_failing_step_fails_live_requests_and_the_loop_goes_on(core_and_loop):
    core, loop = core_and_loop
    core.fail_next_step = True
    sinks = [Sink(), Sink()]
    loop.submit([[[1], [2]], [[3]]], sinks).result(timeout=30)
    for s in sinks:
        assert s.ended.wait(30)
        assert isinstance(s.error, DFlashError) and s.result is None
    assert not core.live and not core.done
    after = Sink()
    loop.submit([[[7]]], [after]).result(timeout=30)
    assert after.ended.wait(30) and after.tokens == [7]


def test_close_aborts_running_requests_and_refuses_new_ones(core_and_loop):
    core, loop = core_and_loop
    sink = Sink()
    loop.submit(["forever"], [sink]).result(timeout=30)
    loop.close()
    assert not loop.thread.is_alive()
    assert sink.ended.is_set() and sink.result.finish_reason == "abort"
    with pytest.raises(ValueError, match="closed"):
        loop.submit([[[1]]], [Sink()])
    assert loop.abort([0]).result(timeout=30) == [False]
    loop.close()  # idempotent


def test_the_idle_loop_does_not_touch_the_session(core_and_loop):
    core, loop = core_and_loop
    assert loop.thread is None  # started on first use only
    sink = Sink()
    loop.submit([[[1]]], [sink]).result(timeout=30)
    assert sink.ended.wait(30)
    calls = list(core.calls)
    with loop.core_lock:  # the loop is between iterations: nothing further happens
        assert loop.request_counts() == (0, 0)
    loop.close()
    assert core.calls == calls
