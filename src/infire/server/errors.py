"""The one place where errors become HTTP responses.

OpenAI routes answer `{"error": {"message", "type", "param", "code"}}`; Workers AI routes
(`/ai/...`) answer their envelope `{"result": null, "success": false, "errors": [...]}`,
whose code is the HTTP status except where Workers AI has its own: 5007 (no such model,
HTTP 400) and 3040 (capacity temporarily exceeded, HTTP 429 with Retry-After).
A response never carries a stack trace: unexpected exceptions are logged and answered 500.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from infire.catalog.manager import CapacityError
from infire.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    KVTransferError,
    ModelNotFoundError,
    ServerOverloadedError,
)

logger = logging.getLogger("infire.server")
M = TypeVar("M", bound=BaseModel)


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
    """Map any exception to the answer a client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), code="context_length_exceeded", param=exc.param)
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, CapacityError):
        return APIError(429, str(exc), type="rate_limit_error", code="model_capacity_exceeded",
                        workers_ai_code=3040, headers={"Retry-After": str(exc.retry_after)})  # fmt: skip
    if isinstance(exc, ServerOverloadedError):
        return APIError(429, str(exc), type="rate_limit_error", code="server_overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, KVTransferError):
        return APIError(502, str(exc), type="server_error", code="kv_transfer_failed")
    if isinstance(exc, RequestValidationError | ValidationError):
        return _validation_error(exc)
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind)
    logger.exception("internal error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


def _validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    param = location[0] if location else None
    where = ".".join(location) or "body"
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}", param=param)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`, whatever the content type; 400 naming the problem."""
    return model.model_validate(json_object(await request.body()))


def json_object(raw: bytes) -> dict:
    """A request body that must be a JSON object; 400 (invalid_json) when it is not."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return data


def error_body(exc: BaseException, workers_ai: bool = False) -> dict:
    """The error body for exc (also sent as an event when a stream breaks off)."""
    return to_api_error(exc).body(workers_ai)


def error_response(request: Request, exc: BaseException) -> JSONResponse:
    """The JSONResponse for exc on this route."""
    error = to_api_error(exc)
    workers_ai = request.url.path.startswith("/ai/")
    if workers_ai and isinstance(exc, ModelNotFoundError):
        error = APIError(400, str(exc), param="model", workers_ai_code=5007)
    return JSONResponse(error.body(workers_ai), status_code=error.status, headers=error.headers)
