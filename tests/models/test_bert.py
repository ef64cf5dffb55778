"""BERT-family encoders against their references: the real all-MiniLM-L6-v2 against
sentence-transformers, and tiny random rerankers and classifiers (BERT and XLM-RoBERTa)
against transformers' logits and CrossEncoder.predict, all in float32 on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from infire.errors import InvalidRequestError, UnsupportedModelError
from infire.models.bert import (
    EncodedBatch,
    LoadedBert,
    Pooling,
    classify,
    embed,
    load_bert,
    logits,
    pool,
    pooling_of,
    rerank,
    tokenize,
)
from tiny_models import MINILM, write_tiny_bert_classifier, write_with_minilm_tokenizer

LOGIT_TOLERANCE = 1e-5

SENTENCES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "¿Dónde está la biblioteca? Está cerca de la estación.",
    "Größenwahn und Übermut: Straße, Fuß, Maß.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "emoji 🙂🚀 and symbols ©®™ €100 — «quotes»",
    "Numbers: 3.14159, 2,718, 1e-9, -42, 0x1F.",
    "   leading and trailing whitespace   ",
    "UPPER CASE SHOUTING AND lower case whispering",
    "C++ templates & Rust's borrow-checker (vs. Go's GC)",
    "def f(x): return x ** 2  # a line of code",
    "semi;colons;everywhere;and/slashes\\too",
    "The weather today is sunny with a light breeze from the west.",
    " ".join(f"token{i} is a word in a long sentence," for i in range(120)),  # > 256 tokens
    "Short one.",
]


@pytest.fixture(scope="module")
def minilm() -> LoadedBert:
    return load_bert(MINILM)


@pytest.fixture(scope="module")
def minilm_reference() -> torch.Tensor:
    """sentence-transformers' own embeddings of SENTENCES."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(MINILM), device="cpu")
    return torch.from_numpy(model.encode(SENTENCES, convert_to_numpy=True))


@pytest.fixture(scope="module")
def tiny_reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert_classifier(tmp_path_factory.mktemp("reranker"), seed=0, num_labels=1)


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    id2label = {0: "negative", 1: "neutral", 2: "positive"}
    return write_tiny_bert_classifier(
        tmp_path_factory.mktemp("classifier"),
        seed=1,
        num_labels=3,
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    )


@pytest.fixture(scope="module")
def tiny_xlm_roberta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RoBERTa numbering (positions from pad + 1), one token type, classifier.out_proj head;
    pad_token_id 0 so MiniLM's [PAD] is its padding id."""
    torch.manual_seed(2)
    config = transformers.XLMRobertaConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=0,
        num_labels=1,
    )
    model = transformers.XLMRobertaForSequenceClassification(config).eval()
    return write_with_minilm_tokenizer(tmp_path_factory.mktemp("xlm-roberta"), model)


def _reference_logits(folder: Path, batch: EncodedBatch, token_types: bool = True) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    kwargs = {"token_type_ids": batch.token_type_ids} if token_types else {}
    with torch.no_grad():
        return model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs
        ).logits


# -- all-MiniLM-L6-v2 against sentence-transformers ------------------------------------------


def test_minilm_reads_sentence_transformers_files(minilm: LoadedBert) -> None:
    assert minilm.task == "embed"
    assert minilm.head is None
    assert minilm.pooling == Pooling(mode="mean", normalize=True)
    assert minilm.max_length == 256  # sentence_bert_config's, not tokenizer.json's 128


def test_minilm_matches_sentence_transformers(
    minilm: LoadedBert, minilm_reference: torch.Tensor
) -> None:
    batched = embed(minilm, SENTENCES)
    assert batched.dtype == torch.float32
    assert batched.shape == (len(SENTENCES), 384)
    cosine = torch.cosine_similarity(batched, minilm_reference, dim=1)
    assert cosine.min() >= 1 - 1e-6, cosine
    assert (batched - minilm_reference).abs().max() < 1e-6
    alone = torch.cat([embed(minilm, [text]) for text in SENTENCES])
    assert (alone - batched).abs().max() < 1e-5


def test_minilm_truncates_to_max_seq_length(minilm: LoadedBert) -> None:
    counts = tokenize(minilm, SENTENCES).num_tokens
    assert counts[SENTENCES.index("Hello world!")] == 5  # [CLS] hello world ! [SEP]
    assert counts[SENTENCES.index("")] == 2
    assert max(counts) == 256


