"""What a request passes before dflash serve looks at it (an ASGI middleware): the API key of
/v1/ routes (401 without `Authorization: Bearer KEY` when the server has one) and the request
body limit (413 past max_body_bytes, whether the size is declared or only streamed). The body
is read here, at most the limit, and handed on to the app unchanged."""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable, Dict, Optional

from dflash.serve.errors import APIError

Scope = Dict[str, Any]
Receive = Callable[[], Awaitable[Dict[str, Any]]]
Send = Callable[[Dict[str, Any]], Awaitable[None]]

# A refused body up to this size is read and dropped before the 413 goes out: a client that is
# still sending would otherwise see its connection reset instead of the answer.
_DRAIN_BYTES = 64 * 1024 * 1024


async def _drain(receive: Receive, budget: int) -> None:
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def send_error(send: Send, error: APIError) -> None:
    body = error.body_bytes()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestGates:
    def __init__(self, app: Callable[..., Awaitable[None]], *, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path", "").startswith("/v1/"):
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else None
            if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                message = ("Incorrect API key provided" if token is not None
                           else "Missing API key: send the header 'Authorization: Bearer YOUR_KEY'")
                await send_error(send, APIError(401, message, code="invalid_api_key"))
                return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            if int(declared) <= _DRAIN_BYTES:  # read it away, so that the client sees the answer
                await _drain(receive, _DRAIN_BYTES)
            await send_error(send, self._too_large())
            return
        chunks = []
        size = 0
        while True:  # read the body here (small JSON), refusing it once past the limit
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left; the app sees an empty body and the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await _drain(receive, _DRAIN_BYTES)
                await send_error(send, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: the disconnect, when it comes

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than this server's limit of {self.max_body_bytes} bytes",
                        code="request_too_large")
