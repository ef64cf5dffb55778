"""The engine core: the loop that applies commands, steps the engine and emits deltas.

`run_core` is the same loop whether it runs in a thread beside the caller (the
in-process client) or in its own process (`python -m infire.engine.core`, started by
MPEngineClient): commands arrive through `receive`, StepOutputs leave through `emit`.
The process form talks msgpack over two ZeroMQ PUSH/PULL sockets, dies with its parent
(it watches its parent's pid), ignores Ctrl-C (its parent decides
when it stops) and reports a failed start as EngineFailed before exiting non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from infire.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from infire.engine.engine import LLMEngine
from infire.engine.link import child_sockets, exit_now
from infire.engine.messages import (
    AbortRequest,
    EngineFailed,
    EngineReady,
    GenerateRequest,
    Message,
    ReleaseKV,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)
from infire.errors import InvalidRequestError

logger = logging.getLogger("infire.engine.core")

# wait up to `timeout` seconds (None: for ever, 0: not at all) for at least one command
Receive = Callable[[float | None], list[Message]]
Emit = Callable[[StepOutputs], None]


def run_core(engine: LLMEngine, receive: Receive, emit: Emit) -> None:
    """Serve commands until Shutdown: add and abort requests, release KV leases, step
    while any runs. Idle, it wakes when the next lease expires (a prefill engine)."""
    while True:
        idle = engine.idle_timeout()  # frees expired leases
        commands = receive(0.0 if engine.has_unfinished_requests() else idle)
        deltas = []
        for command in commands:
            if isinstance(command, Shutdown):
                return
            if isinstance(command, ReleaseKV):
                engine.release_kv(command.lease_id)
            elif isinstance(command, AbortRequest):
                delta = engine.abort_request(command.request_id)
                deltas += [delta] if delta is not None else []
            elif isinstance(command, GenerateRequest):
                try:
                    engine.add(command)
                except InvalidRequestError as e:  # a duplicate id: the edge cannot know
                    logger.warning("request %s refused: %s", command.request_id, e)
        if engine.has_unfinished_requests():
            deltas += engine.step()
        emit(StepOutputs(deltas, engine.stats_snapshot()))


# --- the engine-core process --------------------------------------------------------------


def config_to_json(config: EngineConfig) -> str:
    """The engine config as JSON, for the core process's command line."""
    return json.dumps(
        {
            "model": config.model, "dtype": config.dtype, "device": config.device,
            "seed": config.seed, "cpu_kernels": config.cpu_kernels,
            "enforce_eager": config.enforce_eager,
            "quantization": config.quantization, "cache": _fields(config.cache), "scheduler": _fields(config.scheduler),
            "parallel": _fields(config.parallel), "disagg": _fields(config.disagg),
        }
    )  # fmt: skip


def config_from_json(text: str) -> EngineConfig:
    """The EngineConfig that `config_to_json` wrote."""
    raw = json.loads(text)
    return EngineConfig(
        model=raw["model"], dtype=raw["dtype"], device=raw["device"], seed=raw["seed"],
        cpu_kernels=raw["cpu_kernels"], quantization=raw["quantization"],
        enforce_eager=raw["enforce_eager"],
        cache=CacheConfig(**raw["cache"]),
        scheduler=SchedulerConfig(**raw["scheduler"]),
        parallel=ParallelConfig(**raw["parallel"]), disagg=DisaggConfig(**raw["disagg"]),
    )  # fmt: skip


def _fields(obj: object) -> dict:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


def die_with_parent(parent_pid: int) -> None:
    """Exit as soon as the process that started us is gone, however it ended.

    (Not PR_SET_PDEATHSIG: it fires when the parent *thread* that spawned us ends, and
    the server starts the core from a loader thread that ends once the model is up.)"""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="infire-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the engine-core process."""
    parser = argparse.ArgumentParser(prog="infire-engine-core")
    parser.add_argument("--input", required=True, help="ZeroMQ address the commands come from")
    parser.add_argument("--output", required=True, help="ZeroMQ address outputs go to")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front, which stops us
    die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _, inbox, outbox = child_sockets(args.input, args.output)
    try:
        engine = LLMEngine(config_from_json(args.config))
    except Exception as e:  # reported to the front, which shows it on /health
        outbox.send(encode(EngineFailed(str(e) or repr(e))))
        outbox.close(linger=2000)
        return 1
    outbox.send(encode(EngineReady(engine.model_info)))

    def receive(timeout: float | None) -> list[Message]:
        commands = []
        wait = None if timeout is None else int(timeout * 1000) + (timeout > 0)
        if inbox.poll(wait):
            commands.append(decode(inbox.recv()))
        while inbox.poll(0):
            commands.append(decode(inbox.recv()))
        return commands

    try:
        run_core(engine, receive, lambda outputs: outbox.send(encode(outputs)))
    finally:
        engine.shutdown()
    outbox.close(linger=1000)
    inbox.close(linger=0)
    return 0


if __name__ == "__main__":
    exit_now(main())
