"""Startup and footprint of `infire gateway`: import time, time to ready, and the memory of
the started process, for the code as it is and for an earlier commit side by side.

Each source tree (this checkout's src/, and `git archive <before> src` unpacked in a
temporary folder) runs with the same interpreter (.venv) through PYTHONPATH:

- import time: in a fresh interpreter, the seconds to import what `infire gateway` imports
  before it serves (`infire.cli`, `infire.gateway`, `uvicorn`), and which heavy modules
  (torch, numpy, tokenizers, gguf, FastAPI, pydantic) came with them; the median of --runs;
- a started process: `python -m infire.cli gateway` on a free port, its time from spawn to
  the first 200 of /health, its resident memory (VmRSS) then, and again after --requests
  chat completions relayed to the gateway tests' fault upstream (8 at a time, each logged
  to SQLite); the median of --starts.

Results: benchmarks/results/gateway-startup.json, a Markdown table on stdout and a chart
(docs/benchmarks-gateway-startup.png). `make bench-gateway` runs it after bench_gateway.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gateway"))

from bench_gateway import KEY, write_gateway_config  # noqa: E402
from fault_upstream import FaultUpstream  # noqa: E402

from infire.serverproc import ServerProcess, free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BEFORE = "effc051"  # the last commit whose gateway imported the engine (issue 19)
HEAVY = ("torch", "numpy", "tokenizers", "gguf", "fastapi", "pydantic")
TARGETS = {"import_s": 0.3, "rss_start_mb": 80.0}  # issue 19's
_IMPORT = f"""
import sys, time
start = time.perf_counter()
import infire.cli, infire.gateway, uvicorn
seconds = time.perf_counter() - start
import json, infire
print(json.dumps({{"seconds": seconds, "file": infire.__file__,
                  "heavy": [m for m in {HEAVY!r} if m in sys.modules],
                  "modules": len(sys.modules)}}))
"""


@dataclass(frozen=True, slots=True)
class Figures:
    """One source tree's medians."""

    label: str
    import_s: float
    heavy: list[str]
    modules: int
    ready_s: float
    rss_start_mb: float
    rss_after_mb: float
    requests: int


def import_run(src: Path) -> dict:
    """One fresh interpreter importing the gateway's modules from src."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", _IMPORT], env=env, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["file"].startswith(str(src)):
        raise RuntimeError(f"imported infire from {result['file']}, not from {src}")
    return result


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for process {pid}")


async def relay_requests(url: str, count: int, concurrency: int = 8) -> None:
    """count chat completions through the gateway, `concurrency` at a time."""
    body = {"model": "up/fault-model", "messages": [{"role": "user", "content": "hello there"}]}
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=30) as client:

        async def worker(n: int) -> None:
            for _ in range(n):
                response = await client.post(f"{url}/bench/compat/chat/completions", json=body)
                response.raise_for_status()

        shares = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]
        await asyncio.gather(*(worker(n) for n in shares))


def start_run(src: Path, config: Path, requests: int) -> tuple[float, float, float]:
    """(seconds to ready, RSS at ready, RSS after the requests) of one gateway process."""
    port = free_port()
    command = [sys.executable, "-m", "infire.cli", "gateway", "--config", str(config),
               "--port", str(port), "--no-access-log"]  # fmt: skip
    started = time.perf_counter()
    with ServerProcess("infire gateway", command, port, f"http://127.0.0.1:{port}/health",
                       env={"PYTHONPATH": str(src)}, poll_s=0.01) as gateway:  # fmt: skip
        ready_s = time.perf_counter() - started
        at_start = rss_mb(gateway.pid)
        asyncio.run(relay_requests(f"http://127.0.0.1:{port}", requests))
        return ready_s, at_start, rss_mb(gateway.pid)


def measure(label: str, src: Path, upstream: FaultUpstream, folder: Path,
            args: argparse.Namespace) -> Figures:  # fmt: skip
    imports = [import_run(src) for _ in range(args.runs)]
    starts = []
    for i in range(args.starts):
        run_folder = folder / f"{label}-{i}"
        run_folder.mkdir(parents=True)
        starts.append(start_run(src, write_gateway_config(run_folder, upstream), args.requests))
        print(f"{label}: start {i + 1}/{args.starts}: ready in {starts[-1][0]:.2f} s, "
              f"{starts[-1][1]:.1f} MB", file=sys.stderr)  # fmt: skip
    ready, at_start, after = (statistics.median(column) for column in zip(*starts, strict=True))
    return Figures(label, statistics.median(r["seconds"] for r in imports), imports[0]["heavy"],
                   imports[0]["modules"], ready, at_start, after, args.requests)  # fmt: skip


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def unpack(rev: str, folder: Path) -> Path:
    """src/ of commit rev, unpacked into folder (git archive: no worktree, no git state)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"],
                             capture_output=True, check=True).stdout  # fmt: skip
    path = folder / "archive.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(folder / rev, filter="data")
    return folder / rev / "src"


