"""Run a tiny model of any family through the real scheduler and runner, and through
transformers, so the two can be compared logit by logit and token by token.

`engine_run` admits a batch of prompts into a Scheduler over a BlockManager with the
model's windowed pools, with a small token budget so long prompts prefill in chunks and
decodes share steps with prefills; it records every sampling row's logits and decodes
greedily. `reference_run` gives transformers' logits at the same positions (one full
forward per sequence) and its own greedy generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from infire.config import CacheConfig, SchedulerConfig
from infire.engine.kv_cache import BlockManager
from infire.engine.request import Sequence
from infire.engine.runner import ModelRunner, _last_rows
from infire.engine.scheduler import Scheduler
from infire.models.loader import load_model
from infire.outputs import RequestMetrics
from infire.sampling_params import SamplingParams
from infire.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class EngineRun:
    """What the engine computed for each prompt."""

    logits: list[list[torch.Tensor]]  # per prompt, one row per sampled token
    tokens: list[list[int]]  # per prompt, the greedy tokens
    runner: ModelRunner
    blocks: BlockManager
    window_blocks_peak: list[int] = field(default_factory=list)  # per windowed pool


def prompts_for(vocab_size: int, lengths: tuple[int, ...] = (37, 20, 5), seed: int = 3):
    """Random prompts of the given lengths (token 0 excluded: never a special token)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths]


def load_runner(
    folder: Path | str, limits: SchedulerConfig, num_blocks: int | None = 64
) -> ModelRunner:
    """A float32 PyTorch-path runner of the folder's model."""
    loaded = load_model(folder, torch.float32)
    cache = CacheConfig(block_size=4, num_blocks=num_blocks, kv_cache_memory=1 << 20)
    return ModelRunner(
        loaded.config, loaded.weights, cache, torch.float32, cpu_kernels=False,
        scheduler_config=limits,
    )  # fmt: skip


def engine_run(
    folder: Path | str,
    prompts: list[list[int]],
    new_tokens: int = 32,
    token_budget: int = 16,
    num_blocks: int | None = 64,
) -> EngineRun:
    """Greedy-generate `new_tokens` for every prompt at once, `token_budget` tokens a step."""
    limits = SchedulerConfig(max_num_batched_tokens=token_budget, max_num_seqs=8)
    runner = load_runner(folder, limits, num_blocks)
    windows = list(zip(runner.windows, runner.group_num_blocks[1:], strict=True))
    blocks = BlockManager(runner.num_blocks, runner.block_size, True, windows)
    scheduler = Scheduler(limits, blocks)
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(
            seq_id=i, request_id=str(i), index=0, prompt_token_ids=prompt,
            params=SamplingParams(temperature=0), metrics=RequestMetrics(0.0),
            detokenizer=IncrementalDetokenizer(None),  # type: ignore[arg-type]
        )  # fmt: skip
        scheduler.add(seq)
        seqs.append(seq)
    run = EngineRun([[] for _ in prompts], [[] for _ in prompts], runner, blocks)
    run.window_blocks_peak = [0] * len(blocks.windows)
    while scheduler.has_unfinished():
        batch = scheduler.schedule().scheduled
        assert batch, "the scheduler stalled"
        with torch.inference_mode():
            ids, positions, meta = runner._prepare_inputs(batch)
            hidden = runner.model(ids, positions, runner.kv_caches, meta)
            rows = _last_rows(batch)
            logits = runner.model.compute_logits(hidden[rows]) if rows else None
        for pool_index, pool in enumerate(blocks.windows):
            peak = run.window_blocks_peak
            peak[pool_index] = max(peak[pool_index], pool.num_used_blocks)
        sampled = 0
        for item in batch:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            blocks.cache_full_blocks(seq)
            if seq.num_computed_tokens == len(seq.token_ids):
                row = logits[sampled]
                sampled += 1
                run.logits[seq.seq_id].append(row.clone())
                token = int(row.argmax())
                run.tokens[seq.seq_id].append(token)
                seq.token_ids.append(token)
                if len(run.tokens[seq.seq_id]) == new_tokens:
                    seq.finish("length")
                    scheduler.finish(seq)
    return run


def reference_run(
    folder: Path | str, prompts: list[list[int]], generated: list[list[int]], new_tokens: int
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """transformers' logits at every sampling position of prompt + generated (one full
    forward each), and its own greedy decoding of `new_tokens` per prompt (with its KV
    cache; EOS is a token like any other, as the engine runs with ignore_eos)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logits, tokens = [], []
    with torch.no_grad():
        for prompt, ours in zip(prompts, generated, strict=True):
            ids = torch.tensor([prompt + ours[:-1]])
            logits.append(model(ids).logits[0, len(prompt) - 1 :])
            tokens.append(transformers_greedy(model, prompt, new_tokens))
    return logits, tokens


def assert_matches_transformers(
    model: Path | str,
    prompts: list[list[int]],
    new_tokens: int,
    reference: Path | str | None = None,
    tolerance: float = 1e-4,
) -> EngineRun:
    """Run `model` (a folder or GGUF file) through the engine and transformers on
    `reference` (the folder itself by default): logits within `tolerance` at every sampled
    row, and the same greedy tokens."""
    run = engine_run(model, prompts, new_tokens)
    want_logits, want_tokens = reference_run(reference or model, prompts, run.tokens, new_tokens)
    for index, (ours, theirs) in enumerate(zip(run.logits, want_logits, strict=True)):
        assert len(ours) == new_tokens == theirs.shape[0]
        for step, row in enumerate(ours):
            diff = (row - theirs[step]).abs().max().item()
            assert diff < tolerance, (index, step, diff)
    assert run.tokens == want_tokens
    return run


def transformers_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """A transformers model's greedy tokens after `prompt`, step by step with its KV cache."""
    ids, past, tokens = torch.tensor([prompt]), None, []
    for _ in range(new_tokens):
        out = model(ids, cache=past, use_cache=True)
        past = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens
