"""Shared fixtures: tiny random Hugging Face models built on the fly, and the default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (GQA 4:2) in HF format."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its weights saved in bfloat16 (what the palette form applies to)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-bf16"), dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 (q/k/v biases, tied embeddings) in HF format."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1, tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model's GGUF (installed by `make install`)."""
    from infire.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path: Path):
    """transformers' own float32 model loaded from the same GGUF (the parity reference)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_llm():
    """The default model served by infire in float32, its GGUF dequantized (the weights
    transformers loads from it: the parity reference), shared: loading takes seconds. The
    file served as its blocks is tests/kernels/test_gguf_serving.py's."""
    from infire import LLM

    return LLM(dtype="float32", num_blocks=256, quantization="none")


@pytest.fixture(scope="session")
def tiny_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a 4096-token context, for requests that must run a while."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-long"), "llama", seed=2, max_position_embeddings=4096
    )
