"""The engines bench_engine.py compares, behind one interface: greedy-generate token-id prompts.

Every peer takes the same prompts (lists of token ids, so prompt lengths are identical),
generates exactly `max_tokens` tokens per prompt greedily, ignoring EOS, and reports the wall
time of the whole call. infire and transformers run in this process on torch's threads;
llama.cpp runs in its own venv as a subprocess (llamacpp_peer.py), one request at a time.
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = ROOT / ".bench-venv" / "bin" / "python"
PEER_SCRIPT = Path(__file__).resolve().parent / "llamacpp_peer.py"


class PeerUnavailable(Exception):
    """A peer that cannot run here (not installed, failed to load); the benchmark goes on."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One timed generate call: wall seconds and the generated ids of each prompt."""

    wall_s: float
    token_ids: list[list[int]]
    first_token_s: list[float] | None = None  # per request, where the peer can tell


class Peer(Protocol):
    """An engine under test."""

    engine: str  # "infire", "transformers", "llama.cpp"
    weights: str  # the dtype it computes in, or the quantized format
    child_pids: tuple[int, ...]  # subprocesses whose CPU time is the peer's own

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Generation:
        """Greedy, EOS ignored, exactly max_tokens new tokens per prompt."""
        ...

    def close(self) -> None:
        """Release what the peer holds (a subprocess, memory)."""
        ...


def label(peer: Peer) -> str:
    """A short display name, e.g. 'infire bfloat16'."""
    return f"{peer.engine} {peer.weights}"


class InfirePeer:
    """infire through its offline API, `LLM.generate`; prefix caching off (no peer has it)."""

    engine = "infire"
    child_pids: tuple[int, ...] = ()

    def __init__(
        self, dtype: str, kv_cache_memory: int, model: str | None = None, **options: Any
    ) -> None:
        from infire import LLM, SamplingParams

        self.weights = dtype
        self._params = SamplingParams
        self.llm = LLM(
            model=model,
            dtype=dtype,
            enable_prefix_caching=False,
            kv_cache_memory=kv_cache_memory,
            **options,
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Generation:
        """Timed `LLM.generate` over all prompts at once (continuous batching)."""
        params = self._params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        wall = time.perf_counter() - start
        return Generation(wall, [list(o.outputs[0].token_ids) for o in outputs])

    def close(self) -> None:
        """Drop the engine (weights and KV cache)."""
        del self.llm


class TransformersPeer:
    """Hugging Face transformers `generate`, batched with left padding."""

    engine = "transformers"
    child_pids: tuple[int, ...] = ()

    def __init__(self, model: Any, dtype: torch.dtype, pad_token_id: int) -> None:
        self.weights = str(dtype).removeprefix("torch.")
        self.model = model
        self.pad_token_id = pad_token_id

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Generation:
        """Timed `model.generate`; min_new_tokens keeps EOS from ending a row early."""
        input_ids, attention_mask = left_padded(prompts, self.pad_token_id)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=self.pad_token_id,
            )
        wall = time.perf_counter() - start
        return Generation(wall, out[:, input_ids.shape[1] :].tolist())

    def close(self) -> None:
        """Drop the model."""
        del self.model


def load_transformers(gguf_path: Path, dtypes: list[str]) -> list[TransformersPeer]:
    """One transformers peer per dtype; the GGUF is dequantized once to float32, then cast."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # generation-config chatter about unused sampling fields
    base = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    pad = base.generation_config.pad_token_id
    pad = pad if pad is not None else base.generation_config.eos_token_id or 0
    pad = pad[0] if isinstance(pad, list) else pad
    peers = []
    for name in dtypes:
        dtype = getattr(torch, name)
        model = base if dtype == torch.float32 else copy.deepcopy(base).to(dtype)
        peers.append(TransformersPeer(model, dtype, int(pad)))
    return peers


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, right-aligned as decoder-only batched generation needs."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


class LlamaCppPeer:
    """llama.cpp via llama-cpp-python in .bench-venv, as a long-lived subprocess."""

    engine = "llama.cpp"

    def __init__(self, gguf_path: Path, threads: int, n_ctx: int, weights: str) -> None:
        if not PEER_PYTHON.exists():
            raise PeerUnavailable(f"{PEER_PYTHON} missing (build it: see docs/benchmarks.md)")
        self.weights = weights
        command = [str(PEER_PYTHON), str(PEER_SCRIPT), str(gguf_path)]
        command += ["--threads", str(threads), "--n-ctx", str(n_ctx)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.child_pids = (self.process.pid,)
        ready = self._read()
        if not ready.get("ready"):
            self.close()
            raise PeerUnavailable(ready.get("error", "llamacpp_peer.py did not start"))
        self.version = str(ready.get("version"))

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Generation:
        """Sequential greedy generation in the subprocess; wall time measured there."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}))
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        reply = self._read()
        requests = reply["requests"]
        return Generation(
            reply["wall_s"],
            [r["token_ids"] for r in requests],
            [r["first_token_s"] for r in requests],
        )

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise PeerUnavailable(f"llamacpp_peer.py exited with status {code}")
        return json.loads(line)

    def close(self) -> None:
        """End the subprocess (closing stdin makes it exit)."""
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
