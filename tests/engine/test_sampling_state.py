"""SamplingState against the from-scratch rebuild it replaces: bit-identical metadata and
samples while sequences join, grow, sit out steps (preempted), finish with or without
`release`, and reuse ids; plus the lease bookkeeping (growth, reclaim, idempotent release).
"""

from __future__ import annotations

import random

import pytest
import torch

from infire.engine.request import Sequence
from infire.engine.sampling_state import SamplingState
from infire.layers.sampler import Sampler, SamplingMetadata, adjust_logits
from infire.outputs import RequestMetrics
from infire.sampling_params import SamplingParams

DEVICE = torch.device("cpu")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


def reference_metadata(seqs: list[Sequence], vocab: int, device: torch.device) -> SamplingMetadata:
    """The runner's sampling metadata as it was built before SamplingState: from scratch."""
    params = [seq.params for seq in seqs]
    floats = lambda values: torch.tensor(values, dtype=torch.float32, device=device)  # noqa: E731
    meta = SamplingMetadata(
        temperature=floats([p.temperature for p in params]),
        top_k=None, top_p=None, min_p=None,
        generators=[seq.generator for seq in seqs],
        all_greedy=all(p.greedy for p in params),
    )  # fmt: skip
    if any(p.top_k > 0 for p in params):
        meta.top_k = torch.tensor([p.top_k for p in params], device=device)
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = floats([p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = floats([p.min_p for p in params])
    if any(p.uses_penalties for p in params):
        meta.repetition_penalty = floats([p.repetition_penalty for p in params])[:, None]
        meta.frequency_penalty = floats([p.frequency_penalty for p in params])[:, None]
        meta.presence_penalty = floats([p.presence_penalty for p in params])[:, None]
        seen_mask = torch.zeros(len(seqs), vocab + 1, dtype=torch.bool, device=device)
        output_counts = torch.zeros(len(seqs), vocab + 1, device=device)
        seen = _padded([s.token_ids for s in seqs], vocab).to(device)
        outputs = _padded([s.output_token_ids for s in seqs], vocab).to(device)
        seen_mask.scatter_(1, seen, True)
        output_counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
        meta.seen_mask = seen_mask[:, :vocab]
        meta.output_counts = output_counts[:, :vocab]
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(wanted) if wanted else None
    if any(p.logit_bias for p in params):
        meta.logit_bias = torch.zeros(len(params), vocab, device=device)
        for row, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                meta.logit_bias[row, token] = bias
    return meta


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


def _sequence(
    seq_id: int, prompt: list[int], params: SamplingParams, device: torch.device = DEVICE
) -> Sequence:
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device).manual_seed(params.seed)
    return Sequence(
        seq_id=seq_id, request_id=f"r{seq_id}", index=0, prompt_token_ids=prompt,
        params=params, detokenizer=None, metrics=RequestMetrics(0.0),  # type: ignore[arg-type]
        generator=generator,
    )  # fmt: skip


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.choice(["plain", "repetition", "frequency", "presence", "all", "bias", "both"])
    penalties = {
        "repetition": dict(repetition_penalty=rng.choice([0.7, 1.3, 2.0])),
        "frequency": dict(frequency_penalty=rng.choice([-1.5, 0.5, 2.0])),
        "presence": dict(presence_penalty=rng.choice([-0.5, 1.0])),
        "all": dict(repetition_penalty=1.2, frequency_penalty=-0.4, presence_penalty=0.6),
        "both": dict(repetition_penalty=1.1, presence_penalty=-2.0),
    }.get(kind, {})
    bias = None
    if kind in ("bias", "both") or rng.random() < 0.2:
        bias = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(1, 6))}
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 5]),
        top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, rng.randrange(1000)]),
        logit_bias=bias,
        max_tokens=None, **penalties,
    )  # fmt: skip


def _assert_same(meta: SamplingMetadata, expected: SamplingMetadata, seqs: list[Sequence]) -> None:
    """Equal field by field; a row without penalties may read zeros instead of its history."""
    penalized = torch.tensor(
        [seq.params.uses_penalties for seq in seqs], device=meta.temperature.device
    )
    for name in SamplingMetadata.__slots__:
        got, want = getattr(meta, name), getattr(expected, name)
        if name in ("seen_mask", "output_counts") and want is not None:
            got, want = got[penalized], want[penalized]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), name
            assert got.dtype == want.dtype and torch.equal(got, want), name
        elif name != "generators":
            assert got == want, name