def test_token_ids_get_special_tokens(minilm: LoadedBert) -> None:
    texts = ["Hello world!", "The quick brown fox jumps over the lazy dog."]
    ids = [minilm.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    assert tokenize(minilm, ids).num_tokens == tokenize(minilm, texts).num_tokens
    assert (embed(minilm, ids) - embed(minilm, texts)).abs().max() == 0
    assert max(tokenize(minilm, [[1000] * 1000]).num_tokens) == 256
    with pytest.raises(InvalidRequestError):
        tokenize(minilm, [[10**9]])
    with pytest.raises(InvalidRequestError):
        tokenize(minilm, [])


def test_embedding_model_refuses_rerank(minilm: LoadedBert) -> None:
    with pytest.raises(InvalidRequestError):
        rerank(minilm, "q", ["d"])


# -- pooling ----------------------------------------------------------------------------------


def test_pool_ignores_padding() -> None:
    hidden = torch.tensor([[[1.0, -1.0], [3.0, 5.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert pool(hidden, mask, "mean").tolist() == [[2.0, 2.0]]
    assert pool(hidden, mask, "cls").tolist() == [[1.0, -1.0]]
    assert pool(hidden, mask, "max").tolist() == [[3.0, 5.0]]


def _write_modules(folder: Path, pooling: dict[str, object], normalize: bool) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pool", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_N", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "1_Pool").mkdir(parents=True)
    (folder / "1_Pool" / "config.json").write_text(json.dumps(pooling))
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def test_pooling_of(tmp_path: Path) -> None:
    assert pooling_of(tmp_path) == Pooling("mean", False)
    cls = _write_modules(tmp_path / "cls", {"pooling_mode_cls_token": True}, normalize=False)
    assert pooling_of(cls) == Pooling("cls", False)
    new = _write_modules(tmp_path / "max", {"pooling_mode": "max"}, normalize=True)
    assert pooling_of(new) == Pooling("max", True)
    both = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}
    with pytest.raises(UnsupportedModelError):
        pooling_of(_write_modules(tmp_path / "both", both, normalize=False))


# -- tiny random heads against transformers ---------------------------------------------------

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "Berlin is the capital of Germany, and a large city with many museums.",
    "Bananas.",
]


def test_reranker_matches_transformers(tiny_reranker: Path) -> None:
    loaded = load_bert(tiny_reranker)
    assert loaded.task == "rerank"
    batch = tokenize(loaded, DOCUMENTS, query=QUERY)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_reranker)
    expected = hf_tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")
    assert torch.equal(batch.input_ids, expected["input_ids"])
    assert torch.equal(batch.token_type_ids, expected["token_type_ids"])
    assert int(batch.token_type_ids.max()) == 1

    reference = _reference_logits(tiny_reranker, batch)[:, 0]
    raw = torch.tensor(rerank(loaded, QUERY, DOCUMENTS, raw_scores=True))
    assert (raw - reference).abs().max() < LOGIT_TOLERANCE
    alone = torch.tensor([rerank(loaded, QUERY, [d], raw_scores=True)[0] for d in DOCUMENTS])
    assert (alone - reference).abs().max() < LOGIT_TOLERANCE
    assert torch.allclose(torch.tensor(rerank(loaded, QUERY, batch)), torch.sigmoid(raw))


def test_reranker_scores_as_cross_encoder(tiny_reranker: Path) -> None:
    """CrossEncoder.predict puts one label's logit through a sigmoid unless config.json
    saves another activation; rerank's default follows it."""
    from sentence_transformers import CrossEncoder

    cross_encoder = CrossEncoder(str(tiny_reranker), device="cpu")
    expected = torch.from_numpy(cross_encoder.predict([(QUERY, d) for d in DOCUMENTS]))
    got = torch.tensor(rerank(load_bert(tiny_reranker), QUERY, DOCUMENTS))
    assert (got - expected).abs().max() < LOGIT_TOLERANCE


def test_classifier_matches_transformers(tiny_classifier: Path) -> None:
    loaded = load_bert(tiny_classifier)
    assert loaded.task == "classify"
    texts = ["I love this!", "Meh.", "This is the worst film I have ever seen, truly awful."]
    batch = tokenize(loaded, texts)
    reference = _reference_logits(tiny_classifier, batch)
    assert (logits(loaded, batch) - reference).abs().max() < LOGIT_TOLERANCE
    results = classify(loaded, texts)
    assert [[label for label, _ in row] for row in results] == [
        ["negative", "neutral", "positive"]
    ] * len(texts)
    probs = torch.tensor([[p for _, p in row] for row in results])
    assert (probs - torch.softmax(reference, dim=-1)).abs().max() < LOGIT_TOLERANCE


def test_xlm_roberta_matches_transformers(tiny_xlm_roberta: Path) -> None:
    loaded = load_bert(tiny_xlm_roberta)
    assert loaded.task == "rerank"
    assert loaded.max_length == 129  # 130 positions less pad + 1
    batch = tokenize(loaded, DOCUMENTS, query=QUERY)
    reference = _reference_logits(tiny_xlm_roberta, batch, token_types=False)[:, 0]
    raw = torch.tensor(rerank(loaded, QUERY, batch, raw_scores=True))
    assert (raw - reference).abs().max() < LOGIT_TOLERANCE
