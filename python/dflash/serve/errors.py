"""OpenAI-style error responses of dflash serve: {"error": {"message", "type", "param", "code"}}
with a 4xx status for a client's mistake and 500 only for a failure of the server itself."""

from __future__ import annotations

import json
from typing import Optional

# The error "type" OpenAI's API uses per status.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "server_error"}


class APIError(Exception):
    """An error answered as OpenAI does: HTTP status, message, the offending parameter, a code."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)
