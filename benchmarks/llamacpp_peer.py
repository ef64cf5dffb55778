"""llama.cpp speed peer: times greedy generation through llama-cpp-python, one request at a time.

Runs in its own venv (`.bench-venv`, see docs/benchmarks.md), as a subprocess of
bench_engine.py, so the model loads once and the parent can alternate peers. Protocol: one
JSON object per line on stdin, `{"prompts": [[token ids], ...], "max_tokens": N}`; one JSON
object per line on stdout, with the wall time of the whole list and, per request, the time
to the first token, the total time and the generated token ids. The first line written is
`{"ready": true, ...}` once the model has loaded. EOF on stdin ends it.

    .bench-venv/bin/python benchmarks/llamacpp_peer.py MODEL.gguf --threads 2 --n-ctx 512
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def parse_args() -> argparse.Namespace:
    """Command line: the GGUF path and llama.cpp's context settings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="GGUF file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=512)
    return parser.parse_args()


def load(args: argparse.Namespace) -> Any:
    """The llama.cpp model with a batch big enough for any prompt to prefill in one call."""
    from llama_cpp import Llama

    return Llama(
        model_path=args.model,
        n_ctx=args.n_ctx,
        n_batch=args.n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        seed=0,
        verbose=False,
    )


def generate_one(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy tokens for one prompt, ignoring EOS, with time to first token and total time."""
    llm.reset()  # forget the previous request's KV cache, so no prefix is reused
    tokens: list[int] = []
    start = time.perf_counter()
    first = 0.0
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == 1:
            first = time.perf_counter() - start
        if len(tokens) == max_tokens:
            break
    total = time.perf_counter() - start
    return {"first_token_s": first, "total_s": total, "token_ids": tokens}


def serve(llm: Any) -> None:
    """Answer one timing request per stdin line until EOF."""
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        start = time.perf_counter()
        results = [generate_one(llm, p, request["max_tokens"]) for p in request["prompts"]]
        reply = {"wall_s": time.perf_counter() - start, "requests": results}
        print(json.dumps(reply), flush=True)


def main() -> None:
    """Load the model, announce readiness (or the reason it failed), then serve requests."""
    args = parse_args()
    start = time.perf_counter()
    try:
        import llama_cpp

        llm = load(args)
    except Exception as e:  # reported to the parent, which marks the peer not available
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)
    ready = {"ready": True, "load_s": time.perf_counter() - start}
    ready["version"] = getattr(llama_cpp, "__version__", "unknown")
    print(json.dumps(ready), flush=True)
    serve(llm)


if __name__ == "__main__":
    main()
