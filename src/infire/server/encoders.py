"""Routes of encoder models: embeddings, reranking and classification.

OpenAI: `POST /v1/embeddings` (input: a string, a list of strings, token ids or lists of
token ids, the text's own tokens: the model's special tokens are added as for text;
`encoding_format` float or base64, little-endian float32 as the `openai` client
decodes it, and its default; `dimensions` only where it is the model's own width).
Cohere / vLLM: `POST /v1/rerank` ({query, documents, top_n, return_documents} -> results
sorted by relevance_score). Workers AI: `/ai/run/{model}` takes each task's own input:
{text, pooling} -> {shape, data, pooling} for embeddings, {query, contexts, top_k} ->
{response: [{id, score}]} for rerankers, {text} -> [{label, score}] for classifiers.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from infire.errors import InvalidRequestError
from infire.server.errors import parse_body


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    """Cohere's and vLLM's rerank body."""

    model_config = ConfigDict(extra="ignore")

    model: str
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True


class WorkersAIEncoderRequest(BaseModel):
    """Workers AI's inputs of the encoder tasks (each task reads its own fields)."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    pooling: str | None = None
    query: str | None = None
    contexts: list[RerankDocument] | None = None
    top_k: int | None = Field(None, ge=1)


def _texts(value: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError("input must not be empty", param="input")
    if all(isinstance(x, int) for x in value):
        return [value]  # type: ignore[list-item]  # one list of token ids
    return value  # type: ignore[return-value]


def _encoded(vector: Any, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def build_router(current: Callable[[str], Awaitable[Any]]) -> APIRouter:
    """The OpenAI-side encoder routes over `await current(model)`: an EncoderEngine or an
    MPEncoderClient (it raises for a model that is not an encoder of this server)."""
    router = APIRouter(prefix="/v1")

    @router.post("/embeddings")
    async def embeddings(request: Request) -> dict:
        body = await parse_body(request, EmbeddingRequest)
        engine = await current(body.model)
        if body.encoding_format not in ("float", "base64"):
            raise InvalidRequestError("encoding_format must be float or base64",
                                      param="encoding_format")  # fmt: skip
        if body.dimensions is not None and body.dimensions != engine.dim:
            raise InvalidRequestError(
                f"{engine.name} embeds in {engine.dim} dimensions and cannot shorten them",
                param="dimensions",
            )
        inputs = _texts(body.input)
        if any(isinstance(x, str) and not x for x in inputs):
            raise InvalidRequestError("input strings must not be empty", param="input")
        vectors, tokens = await engine.embed(inputs)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]  # fmt: skip
        return {"object": "list", "data": data, "model": body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip

    @router.post("/rerank")
    async def rerank(request: Request) -> dict:
        body = await parse_body(request, RerankRequest)
        engine = await current(body.model)
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        scores, tokens = await engine.rerank(body.query, documents)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model,
                "usage": {"total_tokens": tokens}, "results": results}  # fmt: skip

    return router


async def workers_ai_run(engine: Any, request: Request) -> Any:
    """The `result` of /ai/run/{model} for an encoder model, in its task's shape."""
    body = await parse_body(request, WorkersAIEncoderRequest)
    if engine.task == "embed":
        if body.text is None or body.text == [] or body.text == "":
            raise InvalidRequestError("text is required", param="text")
        pooling = body.pooling or "mean"
        if pooling not in ("mean", "cls"):
            raise InvalidRequestError("pooling must be mean or cls", param="pooling")
        texts = [body.text] if isinstance(body.text, str) else body.text
        vectors, _ = await engine.embed(texts, pooling=pooling)
        return {"shape": list(vectors.shape), "data": vectors.tolist(), "pooling": pooling}
    if engine.task == "rerank":
        if not body.query or not body.contexts:
            raise InvalidRequestError("query and contexts are required", param="query")
        scores, _ = await engine.rerank(body.query, [c.text for c in body.contexts])
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_k]
        return {"response": [{"id": i, "score": scores[i]} for i in order]}
    if not isinstance(body.text, str) or not body.text:
        raise InvalidRequestError("text (a string) is required", param="text")
    labels, _ = await engine.classify([body.text])
    return [{"label": label, "score": score} for label, score in labels[0]]
