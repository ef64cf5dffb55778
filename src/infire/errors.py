"""The one exception hierarchy of infire: every error a user can see, with a message to act on.

The server (and the CLI) map these to HTTP statuses / exit messages in one place; code
elsewhere raises the most specific class and never a bare Exception.
"""

from __future__ import annotations


class InfireError(Exception):
    """Base class of every error infire raises on purpose."""


class ModelLoadError(InfireError):
    """A model path is missing, unreadable, truncated or malformed."""


class UnsupportedModelError(ModelLoadError):
    """The model is readable but uses an architecture or tensor type infire cannot serve."""


class InvalidRequestError(InfireError, ValueError):
    """A request's input or sampling parameters are invalid; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """A prompt (plus max_tokens) does not fit the model's context window."""


class ModelNotFoundError(InvalidRequestError):
    """A request names a model this server does not serve."""


class ServerOverloadedError(InfireError):
    """The waiting queue is over its limit; the client should retry later."""


class EngineDeadError(InfireError):
    """The engine loop stopped after an internal failure; no more requests are served."""


class KVTransferError(InfireError):
    """KV blocks could not be moved between a prefill and a decode engine (a peer gone, a
    lease expired, a checksum mismatch): that request fails, nothing is served from them."""
