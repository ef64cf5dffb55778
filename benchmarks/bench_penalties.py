"""The penalty-heavy sampling step before and after SamplingState, in one run.

Before: the runner's old metadata builder and the sampler's old penalty code (copied below
as `from_scratch_metadata` and `from_scratch_adjust`): every step they rebuild the seen
mask and output counts ([N, vocab]) from each sequence's whole token list, the logit bias
with a Python loop, and apply the penalties through fresh [N, vocab] temporaries. After:
`SamplingState`, which keeps those rows per sequence across steps and absorbs only the
tokens new since the last step, and `Sampler` as it is now. Each batch is N sequences of
L tokens (half prompt, half output) over SmolLM2's vocabulary (49152), every one with
repetition, frequency and presence penalties and a logit bias of 8 tokens; greedy, or
sampled at temperature 0.8 with a seed per sequence. As a decode loop runs them: one
untimed step first (the state absorbs the whole prompts then, also timed and reported),
after which every step appends one sampled token per sequence, times both paths on the
same batch and logits (in alternating order, so the host's drift hits them alike) and
checks that they sampled the same tokens. Reported: the median over the steps of the
metadata alone and of metadata + sampling (the sampling step), in milliseconds, on 2 CPU
threads (or on a GPU with --device cuda). Results: benchmarks/results/penalties.json,
docs/benchmarks-penalties.png, and a markdown table.

    .venv/bin/python benchmarks/bench_penalties.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from infire.engine.request import Sequence
from infire.engine.sampling_state import SamplingState
from infire.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from infire.outputs import RequestMetrics
from infire.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
VOCAB = 49152  # SmolLM2's
THREADS = 2
BATCHES = ((32, 256), (64, 1024))  # (sequences, tokens per sequence)
MODES = {"greedy": 0.0, "sampled": 0.8}  # temperature

Step = Callable[[list[Sequence], torch.Tensor], SamplerOutput]


def from_scratch_metadata(seqs: list[Sequence], vocab: int, dev: torch.device) -> SamplingMetadata:
    """The runner's sampling metadata as it was built before SamplingState (the baseline)."""
    params = [seq.params for seq in seqs]
    meta = SamplingMetadata(
        temperature=_floats([p.temperature for p in params], dev),
        top_k=None,
        top_p=None,
        min_p=None,
        generators=[seq.generator for seq in seqs],
        all_greedy=all(p.greedy for p in params),
    )
    if any(p.top_k > 0 for p in params):
        meta.top_k = torch.tensor([p.top_k for p in params], device=dev)
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = _floats([p.top_p for p in params], dev)
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = _floats([p.min_p for p in params], dev)
    if any(p.uses_penalties for p in params):
        meta.repetition_penalty = _floats([s.params.repetition_penalty for s in seqs], dev)[:, None]
        meta.frequency_penalty = _floats([s.params.frequency_penalty for s in seqs], dev)[:, None]
        meta.presence_penalty = _floats([s.params.presence_penalty for s in seqs], dev)[:, None]
        meta.seen_mask = torch.zeros(len(seqs), vocab + 1, dtype=torch.bool, device=dev)
        meta.output_counts = torch.zeros(len(seqs), vocab + 1, device=dev)
        seen = _padded([s.token_ids for s in seqs], vocab, dev)
        outputs = _padded([s.output_token_ids for s in seqs], vocab, dev)
        meta.seen_mask.scatter_(1, seen, True)
        meta.output_counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
        meta.seen_mask = meta.seen_mask[:, :vocab]
        meta.output_counts = meta.output_counts[:, :vocab]
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(wanted) if wanted else None
    if any(p.logit_bias for p in params):
        meta.logit_bias = torch.zeros(len(params), vocab, device=dev)
        for row, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                meta.logit_bias[row, token] = bias
    return meta


