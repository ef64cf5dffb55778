"""`infire serve` with an encoder model: all-MiniLM-L6-v2 embeddings over OpenAI's
/v1/embeddings (the `openai` client, base64 by default) and Workers AI's /ai/run,
against sentence-transformers; a tiny random reranker and classifier over /v1/rerank and
/ai/run against transformers; and the errors of each route."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from harness import Server, assert_openai_error

from tiny_models import MINILM, write_tiny_bert_classifier

NAME = "all-minilm-l6-v2"
SENTENCES = [
    "The cat sat on the mat.", "A quick brown fox jumps over the lazy dog!",
    "Embeddings map text to vectors.", "¿Dónde está la biblioteca?", "naïve café résumé",
    "42", "What is the capital of France?", "Paris is the capital of France.",
    "I love pizza, pasta and gelato.", "The stock market fell sharply on Monday.",
    "Quantum computers use qubits.", "She sells sea shells by the sea shore.",
    "Tokyo", "🙂 emoji are tokens too", "def add(a, b): return a + b",
    "The mitochondria is the powerhouse of the cell.", "Rain, rain, go away.",
    "A very long sentence " + "that keeps going " * 200, "short", "Hello, world.",
]  # fmt: skip


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(MINILM), device="cpu")
    return model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=False)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(["--model", str(MINILM), "--served-model-name", NAME],
                    tmp_path_factory.mktemp("embed") / "server.log")  # fmt: skip
    yield server
    server.stop()


def _cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)


def test_openai_client_embeddings_base64_batched_and_alone(embed_server, reference) -> None:
    client = openai.OpenAI(base_url=embed_server.base_url, api_key="none", max_retries=0)
    batched = client.embeddings.create(model=NAME, input=SENTENCES)  # base64 on the wire
    assert [d.index for d in batched.data] == list(range(len(SENTENCES)))
    got = np.array([d.embedding for d in batched.data])
    assert got.shape == (20, 384)
    assert _cosines(got, reference).min() >= 0.999
    alone = np.array([client.embeddings.create(model=NAME, input=s).data[0].embedding
                      for s in SENTENCES[:5]])  # fmt: skip
    assert _cosines(alone, reference[:5]).min() >= 0.999
    # the server runs --dtype auto: bfloat16 where the CPU has native bf16 matmuls, in
    # which a text's batch changes the rounding a little
    assert _cosines(alone, got[:5]).min() >= 0.9999
    assert batched.usage.prompt_tokens == batched.usage.total_tokens > 256


def test_float_format_token_ids_and_dimensions(embed_server, reference) -> None:
    url = f"{embed_server.base_url}/embeddings"
    reply = httpx.post(url, json={"model": NAME, "input": SENTENCES[:3],
                                  "encoding_format": "float", "dimensions": 384})  # fmt: skip
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == NAME
    got = np.array([d["embedding"] for d in body["data"]])
    assert _cosines(got, reference[:3]).min() >= 0.999
    from tokenizers import Tokenizer

    # token ids are the text's own tokens; the server adds [CLS] and [SEP] as for text
    tokenizer = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128
    ids = tokenizer.encode(SENTENCES[0], add_special_tokens=False).ids
    by_ids = httpx.post(url, json={"model": NAME, "input": ids, "encoding_format": "float"})
    assert by_ids.status_code == 200, by_ids.text
    by_ids_vector = np.array([by_ids.json()["data"][0]["embedding"]])
    assert _cosines(by_ids_vector, got[:1])[0] >= 0.9999
    bad = httpx.post(url, json={"model": NAME, "input": "x", "dimensions": 128})
    assert "dimensions" in assert_openai_error(bad, 400, "dimensions")["message"]
    assert_openai_error(httpx.post(url, json={"model": "nope", "input": "x"}), 404, "model")
    assert_openai_error(httpx.post(url, json={"model": NAME, "input": []}), 400, "input")
    chat = httpx.post(f"{embed_server.base_url}/chat/completions",
                      json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert "not text generation" in assert_openai_error(chat, 400, "model")["message"]
    models = httpx.get(f"{embed_server.base_url}/models").json()["data"]
    assert [m["id"] for m in models] == [NAME] and models[0]["max_model_len"] == 256


def test_workers_ai_embeddings(embed_server, reference) -> None:
    url = f"{embed_server.url}/ai/run/@cf/sentence-transformers/{NAME}"
    reply = httpx.post(url, json={"text": SENTENCES})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["success"] is True and body["errors"] == []
    result = body["result"]
    assert result["shape"] == [20, 384] and result["pooling"] == "mean"
    assert _cosines(np.array(result["data"]), reference).min() >= 0.999
    one = httpx.post(url, json={"text": SENTENCES[1]}).json()["result"]
    assert one["shape"] == [1, 384]
    cls = httpx.post(url, json={"text": SENTENCES[1], "pooling": "cls"}).json()["result"]
    assert cls["pooling"] == "cls" and _cosines(np.array(cls["data"]), reference[1:2])[0] < 0.999
    bad = httpx.post(url, json={"text": ""})
    assert bad.status_code == 400 and bad.json()["success"] is False


def _tiny_cross_encoder(folder: Path, num_labels: int) -> Path:
    labels = ["LABEL_0"] if num_labels == 1 else ["neg", "neu", "pos"]
    return write_tiny_bert_classifier(folder, seed=num_labels, num_labels=num_labels,
                                      id2label=dict(enumerate(labels)))  # fmt: skip


@pytest.fixture(scope="module")
def cross_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("cross")
    folders = {"rerank": _tiny_cross_encoder(tmp / "rerank", 1),
               "classify": _tiny_cross_encoder(tmp / "classify", 3)}  # fmt: skip
    servers = {}
    try:
        for task, folder in folders.items():
            servers[task] = Server(["--model", str(folder), "--served-model-name", task,
                                    "--dtype", "float32"],  # scores within 1e-5
                                   tmp / f"{task}.log")  # fmt: skip
        yield {"servers": servers, "folders": folders}
    finally:
        for server in servers.values():
            server.stop()


def _transformers_logits(folder: Path, first: list[str], second: list[str] | None) -> np.ndarray:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    batch = tokenizer(first, second, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.numpy()


def test_rerank_over_both_apis(cross_servers) -> None:
    server, folder = cross_servers["servers"]["rerank"], cross_servers["folders"]["rerank"]
    query, documents = "what is a fox?", ["A fox is an animal.", "Paris", "foxes hunt at night"]
    # scores as sentence-transformers' CrossEncoder gives them: sigmoid of the one logit
    expected = torch.sigmoid(
        torch.tensor(_transformers_logits(folder, [query] * 3, documents)[:, 0])
    ).numpy()
    reply = httpx.post(f"{server.base_url}/rerank", json={"model": "rerank", "query": query,
                                                          "documents": documents, "top_n": 2})  # fmt: skip
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    order = list(np.argsort(-expected)[:2])
    assert [r["index"] for r in results] == order
    for r in results:
        assert r["relevance_score"] == pytest.approx(float(expected[r["index"]]), abs=1e-5)
        assert r["document"]["text"] == documents[r["index"]]
    ai = httpx.post(f"{server.url}/ai/run/rerank", json={
        "query": query, "contexts": [{"text": d} for d in documents]}).json()  # fmt: skip
    assert ai["success"] and [x["id"] for x in ai["result"]["response"]] == list(
        np.argsort(-expected)
    )
    for x in ai["result"]["response"]:
        assert x["score"] == pytest.approx(float(expected[x["id"]]), abs=1e-5)


def test_classification_over_workers_ai(cross_servers) -> None:
    server, folder = cross_servers["servers"]["classify"], cross_servers["folders"]["classify"]
    text = "I really enjoyed this film."
    probs = torch.softmax(torch.tensor(_transformers_logits(folder, [text], None)[0]), -1)
    reply = httpx.post(f"{server.url}/ai/run/classify", json={"text": text})
    assert reply.status_code == 200, reply.text
    labels = reply.json()["result"]
    assert [x["label"] for x in labels] == [
        ["neg", "neu", "pos"][i] for i in probs.argsort(descending=True)
    ]
    for x in labels:
        assert x["score"] == pytest.approx(
            float(probs[["neg", "neu", "pos"].index(x["label"])]), abs=1e-5
        )
    wrong = httpx.post(f"{server.base_url}/rerank", json={"model": "classify", "query": "q",
                                                          "documents": ["d"]})  # fmt: skip
    assert "does classify, not rerank" in assert_openai_error(wrong, 400, "model")["message"]
