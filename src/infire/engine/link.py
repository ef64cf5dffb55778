"""A child process of the server and the two ZeroMQ sockets to it.

Both kinds of engine process use it: the generative engine core (engine/core.py,
MPEngineClient) and the encoder process (engine/encoder.py, MPEncoderClient). The front
binds a PUSH socket for commands and a PULL socket for outputs in a fresh temporary
folder, starts `python -m MODULE --input ... --output ... --parent-pid ... ARGS`, and
waits for the first message (ready or failed). Sending never blocks on a dead child: it
notices the exit and raises EngineDeadError. `close` stops the process (asking first,
then terminate, then kill) and removes the sockets.

A spare (`CoreLink.spare()`, kept by SparePool) is a child started ahead of need: it
imports torch and both engine modules, then waits on its stdin for the module and
arguments it is to run (`become`). A catalog server keeps one, so that loading a model
on demand does not pay the second of imports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import psutil

from infire.errors import EngineDeadError, ModelLoadError


class CoreLink:
    """`python -m module` as our child, with its command and output sockets."""

    def __init__(self, module: str, args: list[str]) -> None:
        """Start `python -m module` with `args` (`module` None: a spare, which is told its
        module later through `become`)."""
        import zmq

        self.folder = tempfile.mkdtemp(prefix="infire-core-")
        self.context = zmq.Context()
        self.inbox, self.outbox = self.context.socket(zmq.PULL), self.context.socket(zmq.PUSH)
        self.inbox.bind(f"ipc://{self.folder}/out")
        self.outbox.bind(f"ipc://{self.folder}/in")
        command = [
            sys.executable, "-m", module or "infire.engine.spare", "--input",
            f"ipc://{self.folder}/in", "--output", f"ipc://{self.folder}/out",
            "--parent-pid", str(os.getpid()), *args,
        ]  # fmt: skip
        stdin = subprocess.PIPE if module is None else subprocess.DEVNULL
        self.process = subprocess.Popen(command, stdin=stdin)
        self._send_lock = threading.Lock()
        self.closed = False

    @classmethod
    def spare(cls) -> CoreLink:
        """A child that imports the engine and waits to be told what to run."""
        return cls(None, [])  # type: ignore[arg-type]

    def become(self, module: str, args: list[str]) -> None:
        """Tell a spare which engine module to run, with which arguments."""
        import json

        self.process.stdin.write((json.dumps({"module": module, "args": args}) + "\n").encode())
        self.process.stdin.close()

    def first(self, timeout: float | None) -> bytes:
        """The child's first message (its ready or failed one); ModelLoadError when it exits
        or says nothing within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            if self.inbox.poll(100):
                return self.inbox.recv()
            if self.process.poll() is not None:
                raise ModelLoadError(
                    f"the engine process exited with {self.process.returncode} while starting"
                )
        raise ModelLoadError(f"the engine process did not start within {timeout}s")

    def send(self, data: bytes, on_dead: Callable[[str], None]) -> None:
        """Send to the child; a child that is gone calls `on_dead(reason)` and raises
        EngineDeadError instead of blocking (a PUSH socket without its peer waits forever)."""
        import zmq

        with self._send_lock:
            while True:
                try:
                    self.outbox.send(data, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if self.process.poll() is not None:
                        reason = self.exit_reason()
                        on_dead(reason)
                        raise EngineDeadError(f"engine died: {reason}") from None
                    time.sleep(0.001)  # the child is alive and behind: its queue is full

    def exit_reason(self) -> str:
        return f"the engine process (pid {self.process.pid}) exited with {self.process.returncode}"

    def receive_loop(
        self, deliver: Callable[[bytes], None], stopping: Callable[[], bool],
        on_exit: Callable[[str], None],
    ) -> None:  # fmt: skip
        """Hand each message to `deliver` until `stopping()`; notice within a tenth of a
        second when the child ends (`on_exit(reason)`)."""
        while not stopping():
            if self.inbox.poll(100):
                deliver(self.inbox.recv())
            elif self.process.poll() is not None and not stopping():
                on_exit(self.exit_reason())
                return

    def footprint(self) -> int:
        """Resident bytes of the child and its own children (worker ranks), now."""
        total = 0
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.process.pid)
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += process.memory_info().rss
        return total

    def close(self, goodbye: bytes | None = None) -> None:
        """Send `goodbye` if the child still runs, make sure it exits, remove the sockets."""
        if self.closed:
            return
        self.closed = True
        if goodbye is not None and self.process.poll() is None:
            with contextlib.suppress(EngineDeadError):
                self.send(goodbye, lambda reason: None)
        if self.process.stdin is not None and not self.process.stdin.closed:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # a spare never told its task: it exits
        stop_processes([self.process])
        self.context.destroy(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)


class SparePool:
    """At most one spare child, started when asked (`refill`), taken by the next start."""

    def __init__(self) -> None:
        self._spare: CoreLink | None = None
        self._lock = threading.Lock()

    def refill(self) -> None:
        """Start a spare unless one is there and alive."""
        with self._lock:
            if self._spare is None or self._spare.process.poll() is not None:
                if self._spare is not None:
                    self._spare.close()
                self._spare = CoreLink.spare()

    def start(self, module: str, args: list[str]) -> CoreLink:
        """`module` with `args` in the spare if there is one alive, else in a new child."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.process.poll() is None:
            spare.become(module, args)
            return spare
        if spare is not None:
            spare.close()
        return CoreLink(module, args)

    def close(self) -> None:
        """Stop the spare."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()


def exit_now(status: int) -> NoReturn:
    """End an engine process without the interpreter's teardown (torch's takes a few
    tenths of a second): the server waits for this exit before it loads another model
    in the memory freed. Logs are flushed first; sockets were closed by the caller."""
    logging.shutdown()
    os._exit(status)


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """Wait briefly for each process to exit, then terminate, then kill."""
    for stop in (None, "terminate", "kill"):
        alive = [p for p in processes if p.poll() is None]
        for process in alive if stop else []:
            getattr(process, stop)()
        for process in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)


def child_sockets(input_address: str, output_address: str) -> tuple:
    """The child's side: (context, inbox, outbox) connected to the front's sockets."""
    import zmq

    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    return context, inbox, outbox
