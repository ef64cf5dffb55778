"""The gateway's upstream HTTP/1.1 client against raw asyncio servers on 127.0.0.1 that
answer with exact bytes: framing (length, chunks, connection close), keep-alive reuse, a
connection that breaks off, malformed answers, refused connections, and what it refuses
to send."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from infire.gateway.http1 import Pool, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The request head and body (by content-length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


async def _serve(handler: Handler, test: Callable[[str], Awaitable[None]]) -> list[int]:
    """Run handler as a server for the test; the client ports of the connections it got."""
    ports: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ports.append(writer.get_extra_info("peername")[1])
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await test(f"http://127.0.0.1:{port}")
    finally:
        server.close()
    return ports


def test_length_and_chunked_answers_reuse_one_connection() -> None:
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for n in range(3):
            head, body = await _read_request(reader)
            heads.append(head + body)
            if n % 2 == 0:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello"
                )
            else:
                writer.write(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")  # fmt: skip
            await writer.drain()

    async def test(url: str) -> None:
        pool = Pool()
        answers = []
        for n in range(3):
            r = await pool.request(
                "POST", f"{url}/v1/x?q=1", {"authorization": "k"}, b'{"n":%d}' % n
            )
            answers.append((r.status_code, r.headers.get("x-a"), await r.aread()))
            await r.aclose()
        await pool.close()
        assert answers == [(200, "1, 2", b"hello"), (201, None, b"abcde"), (200, "1, 2", b"hello")]

    ports = asyncio.run(_serve(handler, lambda url: test(url)))
    assert len(ports) == 1  # kept alive: three answers on one connection
    assert heads[0].startswith(b"POST /v1/x?q=1 HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b'\r\nauthorization: k\r\ncontent-length: 7\r\n\r\n{"n":0}' in heads[0]


def test_a_body_that_ends_with_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async def test(url: str) -> None:
        pool = Pool()
        r = await pool.request("GET", url, {}, b"")
        assert await r.aread() == b"all of it"
        await r.aclose()
        r = await pool.request("GET", url, {}, b"")  # a new connection: that one is gone
        assert await r.aread() == b"all of it"
        await pool.close()

    assert len(asyncio.run(_serve(handler, test))) == 2


def test_a_body_that_breaks_off_gives_what_came_then_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcd")
        await writer.drain()

    async def test(url: str) -> None:
        pool = Pool()
        r = await pool.request("POST", url, {}, b"x")
        got = []
        with pytest.raises(UpstreamError, match="closed the connection"):
            async for chunk in r.aiter_raw():
                got.append(chunk)
        assert b"".join(got) == b"abcd"
        await r.aclose()
        await pool.close()
        assert not pool.open

    asyncio.run(_serve(handler, test))


def test_malformed_answers_and_silence_are_upstream_errors() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_request(reader)
        if b"/garbage" in head:
            writer.write(b"SMTP ready\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1)
        # /silent: closed without a byte

    async def test(url: str) -> None:
        pool = Pool()
        with pytest.raises(UpstreamError, match="malformed answer"):
            await pool.request("POST", f"{url}/garbage", {}, b"")
        with pytest.raises(UpstreamError, match="closed the connection"):
            await pool.request("POST", f"{url}/silent", {}, b"")
        await pool.close()
        assert not pool.open

    asyncio.run(_serve(handler, test))


def test_refused_connections_and_unsendable_requests() -> None:
    async def test() -> None:
        pool = Pool()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await pool.request("POST", "http://127.0.0.1:9/x", {}, b"")
        with pytest.raises(UpstreamError, match="line break"):
            await pool.request("POST", "http://127.0.0.1:9/x", {"x-a": "1\r\nx-b: 2"}, b"")
        with pytest.raises(UpstreamError, match="not valid"):
            await pool.request("POST", "http://127.0.0.1:9/x", {"x a": "1"}, b"")
        with pytest.raises(UpstreamError, match="not an http"):
            await pool.request("POST", "ftp://127.0.0.1/x", {}, b"")
        assert not pool.open

    asyncio.run(test())


def test_a_target_never_breaks_the_request_line() -> None:
    lines: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _read_request(reader)
        lines.append(head.split(b"\r\n", 1)[0])
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async def test(url: str) -> None:
        pool = Pool()
        r = await pool.request("GET", f"{url}/a b/%41\r\nx: y?k=a b&c=%20", {}, b"")
        assert r.status_code == 204 and await r.aread() == b""
        await pool.close()

    asyncio.run(_serve(handler, test))
    # spaces percent-encoded, escapes kept, line breaks dropped (urllib.parse drops them)
    assert lines == [b"GET /a%20b/%41x:%20y?k=a%20b&c=%20 HTTP/1.1"]


def test_a_cancelled_request_closes_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)  # never answers in time

    async def test(url: str) -> None:
        pool = Pool()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pool.request("POST", url, {}, b""), 0.2)
        assert not pool.open and not any(pool.idle.values())
        await pool.close()

    asyncio.run(_serve(handler, test))


def test_an_interim_100_continue_is_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Real: yes\r\n\r\nok")
        await writer.drain()

    async def test(url: str) -> None:
        pool = Pool()
        r = await pool.request("POST", url, {}, b"body")
        assert (r.status_code, r.headers, await r.aread()) == (
            200, {"content-length": "2", "x-real": "yes"}, b"ok")  # fmt: skip
        await pool.close()

    asyncio.run(_serve(handler, test))


def test_https_upstreams_are_verified(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)  # fmt: skip
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret")
        await writer.drain()

    async def test() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_tls)
        url = f"https://localhost:{server.sockets[0].getsockname()[1]}/v1"
        try:
            trusting = Pool(tls=ssl.create_default_context(cafile=str(cert)))
            r = await trusting.request("POST", url, {}, b"{}")
            assert (r.status_code, await r.aread()) == (200, b"secret")
            await trusting.close()
            strict = Pool()  # the system's CAs do not know this certificate
            with pytest.raises(UpstreamError, match="CERTIFICATE_VERIFY_FAILED"):
                await strict.request("POST", url, {}, b"{}")
            await strict.close()
        finally:
            server.close()

    asyncio.run(test())
