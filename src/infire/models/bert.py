"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) for embeddings, reranking and classification.

These models do not generate: one bidirectional forward pass over a padded batch gives a
hidden state per token, and a small reduction turns it into the answer. An embedding
model pools the tokens (mean, [CLS] or max, read from the sentence-transformers files
beside the checkpoint, then maybe L2-normalizes); a cross-encoder reranker or a classifier
runs BERT's pooler (dense + tanh on [CLS]) and a linear classifier. So this module is
apart from the decoder engine: `load_bert` reads a Hugging Face folder into a `LoadedBert`,
and `embed`, `rerank` and `classify` take a batch of texts to results, in float32 on the
CPU, matching what sentence-transformers and transformers compute for the same folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tokenizers
import torch
import torch.nn.functional as F
from torch import nn

from infire.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from infire.layers.linear import LinearBase
from infire.models.checkpoint import read_json, safetensors_files
from infire.models.weights import SafetensorsSource, WeightSource
from infire.tokenizer import read_tokenizer_json

PoolingMode = Literal["mean", "cls", "max"]
Task = Literal["embed", "rerank", "classify"]
# Texts, or token ids without special tokens (the post-processor's [CLS]/[SEP] are added)
Inputs = Sequence[str] | Sequence[Sequence[int]]

MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
ACTIVATIONS = {
    "gelu": F.gelu,  # exact erf GELU, transformers' "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# sentence-transformers' CrossEncoder activations, by the class name its config stores
SCORE_ACTIVATIONS = {"Sigmoid": torch.sigmoid, "Identity": lambda x: x, "Tanh": torch.tanh}


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The fields of a BERT-family config.json that the forward pass and the heads need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    id2label: tuple[str, ...] = ()  # labels by class id; () when config.json has none
    architectures: tuple[str, ...] = ()
    problem_type: str | None = None  # "multi_label_classification": sigmoid, not softmax
    score_activation: str | None = None  # CrossEncoder's saved activation class name

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not a BERT-family encoder ({MODEL_TYPES})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {self.hidden_act!r} is not supported ({sorted(ACTIVATIONS)})"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ModelLoadError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def is_roberta(self) -> bool:
        """RoBERTa numbers positions from pad_token_id + 1, so it loses that many positions."""
        return self.model_type != "bert"

    @property
    def max_positions(self) -> int:
        """The longest sequence (special tokens included) the position table can number."""
        if self.is_roberta:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> BertConfig:
        """Read config.json's object; a missing required field is a ModelLoadError."""
        try:
            id2label = config.get("id2label") or {}
            labels = tuple(str(id2label[key]) for key in sorted(id2label, key=int))
            sentence_transformers = config.get("sentence_transformers") or {}
            activation = sentence_transformers.get("activation_fn") or config.get(
                "sbert_ce_default_activation_function"
            )
            pad_default = 1 if config["model_type"] != "bert" else 0
            return cls(
                model_type=config["model_type"],
                vocab_size=config["vocab_size"],
                hidden_size=config["hidden_size"],
                num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=config["num_attention_heads"],
                intermediate_size=config["intermediate_size"],
                hidden_act=config.get("hidden_act", "gelu"),
                max_position_embeddings=config["max_position_embeddings"],
                type_vocab_size=config.get("type_vocab_size", 2),
                layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                pad_token_id=config.get("pad_token_id", pad_default),
                id2label=labels,
                architectures=tuple(config.get("architectures") or ()),
                problem_type=config.get("problem_type"),
                score_activation=activation.rsplit(".", 1)[-1] if activation else None,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from None


class Linear(LinearBase):
    """nn.Linear's parameters (so checkpoints load by the same names), with LinearBase's
    oneDNN packing: in bfloat16 the packed matmuls run ~1.1x faster than unpacked ones."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b over the last dimension."""
        return self.matmul(x.reshape(-1, x.shape[-1]), self.bias).view(*x.shape[:-1], -1)


class BertLayer(nn.Module):
    """Post-LN transformer layer: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv = Linear(hidden, 3 * hidden)  # query, key, value fused: one matmul
        self.attn_out = Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.ffn_in = Linear(hidden, config.intermediate_size)
        self.ffn_out = Linear(config.intermediate_size, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """`hidden` [B, T, H]; `key_mask` [B, 1, 1, T], True where a key may be attended."""
        batch, length, width = hidden.shape
        qkv = self.qkv(hidden).view(batch, length, 3, self.num_heads, -1)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, T, head_dim]
        attn = F.scaled_dot_product_attention(query, key, value, attn_mask=key_mask)
        attn = attn.transpose(1, 2).reshape(batch, length, width)
        hidden = self.attn_norm(hidden + self.attn_out(attn))
        return self.ffn_norm(hidden + self.ffn_out(self.act(self.ffn_in(hidden))))


class BertEncoder(nn.Module):
    """Embeddings (word + position + token type, then LayerNorm) and N bidirectional layers."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, T, H] of right-padded `input_ids` [B, T] (mask: 1 = real token)."""
        mask = attention_mask.bool()
        if token_type_ids is None or self.config.type_vocab_size == 1:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(self._position_ids(mask))
            + self.token_type_embeddings(token_type_ids)
        )
        hidden = self.embedding_norm(hidden)
        key_mask = mask[:, None, None, :]
        for layer in self.layers:
            hidden = layer(hidden, key_mask)
        return hidden

    def _position_ids(self, mask: torch.Tensor) -> torch.Tensor:
        """BERT counts 0, 1, ...; RoBERTa counts real tokens from pad + 1 and gives pads pad."""
        if not self.config.is_roberta:
            return torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
        return torch.cumsum(mask, dim=1) * mask + self.config.pad_token_id


class ClassificationHead(nn.Module):
    """BERT's pooler (dense + tanh on [CLS]) and classifier; RoBERTa's head is the same math."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size)
        self.out_proj = Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, num_labels] from the hidden states [B, T, H]."""
        return self.out_proj(torch.tanh(self.dense(hidden[:, 0])))


@dataclass(frozen=True, slots=True)
class Pooling:
    """How sentence-transformers turns token states into one vector."""

    mode: PoolingMode = "mean"
    normalize: bool = False


@dataclass(frozen=True, slots=True)
class EncodedBatch:
    """A right-padded batch of token ids, ready for `BertEncoder.forward`."""

    input_ids: torch.Tensor  # [B, T] int64
    token_type_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64, 1 = real token
    num_tokens: tuple[int, ...]  # per input, special tokens included (the API's usage)


@dataclass(frozen=True, slots=True)
class LoadedBert:
    """Everything `embed`, `rerank` and `classify` need from one model folder."""

    config: BertConfig
    encoder: BertEncoder
    head: ClassificationHead | None  # None for a bare encoder (BertModel, *ForMaskedLM)
    pooling: Pooling
    tokenizer: tokenizers.Tokenizer  # truncates to max_length, never pads
    max_length: int
    task: Task
    lowercase: bool  # sentence-transformers' do_lower_case: lowered before tokenizing
    prefix_ids: tuple[int, ...]  # what the post-processor puts around one sequence,
    suffix_ids: tuple[int, ...]  # for inputs given as token ids

    @property
    def num_labels(self) -> int:
        """Classes of the head (0 without one)."""
        return 0 if self.head is None else self.head.out_proj.out_features

    @property
    def labels(self) -> tuple[str, ...]:
        """Class names by id: config.json's id2label, else transformers' LABEL_i."""
        labels = self.config.id2label
        if len(labels) == self.num_labels:
            return labels
        return tuple(f"LABEL_{i}" for i in range(self.num_labels))


def describe(folder: str | Path) -> dict[str, int]:
    """max_input_tokens and output_dimensions of a BERT-family folder, from its configs
    (nothing loaded)."""
    folder = Path(folder).expanduser()
    config = BertConfig.from_dict(read_json(folder / "config.json", required=True))
    max_length = _max_length(folder, config, _sentence_bert_config(folder))
    return {"max_input_tokens": max_length, "output_dimensions": config.hidden_size}


def load_bert(folder: str | Path, dtype: torch.dtype = torch.float32) -> LoadedBert:
    """Read a BERT-family Hugging Face folder (config, safetensors, tokenizer.json, and the
    sentence-transformers files when present) into a CPU model ready to serve, in `dtype`.
    In bfloat16 (for CPUs with native bf16 matmuls: AVX512-BF16, AMX) the matmul weights
    are packed for oneDNN; embeddings are pooled and scores computed in float32."""
    folder = Path(folder).expanduser()
    config = BertConfig.from_dict(read_json(folder / "config.json", required=True))
    source = SafetensorsSource(safetensors_files(folder), torch.float32)
    prefix = _weight_prefix(source, config)
    encoder = BertEncoder(config).float().eval()
    _load_encoder(encoder, source, prefix)
    head = _load_head(source, config, prefix)
    sentence_config = _sentence_bert_config(folder)
    max_length = _max_length(folder, config, sentence_config)
    tokenizer = _tokenizer(folder, max_length)
    prefix_ids, suffix_ids = _special_ids(tokenizer)
    if dtype != torch.float32:
        encoder.to(dtype)
        head = head.to(dtype) if head is not None else None
        for module in (*encoder.modules(), *(head.modules() if head is not None else ())):
            if isinstance(module, Linear):
                module.pack_for_cpu()
    if head is None:
        task: Task = "embed"
    else:
        task = "rerank" if head.out_proj.out_features == 1 else "classify"
    return LoadedBert(
        config=config,
        encoder=encoder,
        head=head,
        pooling=pooling_of(folder),
        tokenizer=tokenizer,
        max_length=max_length,
        task=task,
        lowercase=bool(sentence_config.get("do_lower_case", False)),
        prefix_ids=prefix_ids,
        suffix_ids=suffix_ids,
    )


def pooling_of(folder: str | Path) -> Pooling:
    """The pooling of a sentence-transformers folder (modules.json); mean without one."""
    folder = Path(folder)
    modules = _st_modules(folder)
    if not modules:
        return Pooling()
    mode: PoolingMode = "mean"
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            mode = _pooling_mode(read_json(folder / module.get("path", "") / "config.json", True))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise UnsupportedModelError(
                f"{folder}: sentence-transformers module {module.get('type')!r} is not "
                "supported (Transformer, Pooling and Normalize are)"
            )
    return Pooling(mode=mode, normalize=normalize)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """One vector [B, H] per sequence from token states [B, T, H], over real tokens only."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "mean":
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    raise ValueError(f"unknown pooling mode {mode!r}")


def tokenize(loaded: LoadedBert, inputs: Inputs, query: str | None = None) -> EncodedBatch:
    """Tokenize (with the special tokens, truncated to `max_length`) and right-pad a batch;
    with `query`, each input is encoded as the pair (query, input), as a cross-encoder is."""
    if not inputs:
        raise InvalidRequestError("input must not be empty", param="input")
    if all(isinstance(item, str) for item in inputs):
        texts = [text.lower() for text in inputs] if loaded.lowercase else list(inputs)
        if query is None:
            encodings = loaded.tokenizer.encode_batch(texts)
        else:
            query = query.lower() if loaded.lowercase else query
            encodings = loaded.tokenizer.encode_batch([(query, text) for text in texts])
        rows = [(e.ids, e.type_ids) for e in encodings]
    elif query is None and all(_is_token_list(item) for item in inputs):
        rows = [_wrap_ids(loaded, list(item)) for item in inputs]
    else:
        raise InvalidRequestError(
            "input must be a list of strings or a list of token id lists "
            "(token ids are not accepted for pairs)",
            param="input",
        )
    return _pad(rows, loaded.config.pad_token_id)


@torch.inference_mode()
def embed(
    loaded: LoadedBert,
    inputs: Inputs | EncodedBatch,
    batch_size: int = 32,
    pooling: PoolingMode | None = None,
) -> torch.Tensor:
    """Sentence embeddings [n, dim] (float32), pooled and normalized as sentence-transformers
    does (`pooling` overrides the model's mode, as Workers AI's input may); the batch is run
    in length-sorted chunks so short inputs are not padded long."""
    batch = inputs if isinstance(inputs, EncodedBatch) else tokenize(loaded, inputs)
    lengths = torch.tensor(batch.num_tokens)
    order = torch.argsort(lengths, descending=True)
    out = torch.empty(len(lengths), loaded.config.hidden_size)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = int(lengths[rows].max())
        mask = batch.attention_mask[rows, :width]
        hidden = loaded.encoder(
            batch.input_ids[rows, :width], mask, batch.token_type_ids[rows, :width]
        )
        out[rows] = pool(hidden.float(), mask, pooling or loaded.pooling.mode)
    return F.normalize(out, p=2, dim=1) if loaded.pooling.normalize else out


@torch.inference_mode()
def logits(loaded: LoadedBert, batch: EncodedBatch) -> torch.Tensor:
    """The head's raw logits [n, num_labels] (float32) for an encoded batch."""
    if loaded.head is None:
        raise InvalidRequestError(
            "this model has no classification head (it serves embeddings)", param="model"
        )
    hidden = loaded.encoder(batch.input_ids, batch.attention_mask, batch.token_type_ids)
    return loaded.head(hidden).float()


def rerank(
    loaded: LoadedBert,
    query: str,
    documents: Sequence[str] | EncodedBatch,
    raw_scores: bool = False,
) -> list[float]:
    """Relevance of each document to `query`, as sentence-transformers' CrossEncoder.predict
    scores it: the logit through the saved activation, else sigmoid (its default for one
    label); `raw_scores` gives the logit. `documents` may be tokenize(..., query=query)."""
    if loaded.num_labels != 1:
        raise InvalidRequestError(
            f"this model is not a reranker (it has {loaded.num_labels} labels)", param="model"
        )
    batch = documents if isinstance(documents, EncodedBatch) else tokenize(loaded, documents, query)
    scores = logits(loaded, batch)[:, 0]
    if not raw_scores:
        scores = SCORE_ACTIVATIONS.get(loaded.config.score_activation or "Sigmoid", torch.sigmoid)(
            scores
        )
    return scores.tolist()


def classify(loaded: LoadedBert, inputs: Inputs | EncodedBatch) -> list[list[tuple[str, float]]]:
    """(label, probability) per class in id order, per input: softmax over the logits, or a
    sigmoid per class for one label or multi-label problems, as transformers' pipeline does."""
    batch = inputs if isinstance(inputs, EncodedBatch) else tokenize(loaded, inputs)
    scores = logits(loaded, batch)
    if loaded.num_labels == 1 or loaded.config.problem_type == "multi_label_classification":
        probs = torch.sigmoid(scores)
    else:
        probs = torch.softmax(scores, dim=-1)
    labels = loaded.labels
    return [list(zip(labels, row, strict=True)) for row in probs.tolist()]


# Weight names in a Hugging Face checkpoint, by this module's names
_EMBEDDING_NAMES = {
    "word_embeddings": "word_embeddings",
    "position_embeddings": "position_embeddings",
    "token_type_embeddings": "token_type_embeddings",
    "embedding_norm": "LayerNorm",
}
_LAYER_NAMES = {
    "attn_out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "ffn_in": "intermediate.dense",
    "ffn_out": "output.dense",
    "ffn_norm": "output.LayerNorm",
}


def _weight_prefix(source: WeightSource, config: BertConfig) -> str:
    """ "bert." / "roberta." in task checkpoints, "" in a bare BertModel's."""
    for prefix in ("", "bert.", "roberta.", f"{config.model_type}."):
        if f"{prefix}embeddings.word_embeddings.weight" in source:
            return prefix
    raise ModelLoadError("no embeddings.word_embeddings.weight: not a BERT-family checkpoint")


@torch.no_grad()
def _load_encoder(encoder: BertEncoder, source: WeightSource, prefix: str) -> None:
    for module, name in _EMBEDDING_NAMES.items():
        _load_module(getattr(encoder, module), source, f"{prefix}embeddings.{name}")
    width = encoder.config.hidden_size
    for i, layer in enumerate(encoder.layers):
        base = f"{prefix}encoder.layer.{i}."
        for j, part in enumerate(("query", "key", "value")):
            rows = slice(j * width, (j + 1) * width)
            _copy(layer.qkv.weight[rows], source, f"{base}attention.self.{part}.weight")
            _copy(layer.qkv.bias[rows], source, f"{base}attention.self.{part}.bias")
        for module, name in _LAYER_NAMES.items():
            _load_module(getattr(layer, module), source, base + name)


@torch.no_grad()
def _load_head(source: WeightSource, config: BertConfig, prefix: str) -> ClassificationHead | None:
    """BERT keeps the head as pooler + classifier, RoBERTa as classifier.dense + out_proj."""
    if "classifier.weight" in source:
        dense, out = f"{prefix}pooler.dense", "classifier"
    elif "classifier.out_proj.weight" in source:
        dense, out = "classifier.dense", "classifier.out_proj"
    else:
        return None
    head = ClassificationHead(config.hidden_size, source.shape(f"{out}.weight")[0]).float()
    _load_module(head.dense, source, dense)
    _load_module(head.out_proj, source, out)
    return head.eval()


def _load_module(module: nn.Module, source: WeightSource, name: str) -> None:
    for leaf, param in module.named_parameters():
        _copy(param, source, f"{name}.{leaf}")


def _copy(param: torch.Tensor, source: WeightSource, name: str) -> None:
    """Read `name` into `param`; old checkpoints call LayerNorm's weight/bias gamma/beta."""
    if name not in source:
        legacy = name.replace(".weight", ".gamma").replace(".bias", ".beta")
        if "LayerNorm" not in name or legacy not in source:
            raise ModelLoadError(f"checkpoint lacks {name}")
        name = legacy
    if tuple(source.shape(name)) != tuple(param.shape):
        raise ModelLoadError(
            f"{name}: shape {tuple(source.shape(name))}, config says {tuple(param.shape)}"
        )
    source.read_into(param, name)


def _st_modules(folder: Path) -> list[dict[str, Any]]:
    path = folder / "modules.json"
    if not path.is_file():
        return []
    modules = read_json(path, required=True)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{path}: expected a list of modules")
    return modules


def _pooling_mode(config: dict[str, Any]) -> PoolingMode:
    """The one mode of a Pooling config: new `pooling_mode`, or the legacy booleans (none
    set means mean, as sentence-transformers reads it)."""
    legacy = {
        "pooling_mode_cls_token": "cls",
        "pooling_mode_max_tokens": "max",
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens": "weightedmean",
        "pooling_mode_lasttoken": "lasttoken",
    }
    modes = config.get("pooling_mode") or [mode for key, mode in legacy.items() if config.get(key)]
    modes = [modes] if isinstance(modes, str) else list(modes) or ["mean"]
    if len(modes) != 1 or modes[0] not in ("mean", "cls", "max"):
        raise UnsupportedModelError(
            f"pooling {modes} is not supported (one of mean, cls or max is)"
        )
    return modes[0]


def _sentence_bert_config(folder: Path) -> dict[str, Any]:
    """sentence_bert_config.json of the Transformer module (the folder itself, usually)."""
    for module in _st_modules(folder):
        if str(module.get("type", "")).endswith("Transformer"):
            path = folder / module.get("path", "") / "sentence_bert_config.json"
            if path.is_file():
                return read_json(path, required=True)
    return read_json(folder / "sentence_bert_config.json", required=False)


def _max_length(folder: Path, config: BertConfig, sentence_config: dict[str, Any]) -> int:
    """sentence-transformers' max_seq_length, else the tokenizer's model_max_length, capped
    by the positions the model has."""
    limit = config.max_positions
    length = sentence_config.get("max_seq_length")
    if length is None:
        length = read_json(folder / "tokenizer_config.json", False).get("model_max_length")
    if isinstance(length, int) and 0 < length < limit:
        return length
    return limit


def _tokenizer(folder: Path, max_length: int) -> tokenizers.Tokenizer:
    """tokenizer.json, truncating (longest first, like transformers) and never padding:
    padding here is to the batch's longest, and the file's fixed padding would waste work."""
    tokenizer = read_tokenizer_json(folder)
    tokenizer.enable_truncation(max_length=max_length, strategy="longest_first")
    tokenizer.no_padding()
    return tokenizer


def _special_ids(tokenizer: tokenizers.Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the post-processor puts before and after one sequence ([CLS] / [SEP]),
    found by where a probe's plain ids sit inside its processed ids."""
    plain = tokenizer.encode("hello", add_special_tokens=False).ids
    full = tokenizer.encode("hello").ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(full[:start]), tuple(full[start + len(plain) :])
    return (), ()


def _is_token_list(item: object) -> bool:
    return isinstance(item, Sequence) and all(isinstance(t, int) for t in item)


def _wrap_ids(loaded: LoadedBert, ids: list[int]) -> tuple[list[int], list[int]]:
    """Token ids with the special tokens around them, truncated like text would be."""
    vocab_size = loaded.config.vocab_size
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size})", param="input")
    room = loaded.max_length - len(loaded.prefix_ids) - len(loaded.suffix_ids)
    full = [*loaded.prefix_ids, *ids[:room], *loaded.suffix_ids]
    return full, [0] * len(full)


def concat(batches: list[EncodedBatch], pad_token_id: int) -> EncodedBatch:
    """Several tokenized batches as one, right-padded to the widest."""
    width = max(b.input_ids.shape[1] for b in batches)

    def widen(t: torch.Tensor, fill: int) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=fill)

    return EncodedBatch(
        torch.cat([widen(b.input_ids, pad_token_id) for b in batches]),
        torch.cat([widen(b.token_type_ids, 0) for b in batches]),
        torch.cat([widen(b.attention_mask, 0) for b in batches]),
        tuple(n for b in batches for n in b.num_tokens),
    )


def _pad(rows: list[tuple[list[int], list[int]]], pad_token_id: int) -> EncodedBatch:
    lengths = [len(ids) for ids, _ in rows]
    width = max(lengths)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    token_type_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, type_ids) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        token_type_ids[i, : len(ids)] = torch.tensor(type_ids, dtype=torch.long)
        attention_mask[i, : len(ids)] = 1
    return EncodedBatch(input_ids, token_type_ids, attention_mask, tuple(lengths))