def _processed(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The logits after penalties and bias, as the sampler sees them, as raw bits."""
    return adjust_logits(logits, meta).view(torch.int32)


def _logits(rows: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    # zeros of both signs, infinities and subnormals come out with the same bits
    logits[:, :6] = torch.tensor([0.0, -0.0, float("-inf"), float("inf"), 1e-45, -1e-45])
    return logits.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_rows_match_a_rebuild_from_scratch(seed: int, device: str):
    rng = random.Random(seed)
    vocab = 97
    dev = torch.device(device)
    state = SamplingState(vocab, dev, capacity=2)  # small: growth and reclaim both happen
    sampler, reference_sampler = Sampler(torch.Generator(dev)), Sampler(torch.Generator(dev))
    live: list[Sequence] = []
    next_id = 0
    for step in range(60):
        while len(live) < 6 and rng.random() < 0.5:  # joins, prompts of any length
            next_id += 1
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            live.append(_sequence(next_id, prompt, _random_params(rng, vocab), dev))
        batch = [seq for seq in live if rng.random() < 0.8]  # the rest sit out (preempted)
        if not batch:
            continue
        meta = state.metadata(batch)
        expected = reference_metadata(batch, vocab, dev)
        _assert_same(meta, expected, batch)
        logits = _logits(len(batch), vocab, step, dev)
        assert torch.equal(_processed(logits, meta), _processed(logits, expected))
        # The seeded generators are shared by both samplers: rewind them between the two.
        seeded = [seq.generator for seq in batch if seq.generator is not None]
        states = [generator.get_state() for generator in seeded]
        out = sampler(logits, meta)
        for generator, generator_state in zip(seeded, states, strict=True):
            generator.set_state(generator_state)
        assert out.token_ids == reference_sampler(logits, expected).token_ids
        for seq, token in zip(batch, out.token_ids, strict=True):
            seq.token_ids.append(token)
        for seq in [s for s in batch if rng.random() < 0.1]:  # leave, released or not
            seq.finish("length")
            live.remove(seq)
            if rng.random() < 0.5:
                state.release(seq.seq_id)
    assert next_id > 8  # the tables had to grow or reclaim rows


def test_rows_follow_only_new_tokens_and_prompt_is_not_counted():
    state = SamplingState(10, DEVICE)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)
    seq = _sequence(1, [1, 2, 2], params)
    meta = state.metadata([seq])
    assert meta.seen_mask[0].nonzero().flatten().tolist() == [1, 2]
    assert meta.output_counts.sum() == 0
    seq.token_ids += [3, 3, 2]  # e.g. three steps while it sat out, then back
    meta = state.metadata([seq])
    assert meta.seen_mask[0].nonzero().flatten().tolist() == [1, 2, 3]
    assert meta.output_counts[0, [2, 3]].tolist() == [1.0, 2.0]


def test_only_sequences_that_need_rows_get_them():
    state = SamplingState(10, DEVICE, capacity=1)
    plain = _sequence(1, [4], SamplingParams())
    penalized = _sequence(2, [5], SamplingParams(presence_penalty=1.0))
    biased = _sequence(3, [6], SamplingParams(logit_bias={7: 3.0}))
    meta = state.metadata([plain, penalized, biased])
    assert set(state.penalties.leases) == {2} and set(state.biases.leases) == {3}
    assert not meta.seen_mask[0].any() and not meta.seen_mask[2].any()
    assert meta.logit_bias[:, 7].tolist() == [0.0, 0.0, 3.0]


def test_release_is_idempotent_and_frees_the_row():
    state = SamplingState(10, DEVICE, capacity=1)
    first = _sequence(1, [1], SamplingParams(repetition_penalty=2.0, logit_bias={2: 1.0}))
    state.metadata([first])
    state.release(1)
    state.release(1)
    state.release(99)  # never had a row
    second = _sequence(2, [3], SamplingParams(repetition_penalty=2.0))
    meta = state.metadata([second])
    assert state.penalties.capacity == 1  # the freed row was reused, cleared
    assert meta.seen_mask[0].nonzero().flatten().tolist() == [3]
    assert not state.biases.leases


def test_finished_sequences_never_released_are_reclaimed_before_growing():
    state = SamplingState(10, DEVICE, capacity=2)
    params = SamplingParams(frequency_penalty=1.0)
    old = [_sequence(i, [i], params) for i in (1, 2)]
    state.metadata(old)
    for seq in old:
        seq.finish("stop")
    state.metadata([_sequence(i, [i], params) for i in (3, 4)])
    assert state.penalties.capacity == 2 and set(state.penalties.leases) == {3, 4}
    state.metadata([_sequence(i, [i], params) for i in (5, 6, 7)])  # 3 and 4 live on: it grows
    assert state.penalties.capacity == 8 and set(state.penalties.leases) == {3, 4, 5, 6, 7}


def test_a_new_sequence_under_a_known_id_starts_afresh():
    state = SamplingState(10, DEVICE)
    params = SamplingParams(repetition_penalty=2.0, logit_bias={1: 5.0})
    state.metadata([_sequence(0, [1, 2, 3, 4], params)])
    other = _sequence(0, [9], SamplingParams(repetition_penalty=2.0, logit_bias={8: -5.0}))
    meta = state.metadata([other])
    assert meta.seen_mask[0].nonzero().flatten().tolist() == [9]
    assert meta.logit_bias[0].nonzero().flatten().tolist() == [8]