def from_scratch_adjust(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The sampler's old penalties and logit bias (the baseline)."""
    penalty = torch.where(meta.seen_mask, meta.repetition_penalty, 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    counts = meta.output_counts
    logits = logits - meta.frequency_penalty * counts - meta.presence_penalty * (counts > 0)
    return logits + meta.logit_bias


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)


def make_batch(
    num_seqs: int, num_tokens: int, temperature: float, device: torch.device, rng: random.Random
) -> list[Sequence]:
    """Penalty-heavy sequences, half prompt and half output, seeded so both paths can agree."""
    seqs = []
    for seq_id in range(num_seqs):
        params = SamplingParams(
            temperature=temperature, seed=seq_id, max_tokens=None,
            repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3,
            logit_bias={rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(8)},
        )  # fmt: skip
        prompt = [rng.randrange(VOCAB) for _ in range(num_tokens // 2)]
        seq = Sequence(
            seq_id=seq_id, request_id=str(seq_id), index=0, prompt_token_ids=prompt,
            params=params, detokenizer=None, metrics=RequestMetrics(0.0),  # type: ignore[arg-type]
            generator=torch.Generator(device).manual_seed(seq_id),
        )  # fmt: skip
        seq.token_ids += [rng.randrange(VOCAB) for _ in range(num_tokens - len(prompt))]
        seqs.append(seq)
    return seqs


def before_step(sampler: Sampler, device: torch.device) -> Callable:
    """Old metadata, old penalties, then the sampler on the adjusted logits (as it was)."""

    def build(seqs: list[Sequence]) -> tuple[SamplingMetadata, Callable]:
        meta = from_scratch_metadata(seqs, VOCAB, device)
        rest = replace(meta, repetition_penalty=None, logit_bias=None)
        return meta, lambda logits: sampler(from_scratch_adjust(logits, meta), rest)

    return build


def after_step(sampler: Sampler, state: SamplingState) -> Callable:
    """SamplingState's metadata, then the sampler as it is now."""

    def build(seqs: list[Sequence]) -> tuple[SamplingMetadata, Callable]:
        meta = state.metadata(seqs)
        return meta, lambda logits: sampler(logits, meta)

    return build


def timed_step(
    build: Callable, seqs: list[Sequence], logits: torch.Tensor
) -> tuple[float, float, SamplerOutput]:
    """Seconds for the metadata and for metadata + sampling, and what was sampled."""
    states = [seq.generator.get_state() for seq in seqs]  # both paths draw the same noise
    sync = torch.cuda.synchronize if logits.is_cuda else lambda: None
    sync()
    start = time.perf_counter()
    _, sample = build(seqs)
    sync()
    built = time.perf_counter()
    out = sample(logits)  # ends in .tolist(): synchronized
    done = time.perf_counter()
    for seq, state in zip(seqs, states, strict=True):
        seq.generator.set_state(state)
    return built - start, done - start, out


def measure(num_seqs: int, num_tokens: int, mode: str, steps: int, device: torch.device) -> dict:
    """Median timings of both paths over `steps` decode steps of one batch."""
    rng = random.Random(num_seqs * num_tokens)
    seqs = make_batch(num_seqs, num_tokens, MODES[mode], device, rng)
    sampler = Sampler(torch.Generator(device).manual_seed(0))
    paths = {
        "before": before_step(sampler, device),
        "after": after_step(sampler, SamplingState(VOCAB, device)),
    }
    gen = torch.Generator(device).manual_seed(1)
    logits = torch.randn(num_seqs, VOCAB, generator=gen, device=device) * 3
    first = {name: 1000 * timed_step(build, seqs, logits)[1] for name, build in paths.items()}
    samples: dict[str, dict[str, list[float]]] = {n: {"meta": [], "step": []} for n in paths}
    for step in range(steps):
        order = list(paths) if step % 2 == 0 else list(reversed(paths))
        outputs = {}
        for name in order:
            meta_s, step_s, outputs[name] = timed_step(paths[name], seqs, logits)
            samples[name]["meta"].append(meta_s)
            samples[name]["step"].append(step_s)
        if outputs["before"].token_ids != outputs["after"].token_ids:
            raise SystemExit(f"{mode} {num_seqs}x{num_tokens}: the paths differ at step {step}")
        for seq, token in zip(seqs, outputs["after"].token_ids, strict=True):
            seq.token_ids.append(token)
        logits = logits.roll(1, dims=1)  # other logits each step, at no cost to either path
    ms = lambda values: 1000 * statistics.median(values)  # noqa: E731
    return {
        "num_seqs": num_seqs, "num_tokens": num_tokens, "mode": mode, "steps": steps,
        "first_step_ms": first,
        **{f"{name}_{part}_ms": ms(values[part]) for name, values in samples.items()
           for part in ("meta", "step")},
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    """Markdown: one line per batch and mode, before and after side by side."""
    lines = [
        "| batch (seqs x tokens) | mode | metadata before / after ms "
        "| sampling step before / after ms | step speedup "
        "| first step (absorbs prompts) before / after ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = r["first_step_ms"]
        lines.append(
            f"| {r['num_seqs']} x {r['num_tokens']} | {r['mode']} "
            f"| {r['before_meta_ms']:.2f} / {r['after_meta_ms']:.2f} "
            f"| {r['before_step_ms']:.2f} / {r['after_step_ms']:.2f} "
            f"| {r['before_step_ms'] / r['after_step_ms']:.1f}x "
            f"| {first['before']:.2f} / {first['after']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Per mode, bars per batch: before and after, metadata and the rest stacked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"before": "#6366f1", "after": "#f97316"}
    labels = {"before": "before (rebuilt each step)", "after": "after (SamplingState)"}
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False)
    width = 0.38
    for ax, mode in zip(axes[0], modes, strict=True):
        cells = [r for r in rows if r["mode"] == mode]
        for k, name in enumerate(("before", "after")):
            xs = [i + (k - 0.5) * width for i in range(len(cells))]
            meta = [r[f"{name}_meta_ms"] for r in cells]
            rest = [r[f"{name}_step_ms"] - r[f"{name}_meta_ms"] for r in cells]
            ax.bar(xs, meta, width, color=colors[name], label=f"{labels[name]}: metadata")
            bars = ax.bar(xs, rest, width, bottom=meta, color=colors[name], alpha=0.4,
                          label=f"{labels[name]}: sampler")  # fmt: skip
            ax.bar_label(bars, labels=[f"{r[f'{name}_step_ms']:.1f}" for r in cells],
                         fontsize=8, padding=2)  # fmt: skip
        ax.set_xticks(range(len(cells)), [f"{r['num_seqs']} seqs x {r['num_tokens']} tokens"
                                          for r in cells])  # fmt: skip
        ax.set_title(f"{mode}: ms per sampling step (median, lower is better)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="timed decode steps per batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "benchmarks-penalties.png")
    parser.add_argument("--json", type=Path, default=RESULTS / "penalties.json")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    device = torch.device(args.device)
    rows = [measure(n, tokens, mode, args.steps, device)
            for mode in MODES for n, tokens in BATCHES]  # fmt: skip
    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"{THREADS} threads of {platform.processor() or platform.machine()}"
    )  # fmt: skip
    title = f"penalty-heavy sampling step, vocab {VOCAB}, {where}, torch {torch.__version__}"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"title": title, "rows": rows}, indent=2) + "\n")
    plot(rows, args.plot, title)
    print(title)
    print(table(rows))
    print(f"\n{args.json}\n{args.plot}")


if __name__ == "__main__":
    main()
