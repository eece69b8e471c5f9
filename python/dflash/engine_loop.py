"""EngineLoop: the one thread that drives a C++ session (dflash._core.Session). It sleeps while
there is nothing to do and steps the engine while requests are unfinished. Any thread submits
and aborts requests through it (asyncio callers await the returned futures); each request has
a sink that receives its new tokens and its result on the engine thread. Session owns one and
stops it in Session.close(), when it is garbage-collected, and at interpreter exit."""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from dflash.errors import DFlashError

_log = logging.getLogger("dflash")


def _fail_future(future: Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


class RequestSink(Protocol):
    """The engine thread's view of one request's consumer."""

    request_id: int  # set by the loop when the request is added

    def on_tokens(self, token_ids: Sequence[int]) -> bool:
        """New tokens of one step; True ends the request now (a stop string, a consumer gone)."""

    def on_finish(self, result: Any) -> None:
        """The request's _core.RequestResult (finish_reason "stop", "length" or "abort")."""

    def on_error(self, error: Exception) -> None:
        """The engine failed while the request ran; the request is gone."""


class EngineLoop:
    """Owns `core` and drives it from one daemon thread, started on first use.

    Thread-safety: submit(), abort() and close() may be called from any thread. The loop calls
    `core` only while holding `core_lock`, so another thread that needs `core` directly (stats)
    takes that lock and waits for at most one engine step. While no request is live the thread
    does not touch `core` at all. Sink callbacks run on the engine thread: on_tokens while the
    lock is held, on_finish / on_error and the futures after it is released, so a caller woken
    by them finds the session idle.
    """

    def __init__(self, core: Any, *, thread_name: str = "dflash-engine") -> None:
        self._core = core
        self.core_lock = threading.Lock()
        self._wake = threading.Condition(threading.Lock())
        self._commands: List[Tuple[Any, ...]] = []
        self._live: Dict[int, RequestSink] = {}
        self._with_tokens: Set[int] = set()  # live requests that have produced a token
        self._thread: Optional[threading.Thread] = None
        self._thread_name = thread_name
        self._closing = False

    # ------------------------------------------------------------------ any thread
    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def thread(self) -> Optional[threading.Thread]:
        """The engine thread (None before the first request)."""
        return self._thread

    def submit(self, inputs: Sequence[Any], sinks: Sequence[RequestSink]) -> "Future[List[int]]":
        """Adds _core.RequestInputs (all in one engine iteration, so they are admitted together),
        each with its sink. The future gives their request ids, or the exception add_request
        raised (a ValueError for a bad request); then none of them was added."""
        future: Future = Future()
        self._post(("add", list(inputs), list(sinks), future))
        return future

    def abort(self, request_ids: Sequence[int]) -> "Future[List[bool]]":
        """Aborts requests (their KV blocks are free when the future is done); the future gives,
        per id, whether it was still unfinished. Their sinks get on_finish with reason "abort"."""
        future: Future = Future()
        try:
            self._post(("abort", list(request_ids), future))
        except ValueError:  # closed: closing aborted every request already
            future.set_result([False] * len(request_ids))
        return future

    def request_counts(self) -> Tuple[int, int]:
        """(running, waiting): unfinished requests that have produced a token, and those that have
        not yet (queued, or in their prefill step). Call with core_lock held."""
        running = len(self._with_tokens)
        return running, len(self._live) - running

    def close(self) -> None:
        """Stops the thread; unfinished requests end with finish_reason "abort". Idempotent."""
        with self._wake:
            self._closing = True
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _post(self, command: Tuple[Any, ...]) -> None:
        with self._wake:
            if self._closing:
                raise ValueError("this Session is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
                self._thread.start()
            self._commands.append(command)
            self._wake.notify()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._commands and not self._live and not self._closing:
                    self._wake.wait()
                commands, self._commands = self._commands, []
                closing = self._closing
            later: List[Callable[[], Any]] = []  # sink callbacks and futures, run unlocked
            with self.core_lock:
                for command in commands:
                    try:
                        self._apply(command, later)
                    except Exception as e:  # never leave the caller of a command waiting
                        _log.exception("dflash: the engine thread failed on a command")
                        later.append(functools.partial(_fail_future, command[-1], e))
                try:
                    if closing:
                        self._abort(list(self._live), later)
                    elif self._live:
                        self._step(later)
                except Exception as e:  # nor the consumers of live requests
                    _log.exception("dflash: the engine thread failed in a step")
                    self._fail_all(e, later)
            for callback in later:
                try:
                    callback()
                except Exception:  # a consumer's bug must not stop the engine
                    _log.exception("dflash: a request callback failed")
            if closing:
                return

    def _apply(self, command: Tuple[Any, ...], later: List[Callable[[], Any]]) -> None:
        if command[0] == "abort":
            _, request_ids, future = command
            found = self._abort(request_ids, later)
            later.append(functools.partial(future.set_result, found))
            return
        _, inputs, sinks, future = command
        if not future.set_running_or_notify_cancel():
            return
        added: List[int] = []
        try:
            for request_input, sink in zip(inputs, sinks):
                request_id = self._core.add_request(request_input)
                added.append(request_id)
                sink.request_id = request_id
                self._live[request_id] = sink
        except Exception as e:
            for request_id in added:  # all or nothing
                del self._live[request_id]
                self._core.abort(request_id)
                self._take_result(request_id)
            later.append(functools.partial(future.set_exception, e))
            return
        later.append(functools.partial(future.set_result, added))

    def _abort(self, request_ids: Sequence[int], later: List[Callable[[], Any]]) -> List[bool]:
        found = []
        for request_id in request_ids:
            sink = self._live.pop(request_id, None)
            found.append(sink is not None)
            if sink is None:
                continue
            self._with_tokens.discard(request_id)
            self._core.abort(request_id)
            later.append(self._finish_callback(sink, self._take_result(request_id)))
        return found

    def _step(self, later: List[Callable[[], Any]]) -> None:
        try:
            outputs = self._core.step()
        except Exception as e:
            self._fail_all(e, later)
            return
        for out in outputs:
            request_id = out.request_id
            sink = self._live.get(request_id)
            if sink is None:
                continue
            finished = out.finished
            if out.new_tokens:
                self._with_tokens.add(request_id)
                try:
                    stop = sink.on_tokens(out.new_tokens)
                except Exception as e:
                    self._end(request_id, finished, later, functools.partial(sink.on_error, e))
                    continue
                if stop and not finished:
                    self._core.abort(request_id)
                    finished = True
            if finished:
                self._end(request_id, True, later, None)
        if self._live and not self._core.has_unfinished():  # never spin on requests the engine lost
            self._fail_all(DFlashError("the engine has no unfinished request but requests are waiting "
                                       "for results (internal error)"), later)

    def _end(self, request_id: int, finished: bool, later: List[Callable[[], Any]],
             callback: Optional[Callable[[], Any]]) -> None:
        sink = self._live.pop(request_id)
        self._with_tokens.discard(request_id)
        if not finished:
            self._core.abort(request_id)
        result = self._take_result(request_id)
        later.append(callback if callback is not None else self._finish_callback(sink, result))

    def _fail_all(self, error: Exception, later: List[Callable[[], Any]]) -> None:
        for request_id, sink in list(self._live.items()):
            try:
                self._core.abort(request_id)
                self._take_result(request_id)
            except Exception:  # the engine is already failing; free what can be freed
                _log.exception("dflash: aborting request %d failed", request_id)
            later.append(functools.partial(sink.on_error, error))
        self._live.clear()
        self._with_tokens.clear()

    def _take_result(self, request_id: int) -> Any:
        try:
            return self._core.take_result(request_id)
        except ValueError:  # not finished or already taken: the engine lost it
            return None

    @staticmethod
    def _finish_callback(sink: RequestSink, result: Any) -> Callable[[], Any]:
        if result is None:
            return functools.partial(sink.on_error, DFlashError(
                f"request {sink.request_id} ended without a result (internal error)"))
        return functools.partial(sink.on_finish, result)
