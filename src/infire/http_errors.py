"""Error answers over HTTP, in the shapes that `infire serve` and `infire gateway` share.

`APIError` is an answer: HTTP status, OpenAI type and code, message, offending field; its
body is OpenAI's `{"error": {"message", "type", "param", "code"}}` or Workers AI's envelope
`{"result": null, "success": false, "errors": [...]}`. This module imports only Starlette,
so that the gateway, which installs without the engine, answers in the same shapes; the
server maps the engine's exceptions onto it in server/errors.py. A response never carries
a stack trace: unexpected exceptions are logged and answered 500.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

logger = logging.getLogger("infire.server")


@dataclass
class APIError(Exception):
    """An error answer: HTTP status, OpenAI type and code, message, offending field."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    workers_ai_code: int | None = None  # the envelope's code where it is not the status
    headers: dict[str, str] | None = None

    def body(self, workers_ai: bool = False) -> dict:
        """The JSON body in the API's shape."""
        if workers_ai:
            error = {"code": self.workers_ai_code or self.status, "message": self.message}
            return {"result": None, "success": False, "errors": [error], "messages": []}
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}


def to_api_error(exc: BaseException) -> APIError:
    """An APIError as it is, Starlette's HTTPException (404, 405, ...) by its status, and
    anything else 500 (logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind)
    logger.exception("internal error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


def json_error(error: APIError, workers_ai: bool = False) -> JSONResponse:
    """The JSONResponse of an error answer."""
    return JSONResponse(error.body(workers_ai), status_code=error.status, headers=error.headers)


def json_object(raw: bytes) -> dict:
    """A request body that must be a JSON object; 400 (invalid_json) when it is not."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return data
