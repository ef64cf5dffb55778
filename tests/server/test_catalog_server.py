"""`infire serve --catalog`: models loaded on demand within a memory budget, each in its
own engine process, and Workers AI's catalog routes.

Two catalog entries may share one checkpoint: each entry is its own engine process, so
the budget sees two models (and their outputs must agree)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from harness import Server, assert_openai_error

from tiny_models import MINILM

ENGINE = '[model.engine]\ndtype = "float32"\nkv_cache_memory = "16MiB"\n'
PROMPT = {"prompt": "the cat sat", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _catalog(path: Path, entries: list[tuple[str, str, Path, str]]) -> Path:
    text = ""
    for name, task, source, extra in entries:
        text += f'[[model]]\nname = "{name}"\ntask = "{task}"\nsource = "{source}"\n{extra}\n'
    path.write_text(text)
    return path


def _serve(catalog: Path, budget: str, log: Path) -> Server:
    return Server(["--catalog", str(catalog), "--memory-budget", budget], log)


def _status(server: Server) -> dict[str, dict]:
    models = httpx.get(f"{server.base_url}/models", timeout=10).json()["data"]
    return {m["id"]: m["load"] for m in models}


def _complete(server: Server, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", json={**PROMPT, "model": model, **extra},
                      timeout=120)  # fmt: skip


def _engine_processes(server: Server) -> list[str]:
    """Command lines of the server's engine processes: engine cores and encoders, and the
    spare one (`infire.engine.spare`) that the next on-demand load runs in."""
    children = psutil.Process(server.pid).children(recursive=True)
    lines = []
    for child in children:
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "-m infire.engine." in line:
            lines.append(line)
    return lines


@pytest.fixture(scope="module")
def one_fits(tiny_long: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A budget that holds one tiny engine process (about 270 MiB here; CI's machines have
    measured up to 100 MiB more) but not two, and a third entry whose KV reservation alone
    is over the budget."""
    folder = tmp_path_factory.mktemp("one-fits")
    huge = '[model.engine]\ndtype = "float32"\nkv_cache_memory = "2GiB"\n'
    catalog = _catalog(folder / "catalog.toml", [
        ("tiny-a", "text-generation", tiny_long, ENGINE),
        ("tiny-b", "text-generation", tiny_long, ENGINE),
        ("tiny-huge", "text-generation", tiny_long, huge),
    ])  # fmt: skip
    server = _serve(catalog, "480MiB", folder / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def roomy(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Room for every entry: a generative model kept warm, two cold ones, an encoder."""
    folder = tmp_path_factory.mktemp("roomy")
    aliases = 'aliases = ["@cf/infire/tiny-warm"]\ndescription = "warm tiny llama"\n'
    catalog = _catalog(folder / "catalog.toml", [
        ("tiny-warm", "text-generation", tiny_llama, aliases + ENGINE),
        ("tiny-cold", "text-generation", tiny_llama, 'aliases = ["@cf/other/tiny-cold"]\n' + ENGINE),
        ("tiny-crowd", "text-generation", tiny_llama, ENGINE),
        ("minilm", "text-embeddings", MINILM, 'aliases = ["@cf/sentence-transformers/minilm"]\n'),
    ])  # fmt: skip
    server = _serve(catalog, "8GiB", folder / "server.log")
    yield server
    server.stop()


def test_alternating_models_evict_each_other_under_the_budget(one_fits: Server) -> None:
    before = _status(one_fits)
    texts = []
    for model in ("tiny-a", "tiny-b", "tiny-a", "tiny-b"):
        response = _complete(one_fits, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        texts.append(response.json()["choices"][0]["text"])
    assert len(set(texts)) == 1  # one checkpoint, greedy: the same tokens from each engine
    after = _status(one_fits)
    loads = {m: after[m]["loads"] - before[m]["loads"] for m in ("tiny-a", "tiny-b")}
    evictions = {m: after[m]["evictions"] - before[m]["evictions"] for m in ("tiny-a", "tiny-b")}
    assert loads == {"tiny-a": 2, "tiny-b": 2}
    assert evictions["tiny-a"] == 2 and evictions["tiny-b"] == 1
    assert after["tiny-b"]["state"] == "ready" and after["tiny-a"]["state"] == "unloaded"
    # The evicted engines' processes are gone: tiny-b's and the spare are left.
    assert len(_engine_processes(one_fits)) == 2
    metrics = one_fits.metrics()
    assert metrics["infire:model_loads_total"] >= 4
    assert metrics["infire:model_evictions_total"] >= 3
    # The measured footprint replaced the estimate, and it is what the budget counts.
    assert after["tiny-b"]["measured_bytes"] == after["tiny-b"]["bytes"] > 100 * 2**20
    assert metrics["infire:memory_used_bytes"] == after["tiny-b"]["bytes"]


def test_no_eviction_while_a_stream_runs(one_fits: Server) -> None:
    assert _complete(one_fits, "tiny-a").status_code == 200  # tiny-a resident
    before = _status(one_fits)
    body = {**PROMPT, "model": "tiny-a", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{one_fits.base_url}/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        # tiny-b needs tiny-a's room, and tiny-a is busy: 429 now, never an eviction.
        refused = _complete(one_fits, "tiny-b")
        error = assert_openai_error(refused, 429)
        assert error["code"] == "model_capacity_exceeded" and "tiny-a" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        workers = httpx.post(f"{one_fits.url}/ai/run/tiny-b", json={"prompt": "hi"}, timeout=60)
        assert workers.status_code == 429 and workers.headers["retry-after"]
        assert workers.json()["errors"][0]["code"] == 3040
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert _status(one_fits)["tiny-a"]["evictions"] == before["tiny-a"]["evictions"]
    # Once the stream is over, tiny-a is idle and gives way.
    assert _complete(one_fits, "tiny-b").status_code == 200
    assert _status(one_fits)["tiny-a"]["evictions"] == before["tiny-a"]["evictions"] + 1


def test_a_model_over_the_budget_gets_429_and_the_server_stays_up(one_fits: Server) -> None:
    refused = _complete(one_fits, "tiny-huge")
    error = assert_openai_error(refused, 429)
    assert "memory budget is 480 MiB" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    workers = httpx.post(f"{one_fits.url}/ai/run/tiny-huge", json={"prompt": "hi"}, timeout=60)
    envelope = workers.json()
    assert workers.status_code == 429 and envelope["success"] is False
    assert envelope["errors"][0]["code"] == 3040
    assert httpx.get(f"{one_fits.url}/health").status_code == 200
    assert _status(one_fits)["tiny-huge"]["state"] == "unloaded"
    assert one_fits.metrics()["infire:capacity_refusals_total"] >= 2
    assert _complete(one_fits, "tiny-a").status_code == 200  # others still load and serve


def test_a_resident_model_answers_while_another_loads(roomy: Server) -> None:
    assert _complete(roomy, "tiny-warm").status_code == 200
    cold: dict[str, object] = {}

    def load_cold() -> None:
        cold["response"] = _complete(roomy, "tiny-cold")
        cold["end"] = time.monotonic()

    thread = threading.Thread(target=load_cold)
    thread.start()
    deadline = time.monotonic() + 30
    while _status(roomy)["tiny-cold"]["state"] != "loading":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    warm = _complete(roomy, "@cf/infire/tiny-warm")
    warm_end = time.monotonic()
    still_loading = _status(roomy)["tiny-cold"]["state"] == "loading"
    thread.join(60)
    assert warm.status_code == 200 and cold["response"].status_code == 200
    assert still_loading and warm_end < cold["end"]


def test_concurrent_first_requests_share_one_load(roomy: Server) -> None:
    responses: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: responses.append(_complete(roomy, "tiny-crowd")))
               for _ in range(10)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [r.status_code for r in responses] == [200] * 10
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1
    status = _status(roomy)["tiny-crowd"]
    assert status["loads"] == 1 and status["load_failures"] == 0 and status["state"] == "ready"


def test_an_encoder_runs_in_its_own_process(roomy: Server) -> None:
    before = len(_engine_processes(roomy))
    response = httpx.post(f"{roomy.base_url}/embeddings",
                          json={"model": "minilm", "input": ["a", "b"]}, timeout=60)  # fmt: skip
    assert response.status_code == 200 and len(response.json()["data"]) == 2
    assert len(_engine_processes(roomy)) == before + 1  # its process, and a new spare
    measured = _status(roomy)["minilm"]["measured_bytes"]
    assert measured is not None and measured > 50 * 2**20
    # A generative model is not an encoder, and the other way round: 400 naming the model.
    wrong = httpx.post(f"{roomy.base_url}/embeddings",
                       json={"model": "tiny-warm", "input": "a"}, timeout=60)  # fmt: skip
    assert "generates text" in assert_openai_error(wrong, 400, "model")["message"]
    wrong = _complete(roomy, "minilm")
    assert "text embeddings" in assert_openai_error(wrong, 400, "model")["message"]


def test_models_search_filters_and_pages(roomy: Server) -> None:
    def search(**query: object) -> dict:
        response = httpx.get(f"{roomy.url}/ai/models/search", params=query, timeout=10)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["success"] is True and body["errors"] == []
        return body

    everything = search()
    assert everything["result_info"]["total_count"] == 4
    assert [m["name"] for m in everything["result"]] == [
        "@cf/infire/tiny-warm", "@cf/other/tiny-cold", "tiny-crowd", "@cf/sentence-transformers/minilm"]  # fmt: skip
    first = everything["result"][0]
    assert first["task"]["name"] == "Text Generation" and first["description"] == "warm tiny llama"
    assert {"property_id": "context_window", "value": "256"} in first["properties"]
    embeddings = search(task="Text Embeddings")["result"]
    assert [m["name"] for m in embeddings] == ["@cf/sentence-transformers/minilm"]
    assert {p["property_id"]: p["value"] for p in embeddings[0]["properties"]} == {
        "max_input_tokens": "256", "output_dimensions": "384"}  # fmt: skip
    by_id = search(task=embeddings[0]["task"]["id"])["result"]
    assert [m["name"] for m in by_id] == ["@cf/sentence-transformers/minilm"]
    assert [m["name"] for m in search(task="text-generation", author="other")["result"]] == [
        "@cf/other/tiny-cold"]  # fmt: skip
    assert [m["name"] for m in search(search="WARM")["result"]] == ["@cf/infire/tiny-warm"]
    page = search(per_page=3, page=2)
    assert [m["name"] for m in page["result"]] == ["@cf/sentence-transformers/minilm"]
    assert page["result_info"] == {"page": 2, "per_page": 3, "count": 1, "total_count": 4}
    bad = httpx.get(f"{roomy.url}/ai/models/search", params={"per_page": 0}, timeout=10)
    assert bad.status_code == 400 and bad.json()["success"] is False


def test_models_schema_and_unknown_models(roomy: Server) -> None:
    schema = httpx.get(
        f"{roomy.url}/ai/models/schema", params={"model": "@cf/sentence-transformers/minilm"}
    )
    assert schema.status_code == 200
    result = schema.json()["result"]
    assert result["input"]["required"] == ["text"] and "shape" in result["output"]["properties"]
    generation = httpx.get(f"{roomy.url}/ai/models/schema", params={"model": "tiny-warm"}).json()
    assert {v["title"] for v in generation["result"]["input"]["oneOf"]} == {"Prompt", "Messages"}
    for response in (
        httpx.get(f"{roomy.url}/ai/models/schema", params={"model": "@cf/meta/llama-9"}),
        httpx.post(f"{roomy.url}/ai/run/@cf/meta/llama-9", json={"prompt": "hi"}),
    ):
        assert response.status_code == 400
        assert response.json()["errors"][0]["code"] == 5007
    missing = httpx.get(f"{roomy.url}/ai/models/schema")
    assert missing.status_code == 400 and missing.json()["errors"][0]["code"] == 400
    openai_404 = _complete(roomy, "@cf/meta/llama-9")
    assert assert_openai_error(openai_404, 404, "model")["code"] == "model_not_found"