def table(rows: list[Figures]) -> str:
    lines = ["| code | import s | heavy modules imported | modules | ready s | RSS at start MB | "
             "RSS after requests MB |", "|---|--:|---|--:|--:|--:|--:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.label} | {r.import_s:.3f} | {', '.join(r.heavy) or 'none'} | "
                     f"{r.modules} | {r.ready_s:.2f} | {r.rss_start_mb:.1f} | "
                     f"{r.rss_after_mb:.1f} ({r.requests} requests) |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[Figures], path: Path, title: str) -> None:
    """Import time and RSS per source tree, with the targets."""
    from infire.bench.plot import pyplot, save

    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    colors = ["#94a3b8", "#f97316"][-len(rows) :]
    labels = [r.label for r in rows]
    bars = left.bar(labels, [r.import_s for r in rows], color=colors)
    left.bar_label(bars, [f"{r.import_s:.3f} s" for r in rows], fontsize=8)
    left.axhline(TARGETS["import_s"], color="black", linestyle="--", linewidth=1,
                 label=f"target {TARGETS['import_s']} s")  # fmt: skip
    left.set_title("import time (s, lower is better)", fontsize=10)
    left.legend(fontsize=8)
    width = 0.38
    for k, (field, name) in enumerate((("rss_start_mb", "at start"),
                                       ("rss_after_mb", f"after {rows[0].requests} requests"))):  # fmt: skip
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        bars = right.bar(xs, [getattr(r, field) for r in rows], width, color=colors,
                         alpha=1.0 if k == 0 else 0.55, label=name)  # fmt: skip
        right.bar_label(bars, [f"{getattr(r, field):.0f}" for r in rows], fontsize=8)
    right.axhline(TARGETS["rss_start_mb"], color="black", linestyle="--", linewidth=1,
                  label=f"target {TARGETS['rss_start_mb']:.0f} MB at start")  # fmt: skip
    right.set_xticks(range(len(rows)), labels)
    right.set_title("gateway process RSS (MB; solid: at start, light: after requests)",
                    fontsize=10)  # fmt: skip
    right.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    save(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE,
                        help=f"the earlier commit to compare with ('none': skip; default {BEFORE})")  # fmt: skip
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters per import time")
    parser.add_argument("--starts", type=int, default=3, help="gateway processes per tree")
    parser.add_argument("--requests", type=int, default=1000, help="relayed after each start")
    parser.add_argument(
        "--plot", type=Path, default=ROOT / "docs" / "benchmarks-gateway-startup.png"
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gateway-startup-") as tmp, FaultUpstream() as up:
        folder = Path(tmp)
        if args.before != "none":
            rows.append(measure(f"before ({args.before})", unpack(args.before, folder), up,
                                folder, args))  # fmt: skip
        rows.append(measure("now", ROOT / "src", up, folder, args))
    machine = f"{cpu_name()}, {os.cpu_count()} cores"
    title = (f"infire gateway startup and footprint, Python {platform.python_version()}, "
             f"{machine}")  # fmt: skip
    out = RESULTS / "gateway-startup.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "title": title, "targets": TARGETS,
                               "rows": [asdict(r) for r in rows]}, indent=1))  # fmt: skip
    print(table(rows))
    plot(rows, args.plot, title)
    print(f"saved {out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
