"""Batched sampling: penalties, logit bias, temperature, top-k / top-p / min-p, seeds and logprobs.

One call samples a token for every row of a [N, vocab] logits matrix, with each row's own
parameters. Sampling uses the exponential-race form (argmax of p / E, E ~ Exp(1)), which
draws exactly `vocab` numbers per row from that row's generator: a seeded request gets
the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infire.kernels.cpu_forward import argmax_rows


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [N]; 0 = greedy
    top_k: torch.Tensor | None  # [N] long, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [N]; None when no row uses it
    min_p: torch.Tensor | None  # [N]; None when no row uses it
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    all_greedy: bool
    repetition_penalty: torch.Tensor | None = None  # [N, 1]; None when no row uses penalties
    frequency_penalty: torch.Tensor | None = None  # [N, 1]
    presence_penalty: torch.Tensor | None = None  # [N, 1]
    seen_mask: torch.Tensor | None = None  # [N, V] bool: in prompt or output (repetition)
    output_counts: torch.Tensor | None = None  # [N, V] float: counts in output (freq/presence)
    max_num_logprobs: int | None = None  # largest top-k asked for; None = no row wants logprobs
    logit_bias: torch.Tensor | None = None  # [N, V] added to the logits; None when no row has one
    # structured outputs: the tokens each constrained row's grammar forbids next, and which
    # rows those are (None: every row)
    disallowed: torch.Tensor | None = None  # [K, V] bool
    disallowed_rows: torch.Tensor | None = None  # [K] long


@dataclass(slots=True)
class SamplerOutput:
    """Sampled tokens, plus logprobs when any row asked for them."""

    token_ids: list[int]
    sampled_logprobs: list[float] | None = None
    sampled_ranks: list[int] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class Sampler:
    """Samples one token per row of a logits matrix."""

    def __init__(self, generator: torch.Generator, kernel_argmax: bool = False) -> None:
        self.generator = generator
        # greedy rows' argmax through the CPU kernel library (where the fused forward
        # runs, so that --no-cpu-kernels stays all PyTorch): the same indices, faster
        self.kernel_argmax = kernel_argmax

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        )
        if meta.disallowed is not None:  # a grammar's mask, before everything else
            # In place: the step's logits are not read after sampling, and raw logprobs
            # were taken above (a fresh [N, vocab] tensor costs a pass of page faults).
            rows = meta.disallowed_rows
            if rows is None:
                logits.masked_fill_(meta.disallowed, float("-inf"))
            else:
                logits[rows] = logits[rows].masked_fill_(meta.disallowed, float("-inf"))
        logits = adjust_logits(logits, meta)
        greedy = argmax_rows(logits) if self.kernel_argmax else logits.argmax(dim=-1)
        tokens = greedy if meta.all_greedy else self._sample(logits, meta, greedy)
        if raw_logprobs is None:
            return SamplerOutput(token_ids=tokens.tolist())
        return _with_logprobs(raw_logprobs, tokens, meta.max_num_logprobs)

    def _sample(
        self, logits: torch.Tensor, meta: SamplingMetadata, greedy: torch.Tensor
    ) -> torch.Tensor:
        is_greedy = meta.temperature == 0
        temperature = torch.where(is_greedy, 1.0, meta.temperature).unsqueeze(1)
        logits = _apply_top_k_top_p(logits / temperature, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = self._exponential_noise(probs, meta.generators)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)

    def _exponential_noise(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        noise = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if len(seeded) < len(generators):
            noise.exponential_(generator=self.generator)
        for i in seeded:
            noise[i].exponential_(generator=generators[i])
        return noise


def adjust_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The logits after the penalties and the logit bias: what temperature and top-k/p see."""
    adjusted = _apply_penalties(logits, meta)
    if meta.logit_bias is None:
        return adjusted
    return logits + meta.logit_bias if adjusted is logits else adjusted.add_(meta.logit_bias)


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.repetition_penalty is None:
        return logits
    # The plain form is where(x > 0, x / p, x * p) - f * counts - q * (counts > 0). This
    # gives the same bits (NaN's sign aside) with fewer fresh [N, vocab] tensors (each costs
    # a pass of page faults on CPU) and no three-tensor torch.where (several times slower
    # than arithmetic). Repetition penalty (CTRL / HF): x / p is the smaller of the two
    # when p >= 1 and the larger when p < 1 (rounding keeps the order); rows with p < 1
    # take the max as -min(-a, -b).
    penalty = torch.where(meta.seen_mask, meta.repetition_penalty, 1.0)
    adjusted = logits * penalty
    scratch = torch.div(logits, penalty, out=penalty)
    below_one = meta.repetition_penalty < 1.0
    # on CPU the check is free and saves two passes; on a GPU it would be a host sync
    flipped = logits.device.type != "cpu" or bool(below_one.any())
    flip = torch.where(below_one, -1.0, 1.0) if flipped else None
    if flip is not None:
        adjusted.mul_(flip)
        scratch.mul_(flip)
    torch.minimum(adjusted, scratch, out=adjusted)
    if flip is not None:
        adjusted.mul_(flip)
    # Frequency / presence penalties (OpenAI), in that order; clamp(counts, 1) is counts > 0.
    counts = meta.output_counts
    adjusted -= torch.mul(meta.frequency_penalty, counts, out=scratch)
    adjusted -= torch.clamp(counts, max=1.0, out=scratch).mul_(meta.presence_penalty)
    return adjusted


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _with_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
    """Tokens with their log-probabilities, ranks and top k, brought to the host in one
    copy (one [N, 3 + 2k] float64 table: ids are exact in it)."""
    sampled = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > sampled).sum(dim=1, keepdim=True) + 1
    columns = [tokens.unsqueeze(1).double(), sampled.double(), ranks.double()]
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        columns += [top.indices.double(), top.values.double()]
    table = torch.cat(columns, dim=1).tolist()  # the one copy
    rows = range(len(table))
    return SamplerOutput(
        token_ids=[int(r[0]) for r in table],
        sampled_logprobs=[r[1] for r in table],
        sampled_ranks=[int(r[2]) for r in table],
        top_token_ids=[[int(t) for t in r[3 : 3 + k]] for r in table]
        if k > 0
        else [[] for _ in rows],
        top_logprobs=[r[3 + k :] for r in table] if k > 0 else [[] for _ in rows],
    )
