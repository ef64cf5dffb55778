"""The one place where the engine's errors become HTTP responses.

OpenAI routes answer `{"error": {"message", "type", "param", "code"}}`; Workers AI routes
(`/ai/...`) answer their envelope `{"result": null, "success": false, "errors": [...]}`,
whose code is the HTTP status except where Workers AI has its own: 5007 (no such model,
HTTP 400) and 3040 (capacity temporarily exceeded, HTTP 429 with Retry-After). The shapes,
and the answer to anything else (HTTPException by its status, a logged 500), come from
infire.http_errors, which the gateway shares without the engine; this module adds the
engine's exceptions and request validation.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from infire import http_errors
from infire.catalog.manager import CapacityError
from infire.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    KVTransferError,
    ModelNotFoundError,
    ServerOverloadedError,
)
from infire.http_errors import APIError, json_error, json_object

__all__ = ["APIError", "error_body", "error_response", "json_object", "parse_body",
           "to_api_error"]  # fmt: skip
M = TypeVar("M", bound=BaseModel)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the answer a client gets."""
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
    return http_errors.to_api_error(exc)


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


def error_body(exc: BaseException, workers_ai: bool = False) -> dict:
    """The error body for exc (also sent as an event when a stream breaks off)."""
    return to_api_error(exc).body(workers_ai)


def error_response(request: Request, exc: BaseException) -> JSONResponse:
    """The JSONResponse for exc on this route."""
    error = to_api_error(exc)
    workers_ai = request.url.path.startswith("/ai/")
    if workers_ai and isinstance(exc, ModelNotFoundError):
        error = APIError(400, str(exc), param="model", workers_ai_code=5007)
    return json_error(error, workers_ai)
