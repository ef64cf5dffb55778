"""Prefix-cache keys: SHA-256 chained over little-endian token ids, the same in every
process and Python (hash randomization cannot change them), and what the engine registers."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

from infire import SamplingParams
from infire.config import CacheConfig, EngineConfig
from infire.engine.engine import LLMEngine
from infire.engine.kv_cache import block_hash, prefix_block_hashes


def test_keys_are_chained_sha256_of_little_endian_ids():
    first = hashlib.sha256(b"\x01\x00\x00\x00\x02\x00\x00\x00").digest()
    assert block_hash(None, [1, 2]) == first
    second = hashlib.sha256(first + struct.pack("<2I", 70000, 3)).digest()
    assert block_hash(first, [70000, 3]) == second
    assert prefix_block_hashes([1, 2, 70000, 3, 9], 2) == [first, second]
    # a different prefix changes every later key, even with the same block tokens
    assert block_hash(block_hash(None, [2, 1]), [70000, 3]) != second


def test_keys_do_not_depend_on_the_process():
    code = "from infire.engine.kv_cache import prefix_block_hashes as p; print(p(list(range(64)), 16)[-1].hex())"
    keys = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    assert keys == {prefix_block_hashes(list(range(64)), 16)[-1].hex()}


def test_engine_registers_the_keys_of_full_blocks(tiny_llama: Path):
    config = EngineConfig(model=str(tiny_llama), dtype="float32", cache=CacheConfig(num_blocks=64))
    engine = LLMEngine(config)
    prompt = [(5 * i) % 200 + 1 for i in range(40)]
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    cached = set(engine.block_manager.block_of_hash)
    assert set(prefix_block_hashes(prompt, 16)) <= cached  # the 2 full prompt blocks
