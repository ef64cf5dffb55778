"""Token usage read from an answer while the gateway relays it.

`UsageTap` watches the bytes on their way to the client: it finds the token usage (in a
JSON answer's `usage`, Workers AI's `result.usage`, or a server-sent event's), keeps the
start of the answer for the log, and for a stream whose usage the gateway asked for on the
client's behalf (`ask_usage`) removes that usage again, so that the client gets what it
asked for. Events go on as soon as they are whole.
"""

from __future__ import annotations

import json
from typing import Any

PAYLOAD_LIMIT = 64 * 1024  # bytes of a body kept in the log
USAGE_SCAN_LIMIT = 4 * 1024**2  # bytes of a JSON answer read for its usage


class Usage:
    """Token counts found in an answer (None when it had none)."""

    __slots__ = ("prompt", "completion")

    def __init__(self) -> None:
        self.prompt: int | None = None
        self.completion: int | None = None

    def take(self, usage: Any) -> None:
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            self.prompt = prompt if isinstance(prompt, int) else self.prompt
            self.completion = completion if isinstance(completion, int) else self.completion


class UsageTap:
    """Watches one answer as it is relayed (strip: remove from a server-sent event stream
    the usage the gateway asked for; keep: the start of it for the log; record: every byte
    the client got, for the cache)."""

    def __init__(self, content_type: str, strip: bool, keep: bool, record: bool = False) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self.strip = strip and self.sse
        self.keep = keep
        self.record = record
        self.recorded: list[bytes] = []  # with record: every byte the client got
        self.usage = Usage()
        self.ended = False  # a server-sent event stream's closing `data: [DONE]` went by
        self.kept = b""
        self._pending = b""  # SSE: the unfinished event; JSON: the body so far

    def feed(self, chunk: bytes) -> bytes:
        out = self._feed(chunk)
        if self.record and out:
            self.recorded.append(out)
        return out

    def finish(self) -> bytes:
        out = self._finish()
        if self.record and out:
            self.recorded.append(out)
        return out

    def _feed(self, chunk: bytes) -> bytes:
        if self.keep and len(self.kept) < PAYLOAD_LIMIT:
            self.kept += chunk[: PAYLOAD_LIMIT - len(self.kept)]
        if not self.sse:
            if len(self._pending) < USAGE_SCAN_LIMIT:
                self._pending += chunk
            return chunk
        self._pending += chunk
        whole, separator, rest = self._pending.rpartition(b"\n\n")
        if not separator:
            return b"" if self.strip else chunk
        self._pending = rest
        out = [self._event(e) for e in whole.split(b"\n\n")]
        if not self.strip:
            return chunk
        return b"".join(e + b"\n\n" for e in out if e is not None)

    def _finish(self) -> bytes:
        if self.sse:
            rest, self._pending = self._pending, b""
            if rest.strip():
                out = self._event(rest)
                return (out or b"") if self.strip else b""
            return rest if self.strip else b""
        try:
            data = json.loads(self._pending)
        except (ValueError, UnicodeDecodeError):
            return b""
        if isinstance(data, dict):
            self.usage.take(data.get("usage"))
            if isinstance(data.get("result"), dict):  # Workers AI's envelope
                self.usage.take(data["result"].get("usage"))
        return b""

    def _event(self, event: bytes) -> bytes | None:
        """The event to send on (None: dropped), its usage noted."""
        text = event.strip(b"\r\n")
        if text == b"data: [DONE]":
            self.ended = True
        if not text.startswith(b"data:") or b'"usage"' not in text:
            return event
        try:
            data = json.loads(text[5:])
        except (ValueError, UnicodeDecodeError):
            return event
        if not isinstance(data, dict):
            return event
        self.usage.take(data.get("usage"))
        if not self.strip:
            return event
        if not data.get("choices") and data.get("usage"):
            return None  # the usage-only chunk the client did not ask for
        data.pop("usage", None)
        return b"data: " + json.dumps(data, separators=(",", ":")).encode()


def ask_usage(body: dict[str, Any]) -> bool:
    """For a streamed request without include_usage: ask for it (True: strip it later)."""
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return False
    body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                              "include_usage": True}  # fmt: skip
    return True


def payload_text(data: bytes) -> str | None:
    """A body as the log keeps it: its first PAYLOAD_LIMIT bytes as text (None if empty)."""
    if not data:
        return None
    return data[:PAYLOAD_LIMIT].decode("utf-8", errors="replace")
