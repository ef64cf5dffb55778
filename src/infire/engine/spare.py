"""A spare engine process (`python -m infire.engine.spare`, started by link.SparePool).

It imports torch and both engine processes' modules, then reads one JSON line from its
stdin, `{"module": ..., "args": [...]}`, and runs that module's `main` with its own
socket arguments and those: it becomes an engine core or an encoder process without
paying the imports at that moment. It dies with its parent, like the others.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys

import infire.engine.core  # noqa: F401 (imported ahead of need: that is the point)
import infire.engine.encoder  # noqa: F401
from infire.engine.core import die_with_parent
from infire.engine.link import exit_now

ENGINE_MODULES = ("infire.engine.core", "infire.engine.encoder")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infire-spare")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when we stop
    die_with_parent(args.parent_pid)
    line = sys.stdin.readline()
    if not line:  # the front closed us without a task
        return 0
    task = json.loads(line)
    if task.get("module") not in ENGINE_MODULES:
        raise SystemExit(f"infire spare: not an engine module: {task.get('module')!r}")
    module = importlib.import_module(task["module"])
    own = ["--input", args.input, "--output", args.output, "--parent-pid", str(args.parent_pid)]
    return module.main(own + [str(a) for a in task["args"]])


if __name__ == "__main__":
    exit_now(main())
