"""`infire bench serve`: a load generator for any OpenAI-compatible server.

Sends streamed completion (or chat) requests with prompts of a given length (random
words drawn from the model's vocabulary, or a prompt file), either all at once under
`--max-concurrency` or as Poisson arrivals at `--request-rate`, after a few warm-up
requests. Per request it records the time to the first token, the gaps between
streamed chunks, the end-to-end latency and the token counts (from `usage` when the
server sends it, else one token per streamed chunk). The run's summary follows vLLM's
`benchmark_serving` definitions:

- TTFT: request sent -> first chunk with text (or the finishing chunk, if none had text).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one token.
- ITL: every gap between two chunks with text.
- goodput: requests per second that met every `--goodput` SLO (ttft, tpot, e2el; ms).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from infire.errors import InvalidRequestError

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class BenchConfig:
    """One benchmark run: where, what to send, and how fast."""

    base_url: str
    model: str
    prompts: list[str]
    output_len: int
    warmup_prompts: list[str] = field(default_factory=list)  # distinct: no prefix-cache help
    prompt_tokens: list[int] = field(default_factory=list)  # local counts, where no usage
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request
    endpoint: str = "completions"  # or "chat"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms
    label: str = "server"
    seed: int = 0
    timeout: float = 600.0
    # in run_many: keep sending the prompts (in turn, max_concurrency at a time) until
    # the other loads are done, so that this load covers their whole span
    until_others_finish: bool = False


@dataclass(slots=True)
class RequestResult:
    """What one request measured (times in seconds)."""

    success: bool
    start: float = 0.0  # seconds since the run began
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def random_prompts(tokenizer: Any, num: int, input_len: int, seed: int) -> list[str]:
    """`num` prompts of about `input_len` tokens each: random whole words of the vocabulary."""
    vocab = tokenizer.backend.get_vocab()
    words, chars = [], []
    for token_id in sorted(vocab.values()):
        text = tokenizer.decode([token_id])
        if len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
            words.append(token_id)
        elif len(text) == 1 and text.isascii() and text.isprintable():
            chars.append(token_id)
    words = words if len(words) >= 100 else chars  # a tiny vocabulary: single characters
    if not words:
        raise InvalidRequestError("the tokenizer has no word or character tokens to draw from")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        ids = tokenizer.encode(tokenizer.decode(rng.choices(words, k=input_len)))[:input_len]
        prompts.append(tokenizer.decode(ids).strip())
    return prompts


def file_prompts(path: Path, num: int) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with a "prompt" field; cycled to num."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise InvalidRequestError(f"{path}: cannot read the prompt file: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if path.suffix == ".jsonl":
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise InvalidRequestError(
                    f'{path}:{number}: expected a JSON object with a "prompt" field'
                ) from None
        else:
            prompts.append(line)
    if not prompts:
        raise InvalidRequestError(f"{path}: the prompt file has no prompts")
    return [prompts[i % len(prompts)] for i in range(num)]


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise InvalidRequestError(f"--goodput {item!r}: the metric must be ttft, tpot or e2el")
        try:
            slos[name] = float(value)
        except ValueError:
            raise InvalidRequestError(f"--goodput {item!r}: expected NAME:MILLISECONDS") from None
    return slos


def _body(config: BenchConfig, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": config.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text += (delta.get("content") or "") if delta is not None else (choice.get("text") or "")
    return text


async def send(client: httpx.AsyncClient, config: BenchConfig, prompt: str) -> RequestResult:
    """One streamed request, timed."""
    path = "/chat/completions" if config.endpoint == "chat" else "/completions"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    result = RequestResult(success=False)
    start = time.perf_counter()
    last = None
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", config.base_url.rstrip("/") + path,
                                 json=_body(config, prompt), headers=headers) as response:  # fmt: skip
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                if not _chunk_text(chunk):
                    if last is None and any(
                        c.get("finish_reason") for c in chunk.get("choices") or []
                    ):
                        last = time.perf_counter()  # tokens without text (special, partial)
                        result.ttft = last - start
                        chunks = 1
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2el = time.perf_counter() - start
    if last is None:
        result.error = "the stream carried no text"
        return result
    result.output_tokens = (usage or {}).get("completion_tokens") or chunks
    result.prompt_tokens = (usage or {}).get("prompt_tokens") or 0
    result.success = True
    return result


async def _run(config: BenchConfig, progress: bool) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout)
    semaphore = asyncio.Semaphore(config.max_concurrency or len(config.prompts) or 1)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        warm = config.warmup_prompts
        warmups = await asyncio.gather(*(send(client, config, p) for p in warm))
        failed = [w for w in warmups if not w.success]
        if failed:
            raise InvalidRequestError(f"warm-up request failed: {failed[0].error}")

        bar = tqdm(total=len(config.prompts), desc=f"bench {config.label}", disable=not progress)
        rng = random.Random(config.seed)
        began = time.perf_counter()

        async def one(i: int, prompt: str) -> RequestResult:
            async with semaphore:
                sent = time.perf_counter() - began
                result = await send(client, config, prompt)
            result.start = sent
            if result.success and not result.prompt_tokens and config.prompt_tokens:
                result.prompt_tokens = config.prompt_tokens[i]  # the server sent no usage
            bar.update(1)
            return result

        tasks = []
        for i, prompt in enumerate(config.prompts):
            if i and math.isfinite(config.request_rate):
                await asyncio.sleep(rng.expovariate(config.request_rate))
            tasks.append(asyncio.ensure_future(one(i, prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - began
        bar.close()
    return list(results), duration


def _stats(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"mean": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ms = np.asarray(values_s) * 1000
    return {"mean": float(ms.mean()), "std": float(ms.std()),
            **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}  # fmt: skip


def latency_series(results: list[RequestResult]) -> dict[str, list[float]]:
    """TTFT, TPOT, ITL and E2E samples (seconds) of the successful requests."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }


