"""The FastAPI app of dflash serve: /v1/chat/completions and /v1/completions (streamed as
server-sent events or not), /v1/models, /health and /metrics, over one dflash.Session.

Every request runs through Session.astream: a streamed response forwards its pieces as they
come; a plain one collects them. A client that disconnects first has its request aborted, which
frees its KV blocks. Client mistakes get OpenAI-style 4xx errors (dflash's ValueErrors are 400s);
only a failure of the runtime itself is a 500."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash.serve import protocol
from dflash.serve.errors import APIError, bad_request
from dflash.serve.gates import RequestGates
from dflash.serve.metrics import CONTENT_TYPE, CountStatuses, ServerMetrics

_log = logging.getLogger("dflash.serve")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
_CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"


def build_app(session: Any, *, model_name: Optional[str] = None, api_key: Optional[str] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, close_session_on_shutdown: bool = False) -> FastAPI:
    """The ASGI app serving `session` (a dflash.Session) under `model_name` (default: the model
    directory's name; the directory's path is accepted too). api_key: /v1/ routes then need
    `Authorization: Bearer KEY`. max_body_bytes: larger request bodies get a 413."""
    name = model_name or os.path.basename(os.path.normpath(session.model_dir))
    server = _Server(session, name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_session_on_shutdown:
            session.close()

    app = FastAPI(title="dflash", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(RequestGates, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(CountStatuses, metrics=server.metrics, endpoints=_ENDPOINTS)
    _add_error_handlers(app)

    @app.get("/health")
    def health() -> Response:
        if session.closed:
            raise APIError(503, "the session is closed", code="unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def metrics() -> Response:  # sync: runs in the thread pool (stats() waits for a step at most)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    def models() -> Dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": server.created,
                                            "owned_by": "dflash", "max_model_len": server.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, protocol.parse_chat_request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, protocol.parse_completion_request)

    return app


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, e: ValueError) -> JSONResponse:  # dflash: a caller's mistake
        return _error_response(bad_request(str(e)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(bad_request(str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        return _error_response(APIError(e.status_code, str(e.detail), code=codes.get(e.status_code)))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        _log.exception("dflash serve: request failed")
        return _error_response(APIError(500, f"{type(e).__name__}: {e}", code="internal_error"))


async def _json_body(request: Request) -> Dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        # ValueError covers malformed JSON, non-UTF-8 bytes and integers past Python's digit limit;
        # RecursionError JSON nested deeper than the parser's recursion allows.
        reason = "it nests too deeply" if isinstance(e, RecursionError) else str(e)
        raise bad_request(f"The request body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(body).__name__}")
    return body


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: Dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _Server:
    """Per-app state: the session, its limits, the metrics, and the two generation paths."""

    def __init__(self, session: Any, model_name: str) -> None:
        self.session = session
        self.model_name = model_name
        self.model_names = [model_name, str(session.model_dir)]
        self.created = int(time.time())
        self.metrics = ServerMetrics(session.stats)
        st = session.stats()
        self.max_model_len = st["max_model_len"]
        lookahead = st["num_speculative_tokens"] + 1 if st["num_speculative_tokens"] else 0
        # Tokens a request may hold in all (prompt + output): the context and the KV cache.
        self.max_request_tokens = min(st["max_model_len"], st["kv_cache_tokens"] - lookahead)
        self.speculative = session.draft_dir is not None

    async def generate(self, request: Request, parse: Callable[..., protocol.GenerationRequest]) -> Response:
        arrival = time.perf_counter()
        req = parse(await _json_body(request), self.model_names)
        prompt_param = "messages" if req.kind == "chat" else "prompt"
        try:
            prompt = await run_in_threadpool(self.session._to_prompt, req.prompt)
        except ValueError as e:  # chat template, roles, token ids
            raise bad_request(str(e), prompt_param) from None
        if req.kind == "chat":
            default_max_tokens = max(1, self.max_request_tokens - len(prompt.token_ids))
        else:
            default_max_tokens = protocol.COMPLETIONS_DEFAULT_MAX_TOKENS
        params = protocol.sampling_params(req, default_max_tokens)
        stream = self.session.astream(prompt.token_ids, params)
        try:
            await stream.started()
        except ValueError as e:  # refused by the engine: too long a prompt, no room in the KV cache
            message = str(e)
            param = req.max_tokens_param if "max_tokens" in message else prompt_param
            code = "context_length_exceeded" if "max_model_len" in message else None
            raise bad_request(message, param, code) from None
        except BaseException:
            await stream.aclose()
            raise
        response_id = protocol.new_id(req.kind)
        if req.stream:
            return StreamingResponse(self._events(req, stream, response_id, arrival), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, req, stream, response_id, arrival)

    # ------------------------------------------------------------------ one request's pieces
    def _observe(self, timing: Dict[str, Optional[float]], item: Any) -> None:
        if not item.token_ids:
            return
        now = time.perf_counter()
        if timing["last"] is None:
            self.metrics.time_to_first_token.observe(now - timing["arrival"])
        else:
            self.metrics.inter_token_latency.observe(now - timing["last"])
        timing["last"] = now

    def _finished(self, timing: Dict[str, Optional[float]], reason: str, prompt_tokens: int,
                  completion_tokens: int) -> None:
        self.metrics.finished.labels(reason).inc()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(completion_tokens)
        self.metrics.e2e_latency.observe(time.perf_counter() - timing["arrival"])

    async def _events(self, req: protocol.GenerationRequest, stream: Any, response_id: str,
                      arrival: float) -> AsyncIterator[str]:
        created = int(time.time())
        timing: Dict[str, Optional[float]] = {"arrival": arrival, "last": None}
        completion_tokens = 0
        final = None

        def chunk(**kwargs: Any) -> str:
            return _sse(protocol.chunk_body(req, response_id, created, self.model_name, **kwargs))

        try:
            if req.kind == "chat":
                yield chunk(role=True, text="")
            async for item in stream:
                self._observe(timing, item)
                completion_tokens += len(item.token_ids)
                if item.text:
                    yield chunk(text=item.text)
                if item.finished:
                    final = item
            self._finished(timing, final.finish_reason, len(stream.prompt_token_ids), completion_tokens)
            yield chunk(text=None if req.kind == "chat" else "", finish_reason=final.finish_reason)
            if req.include_usage:
                yield chunk(usage_body=protocol.usage(len(stream.prompt_token_ids), completion_tokens,
                                                      final.metrics, self.speculative))
            yield "data: [DONE]\n\n"
        finally:
            if final is None:  # the client left (or the server stops): free the request's blocks
                await stream.aclose()
                self._finished(timing, "abort", len(stream.prompt_token_ids), completion_tokens)

    async def _complete(self, request: Request, req: protocol.GenerationRequest, stream: Any, response_id: str,
                        arrival: float) -> Response:
        timing: Dict[str, Optional[float]] = {"arrival": arrival, "last": None}
        parts: List[str] = []
        counts = {"tokens": 0}

        async def collect() -> Any:
            async for item in stream:
                self._observe(timing, item)
                parts.append(item.text)
                counts["tokens"] += len(item.token_ids)
                if item.finished:
                    return item
            raise RuntimeError("the stream ended without a final item")

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():  # the client left first (or this handler was cancelled)
                collector.cancel()
                await stream.aclose()
                self._finished(timing, "abort", len(stream.prompt_token_ids), counts["tokens"])
        if not collector.done() or collector.cancelled():
            return Response(status_code=_CLIENT_CLOSED)
        final = collector.result()
        prompt_tokens = len(stream.prompt_token_ids)
        self._finished(timing, final.finish_reason, prompt_tokens, counts["tokens"])
        usage_body = protocol.usage(prompt_tokens, counts["tokens"], final.metrics, self.speculative)
        return JSONResponse(protocol.response_body(req, response_id, self.model_name, "".join(parts),
                                                   final.finish_reason, usage_body))
