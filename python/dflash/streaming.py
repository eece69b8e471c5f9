"""Streams of one request's output: the engine-side sink that turns tokens into StreamOutput
items (through TextStream), and the consumer-side iterators Session.stream returns
(RequestStream, blocking) and Session.astream returns (AsyncRequestStream, asyncio). A stream
that is closed, left, or garbage-collected before its last item aborts its request, which frees
the request's KV blocks."""

from __future__ import annotations

import asyncio
import queue
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence

from dflash.engine_loop import EngineLoop
from dflash.outputs import StreamOutput, metrics_from_core
from dflash.text_stream import TextStream


class StreamSink:
    """Engine-thread end of a streamed request: new tokens -> TextStream -> StreamOutput items,
    handed to `put` (thread-safe). `put` returning False means the consumer is gone: the request
    is then ended at its next step."""

    def __init__(self, text: TextStream, put: Callable[[Any], bool]) -> None:
        self.request_id = -1
        self._text = text
        self._put = put
        self._consumer_gone = False

    def on_tokens(self, token_ids: Sequence[int]) -> bool:
        text, ids = self._text.push(token_ids)
        if text or ids:
            self._consumer_gone = not self._put(StreamOutput(self.request_id, text, ids))
        return self._text.stopped or self._consumer_gone

    def on_finish(self, result: Any) -> None:
        text, ids = self._text.finish(result.token_ids)
        reason = "stop" if self._text.stopped else result.finish_reason
        self._put(StreamOutput(self.request_id, text, ids, reason, metrics_from_core(result.metrics)))

    def on_error(self, error: Exception) -> None:
        self._put(error)


def abort_when_submitted(loop: EngineLoop, submitted: "Future[List[int]]") -> None:
    """Aborts the requests of a submission without waiting, now or once they are added (for a
    consumer that leaves before the engine thread has taken its request)."""

    def abort(future: "Future[List[int]]") -> None:
        if not future.cancelled() and future.exception() is None:
            loop.abort(future.result())

    if not submitted.cancel():
        submitted.add_done_callback(abort)


class RequestStream:
    """Iterator over one request's StreamOutput items (Session.stream); the last item has a
    finish_reason. Blocks in next() until the engine has the next piece. abort() / close()
    (also on leaving a `with` block) end the request early and free its KV blocks."""

    def __init__(self, owner: Any, loop: EngineLoop, request_id: int, prompt_token_ids: List[int],
                 items: "queue.SimpleQueue[Any]") -> None:
        self._owner = owner  # keeps the Session (and its engine thread) alive while this is read
        self._loop = loop
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._items = items
        self._done = False

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> StreamOutput:
        if self._done:
            raise StopIteration
        item = self._items.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> bool:
        """Ends the request now (its KV blocks are free on return); the stream then yields the
        rest of what was generated and a last item with finish_reason "abort". False if it had
        already finished."""
        return self._loop.abort([self.request_id]).result()[0]

    def close(self) -> None:
        """Aborts the request unless its last item was read; reading further is then over."""
        if not self._done:
            self._done = True
            self._loop.abort([self.request_id]).result()

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._loop.abort([self.request_id])  # no wait: this may run on any thread


class AsyncRequestStream:
    """Async iterator over one request's StreamOutput items (Session.astream), bound to the event
    loop that created it. The request is submitted at creation; `await started()` (or the first
    item) raises the ValueError of a request the engine refused. aclose() (also on leaving an
    `async with` block) ends the request early without blocking the event loop. Items the engine
    queued while the consumer was busy come as one merged item (their text and token ids
    concatenated; the last one's finish_reason and metrics)."""

    def __init__(self, owner: Any, loop: EngineLoop, submitted: "Future[List[int]]",
                 prompt_token_ids: List[int], items: "asyncio.Queue[Any]") -> None:
        self._owner = owner
        self._loop = loop
        self._submitted = submitted
        self.prompt_token_ids = prompt_token_ids
        self._items = items
        self._done = False
        self._request_id: Optional[int] = None
        self._pending: Optional[BaseException] = None  # an error read while merging, raised next

    @property
    def request_id(self) -> Optional[int]:
        """The request id once submitted (after `await started()`), else None."""
        return self._request_id

    async def started(self) -> int:
        """Waits until the engine has taken the request; returns its id (or raises why not)."""
        if self._request_id is None:
            try:
                self._request_id = (await asyncio.wrap_future(self._submitted))[0]
            except BaseException:
                self._done = True
                raise
        return self._request_id

    def __aiter__(self) -> "AsyncRequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        if self._done:
            raise StopAsyncIteration
        await self.started()
        if self._pending is not None:
            item, self._pending = self._pending, None
        else:
            item = await self._items.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        item = self._merge_queued(item)
        if item.finished:
            self._done = True
        return item

    def _merge_queued(self, item: StreamOutput) -> StreamOutput:
        """`item` with the items queued behind it merged in (a consumer that fell behind the engine,
        e.g. a server at high concurrency, then handles one item per read instead of one per step);
        an error behind it is kept for the next read."""
        if item.finished or self._items.empty():
            return item
        text, ids = [item.text], list(item.token_ids)
        while not self._items.empty() and not item.finished:
            nxt = self._items.get_nowait()
            if isinstance(nxt, BaseException):
                self._pending = nxt
                break
            text.append(nxt.text)
            ids += nxt.token_ids
            item = nxt
        return StreamOutput(item.request_id, "".join(text), ids, item.finish_reason, item.metrics)

    async def abort(self) -> bool:
        """Ends the request now and waits until its KV blocks are free; False if it had already
        finished. The stream then yields a last item with finish_reason "abort"."""
        request_id = await self.started()
        return (await asyncio.wrap_future(self._loop.abort([request_id])))[0]

    async def aclose(self) -> None:
        """Aborts the request unless its last item was read (without waiting for the engine)."""
        self._abort_nowait()

    def _abort_nowait(self) -> None:
        if not self._done:
            self._done = True
            abort_when_submitted(self._loop, self._submitted)

    async def __aenter__(self) -> "AsyncRequestStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._abort_nowait()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._abort_nowait()


def async_put(event_loop: asyncio.AbstractEventLoop, items: "asyncio.Queue[Any]") -> Callable[[Any], bool]:
    """A thread-safe `put` into an asyncio queue; False once its event loop is closed."""

    def put(item: Any) -> bool:
        try:
            event_loop.call_soon_threadsafe(items.put_nowait, item)
            return True
        except RuntimeError:  # the event loop is closed: nobody will read this stream
            return False

    return put


def blocking_put(items: "queue.SimpleQueue[Any]") -> Callable[[Any], bool]:
    def put(item: Any) -> bool:
        items.put(item)
        return True

    return put