def summarize(config: BenchConfig, results: list[RequestResult], duration: float) -> dict:
    """The run's JSON: its settings, the summary (vLLM's names) and every request."""
    ok = [r for r in results if r.success]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    series = latency_series(results)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
    }
    for name in METRICS:
        for stat, value in _stats(series[name]).items():
            summary[f"{stat}_{name}_ms"] = value
    if config.goodput:
        good = sum(1 for r in ok if _meets(r, config.goodput))
        summary["goodput"] = good / duration
    settings = asdict(config)
    settings.pop("prompts")
    settings["prompt_tokens"] = "server usage, else the local tokenizer's count"
    settings["num_warmups"] = len(settings.pop("warmup_prompts"))
    settings["api_key"] = bool(config.api_key)
    settings["num_prompts"] = len(results)
    settings["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return {"settings": settings, "summary": summary, "requests": [asdict(r) for r in results]}


def _meets(result: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return all(values[name] * 1000 <= limit for name, limit in slos.items())


def run(config: BenchConfig, progress: bool = True) -> dict:
    """Run the benchmark and return its JSON-able result."""
    results, duration = asyncio.run(_run(config, progress))
    return summarize(config, results, duration)


def run_many(configs: list[BenchConfig], progress: bool = True) -> list[dict]:
    """Run several loads at once (a mixed workload: say, long prompts arriving while short
    ones stream); one result per config, each timed from its own start. Every load's
    warm-up requests run first, then all loads start together. A load with
    `until_others_finish` streams until every other load is done."""

    async def together() -> list[tuple[list[RequestResult], float]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            for config in configs:
                for prompt in config.warmup_prompts:
                    await send(client, config, prompt)
        warm = [dataclasses.replace(c, warmup_prompts=[]) for c in configs]
        stop = asyncio.Event()
        tasks = [asyncio.ensure_future(_run_until(c, stop) if c.until_others_finish
                                       else _run(c, progress)) for c in warm]  # fmt: skip
        await asyncio.gather(*(t for t, c in zip(tasks, warm, strict=True)
                               if not c.until_others_finish))  # fmt: skip
        stop.set()
        return await asyncio.gather(*tasks)

    runs = asyncio.run(together())
    return [summarize(c, results, d) for c, (results, d) in zip(configs, runs, strict=True)]


async def _run_until(config: BenchConfig, stop: asyncio.Event) -> tuple[list[RequestResult], float]:
    """`max_concurrency` clients sending the prompts in turn until `stop` is set; each ends
    its request in flight first."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(config.timeout)) as client:
        for prompt in config.warmup_prompts:
            await send(client, config, prompt)
        began = time.perf_counter()
        results: list[RequestResult] = []
        turn = iter(range(10**9))

        async def client_loop() -> None:
            while not stop.is_set():
                i = next(turn) % len(config.prompts)
                sent = time.perf_counter() - began
                result = await send(client, config, config.prompts[i])
                result.start = sent
                results.append(result)

        await asyncio.gather(*(client_loop() for _ in range(config.max_concurrency or 1)))
    return results, time.perf_counter() - began


def report(result: dict) -> str:
    """The summary as a table for the terminal."""
    s, settings = result["summary"], result["settings"]
    load = (f"max concurrency {settings['max_concurrency'] or 'unlimited'}, "
            f"request rate {settings['request_rate']}")  # fmt: skip
    lines = [
        f"{settings['label']}: {settings['num_prompts']} requests to {settings['base_url']} "
        f"({settings['endpoint']}, {load})",
        f"  successful / failed requests  {s['completed']} / {s['failed']}",
        f"  duration                      {s['duration_s']:.2f} s",
        f"  input / output tokens         {s['total_input_tokens']} / {s['total_output_tokens']}",
        f"  request throughput            {s['request_throughput']:.2f} req/s",
        f"  output token throughput       {s['output_throughput']:.1f} tok/s",
        f"  total token throughput        {s['total_token_throughput']:.1f} tok/s",
    ]
    if "goodput" in s:
        lines.append(f"  goodput                       {s['goodput']:.2f} req/s")
    lines.append("  ms                  mean      p50      p90      p99")
    for name in METRICS:
        values = "".join(f"{s[f'{stat}_{name}_ms']:9.1f}" for stat in ("mean", "p50", "p90", "p99"))
        lines.append(f"  {name.upper():<15}{values}")
    return "\n".join(lines)
