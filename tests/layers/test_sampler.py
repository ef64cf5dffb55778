"""Sampler on hand-made logits: each control does what it says, seeds are batch-independent."""

from __future__ import annotations

import math

import torch

from infire.layers.sampler import Sampler, SamplingMetadata, adjust_logits

VOCAB = 50


def _meta(n: int, **kw: object) -> SamplingMetadata:
    base = dict(
        temperature=torch.ones(n), top_k=None, top_p=None, min_p=None,
        generators=[None] * n, all_greedy=False,
    )  # fmt: skip
    base.update(kw)
    return SamplingMetadata(**base)  # type: ignore[arg-type]


def _logits(n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _sample_many(logits: torch.Tensor, times: int = 300, **kw: object) -> set[int]:
    sampler = Sampler(torch.Generator().manual_seed(1))
    return {sampler(logits, _meta(1, **kw)).token_ids[0] for _ in range(times)}


def test_greedy_is_argmax():
    logits = _logits(4)
    out = Sampler(torch.Generator())(logits, _meta(4, temperature=torch.zeros(4), all_greedy=True))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_limits_choices_to_k_best():
    logits = _logits()
    best3 = set(logits[0].topk(3).indices.tolist())
    seen = _sample_many(logits, temperature=torch.tensor([5.0]), top_k=torch.tensor([3]))
    assert seen == best3


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :3] = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)])
    seen = _sample_many(logits, top_p=torch.tensor([0.7]))
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :3] = torch.tensor([math.log(0.6), math.log(0.35), math.log(0.05)])
    seen = _sample_many(logits, min_p=torch.tensor([0.1]))
    assert seen == {0, 1}


def test_seeded_rows_do_not_depend_on_batch():
    logits = _logits(3)
    gens = lambda: [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(9)]  # noqa: E731
    alone = [
        Sampler(torch.Generator())(logits[i : i + 1], _meta(1, generators=[gens()[i]])).token_ids[0]
        for i in (0, 2)
    ]
    for engine_seed in (1, 2):
        batch = Sampler(torch.Generator().manual_seed(engine_seed))(
            logits, _meta(3, generators=gens())
        )
        assert [batch.token_ids[0], batch.token_ids[2]] == alone


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    counts = torch.tensor([[0.0, 0.0, 3.0, 0.0]])
    meta = _meta(
        1, temperature=torch.zeros(1), all_greedy=True,
        repetition_penalty=torch.tensor([[2.0]]), frequency_penalty=torch.tensor([[0.5]]),
        presence_penalty=torch.tensor([[0.25]]), seen_mask=seen, output_counts=counts,
    )  # fmt: skip
    from infire.layers.sampler import _apply_penalties

    expected = torch.tensor([[1.0, -4.0, 1.0 - 1.5 - 0.25, 0.5]])
    assert torch.allclose(_apply_penalties(logits, meta), expected)


def test_logprobs_and_ranks():
    logits = _logits(2)
    out = Sampler(torch.Generator())(
        logits, _meta(2, temperature=torch.zeros(2), all_greedy=True, max_num_logprobs=3)
    )
    reference = torch.log_softmax(logits, -1)
    assert out.sampled_ranks == [1, 1]
    assert out.top_token_ids == reference.topk(3).indices.tolist()
    assert torch.allclose(torch.tensor(out.sampled_logprobs), reference.max(-1).values)


def test_adjusted_logits_have_the_bits_of_the_plain_expressions():
    gen = torch.Generator().manual_seed(3)
    n, vocab = 12, 400
    logits = torch.randn(n, vocab, generator=gen) * 5
    logits[:, :7] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45])
    rows = lambda values: torch.tensor(values).repeat(n // len(values))[:, None]  # noqa: E731
    meta = _meta(
        n, repetition_penalty=rows([1.0, 0.5, 1.3, 1e-3, 2.0, 0.9]),
        frequency_penalty=rows([0.0, -1.5, 2.0, 0.3]), presence_penalty=rows([-2.0, 0.0, 1.0]),
        seen_mask=torch.rand(n, vocab, generator=gen) < 0.4,
        output_counts=torch.randint(0, 4, (n, vocab), generator=gen).float(),
        logit_bias=torch.randn(n, vocab, generator=gen) * (torch.rand(n, vocab, generator=gen) < 0.1),
    )  # fmt: skip
    penalty = torch.where(meta.seen_mask, meta.repetition_penalty, 1.0)
    plain = torch.where(logits > 0, logits / penalty, logits * penalty)
    counts = meta.output_counts
    plain = plain - meta.frequency_penalty * counts - meta.presence_penalty * (counts > 0)
    plain = plain + meta.logit_bias
    adjusted = adjust_logits(logits, meta)
    # NaN stays NaN; only its sign bit, which nothing downstream reads, may differ
    assert torch.equal(adjusted.isnan(), plain.isnan())
    assert torch.equal(
        adjusted.nan_to_num(7.0).view(torch.int32), plain.nan_to_num(7.0).view(torch.int32)
    )


def test_kernel_argmax_is_torchs_on_ties_nan_and_inf():
    """The greedy rows' argmax (the kernel library's on CPU float32): torch's first index
    of the largest, NaN counting as the largest, on every row shape and edge."""
    from infire.kernels.cpu_forward import argmax_rows, load_library

    assert not isinstance(load_library(), str)  # the kernel's path, not torch's fallback
    g = torch.Generator().manual_seed(0)
    for rows, cols in ((32, 49152), (1, 49152), (3, 7), (2, 16), (4, 1001)):
        for case in range(5):
            x = torch.randn(rows, cols, generator=g)
            if case == 1:  # ties everywhere: the first index wins
                x = torch.randint(-3, 3, (rows, cols), generator=g).float()
            elif case == 2:
                x[:, 1::3] = float("nan")
            elif case == 3:
                x[:] = float("-inf")
            elif case == 4:
                x[0, cols // 2] = float("nan")
                x[-1, -1] = float("inf")
            assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), (rows, cols, case)
    logits = torch.randint(-3, 3, (4, 1001), generator=g).float()
    logits[1, 7] = float("nan")
    meta = _meta(4, temperature=torch.zeros(4), all_greedy=True)
    out = Sampler(torch.Generator(), kernel_argmax=True)(logits, meta)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
