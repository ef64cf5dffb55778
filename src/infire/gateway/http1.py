"""A lean HTTP/1.1 client for the gateway's upstream calls: pooled keep-alive connections,
one request at a time on each, answers parsed by httptools (llhttp), bodies handed out as
they arrive.

It does what the relay needs and nothing else: no redirects, no cookies, no proxies from
the environment, no decompression (the gateway asks for identity), no HTTP/2. A general
client spends CPU per request on what the gateway does not use, and under load that CPU
is the gateway's added latency: with this client in place of aiohttp the gateway answered
about a quarter more requests per second on the same cores (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import quote, urlsplit

import httptools

IDLE_S = 15.0  # an idle pooled connection is closed after this long
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110)
_BAD_VALUE = re.compile(r"[\r\n\0]")
# What may stay as it is in a request target; anything else is percent-encoded (a space or a
# line break in a path never reaches the request line).
_PATH_SAFE, _QUERY_SAFE = "/%:@!$&'()*+,;=-._~", "/%:@!$&'()*+,;=-._~?"


def check_headers(headers: dict[str, str]) -> str | None:
    """Why these headers cannot be sent (a name that is not a token, a line break in a
    value), or None."""
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            return f"header name {name!r} is not valid"
        if _BAD_VALUE.search(value):
            return f"header {name!r} has a line break or NUL in its value"
    return None


_HIGH_WATER = 1 << 20  # buffered body bytes past which the socket stops being read


class UpstreamError(Exception):
    """A connection that could not be made, or that broke off before the answer ended."""


class _Connection(asyncio.Protocol):
    """One connection: a request is written whole, its answer parsed as bytes arrive."""

    def __init__(self, pool: Pool, key: tuple[str, str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_handle: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.error: UpstreamError | None = None
        self.keep_alive = False
        self.paused = False
        self.interim = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.complete:  # bytes on an idle connection: not to be trusted with a request
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the upstream switched protocols"))
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed answer from the upstream: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.complete or self.error is not None:
            return
        if self.headers_done.done() and exc is None and not self._framed():
            self.on_message_complete()  # a body delimited by the connection's end
            return
        reason = f": {exc}" if exc else ""
        self._fail(UpstreamError(f"the upstream closed the connection{reason}"))

    def pause_writing(self) -> None:  # requests are written whole; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # an interim answer (100 Continue): the real one follows
            self.interim = True
            self.raw_headers.clear()
            return
        self.keep_alive = self.parser.should_keep_alive()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self._wake()

    # the answer's side
    def _framed(self) -> bool:
        """Whether the body's end is marked (length or chunks), not the connection's close."""
        names = {name.lower() for name, _ in self.raw_headers}
        return b"content-length" in names or b"transfer-encoding" in names

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        self.error = error
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # retrieved: no "never retrieved" warning
        self._wake()
        self.close()

    async def read_chunk(self) -> bytes:
        """What has arrived of the body since the last call (waiting for some), b"" at its end; UpstreamError once it broke off (after
        the pieces that arrived before the break)."""
        while not self.chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None
        # everything that is in, in one piece: a busy relay sends fewer, larger writes
        chunk = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.buffered <= _HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self.pool.forget(self)


class Response:
    """An upstream answer whose status and headers are in and whose body is still to read;
    header names in lower case (repeated headers joined with ", ")."""

    __slots__ = ("_conn", "headers", "status_code")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status_code = conn.status
        self.headers: dict[str, str] = {}
        for raw_name, raw_value in conn.raw_headers:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            self.headers[name] = f"{self.headers[name]}, {value}" if name in self.headers else value

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked, never decompressed)."""
        while chunk := await self._conn.read_chunk():
            yield chunk

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        """Back to the pool when the answer was read to its end, else the connection closes."""
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and not conn.chunks:
            conn.pool.release(conn)
        else:
            conn.close()


class Pool:
    """Keep-alive connections per (scheme, host, port), at most `limit` open at once."""

    def __init__(self, limit: int = 1024, connect_timeout_s: float = 10.0,
                 tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        """tls: how https upstreams are verified (default: the system's trusted CAs)."""
        self.limit, self.connect_timeout_s = limit, connect_timeout_s
        self.idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self.open: set[_Connection] = set()
        self._slots: asyncio.Semaphore | None = None
        self._ssl = tls

    async def request(self, method: str, url: str, headers: dict[str, str],
                      body: bytes) -> Response:  # fmt: skip
        """Send the request; the answer once its status and headers are in."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        key = (parts.scheme, parts.hostname, port)
        problem = check_headers(headers)
        if problem is not None:
            raise UpstreamError(problem)
        target = quote(parts.path, safe=_PATH_SAFE) or "/"
        if parts.query:
            target += "?" + quote(parts.query, safe=_QUERY_SAFE)
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        lines = [f"{method} {target} HTTP/1.1", f"host: {host}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if body or method not in ("GET", "HEAD"):
            lines.append(f"content-length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        conn = await self._connection(key)
        try:
            conn._reset()
            assert conn.transport is not None
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)
            await conn.headers_done
        except BaseException:  # cancelled (a timeout) or failed: the connection is spent
            conn.close()
            raise
        return Response(conn)

    async def _connection(self, key: tuple[str, str, int]) -> _Connection:
        idle = self.idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.idle_handle is not None:
                conn.idle_handle.cancel()
                conn.idle_handle = None
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        await self._slots.acquire()
        scheme, host, port = key
        conn = _Connection(self, key)
        self.open.add(conn)
        try:
            loop = asyncio.get_running_loop()
            context = self._tls() if scheme == "https" else None
            await asyncio.wait_for(loop.create_connection(lambda: conn, host, port, ssl=context),
                                   self.connect_timeout_s)  # fmt: skip
        except asyncio.TimeoutError:
            self.forget(conn)
            raise UpstreamError(f"connect timeout ({self.connect_timeout_s:g} s)") from None
        except OSError as e:
            self.forget(conn)
            raise UpstreamError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        except BaseException:
            self.forget(conn)
            raise
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def release(self, conn: _Connection) -> None:
        """An answered connection back to the idle list (closed after IDLE_S unused)."""
        self.idle.setdefault(conn.key, []).append(conn)
        conn.idle_handle = asyncio.get_running_loop().call_later(IDLE_S, conn.close)

    def forget(self, conn: _Connection) -> None:
        """A connection that closed: out of the idle list, its slot free."""
        idle = self.idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        if conn.idle_handle is not None:
            conn.idle_handle.cancel()
            conn.idle_handle = None
        if conn in self.open:
            self.open.discard(conn)
            assert self._slots is not None
            self._slots.release()

    async def close(self) -> None:
        for conn in list(self.open):
            conn.close()
