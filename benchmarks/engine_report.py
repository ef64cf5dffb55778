"""Reporting for bench_engine.py: per-peer summaries -> a markdown table and a bar chart.

The table is what docs/benchmarks.md quotes; the chart (two panels: batch-1 decode and
batch throughput, one bar per peer and dtype, each labelled with its ratio to infire)
is docs/benchmarks-engine.png.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

INFIRE_COLORS = ["#d9480f", "#f08c00"]
PEER_COLORS = {"transformers": "#5c7cfa", "llama.cpp": "#495057"}


@dataclass(frozen=True, slots=True)
class PeerSummary:
    """Medians of one peer's measurements (None where not measured)."""

    label: str
    engine: str
    weights: str
    decode_tok_s: float | None  # batch 1, (N - 1) / (t(N tokens) - t(1 token))
    first_token_ms: float | None  # batch 1, short prompt
    prefill_tok_s: float | None  # batch 1, longer prompt, max_tokens=1
    batch_tok_s: float | None  # output tokens / wall time of the whole batch
    roofline_tok_s: float | None  # read bandwidth / weight bytes per token
    stream_decode_tok_s: float | None  # from per-token timestamps (llama.cpp only)
    batch_prefill_tok_s: float | None  # per-request first-token times in the batch (llama.cpp)
    greedy_agreement: int | None  # leading tokens equal to transformers float32's
    max_others_cores: float | None  # most CPU other processes took during a measurement
    error: str | None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def best_of(summaries: list[PeerSummary], engine: str, metric: str) -> PeerSummary | None:
    """The peer of `engine` with the highest `metric`, if any was measured."""
    measured = [s for s in summaries if s.engine == engine and getattr(s, metric)]
    return max(measured, key=lambda s: getattr(s, metric), default=None)


def results_table(summaries: list[PeerSummary], plan: dict[str, str]) -> list[str]:
    """One row per peer and dtype."""
    rows = [
        f"| engine | weights | batch-1 decode tok/s | first token ms | prefill tok/s "
        f"| batch-{plan['batch_size']} output tok/s | decode roofline tok/s | decode / roofline |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        fraction = _fmt(s.decode_tok_s / s.roofline_tok_s, 2) if s.decode_tok_s else "n/a"
        rows.append(
            f"| {s.engine} | {s.weights} | {_fmt(s.decode_tok_s)} | {_fmt(s.first_token_ms)} "
            f"| {_fmt(s.prefill_tok_s, 0)} | {_fmt(s.batch_tok_s)} "
            f"| {_fmt(s.roofline_tok_s)} | {fraction} |"
        )
    return rows


def ratio_table(summaries: list[PeerSummary], plan: dict[str, str]) -> list[str]:
    """infire (each dtype) over transformers' best dtype and over llama.cpp, per workload."""
    metrics = ["decode_tok_s", "prefill_tok_s", "batch_tok_s"]
    rows = [
        f"| ratio | batch-1 decode | prefill | batch-{plan['batch_size']} throughput |",
        "|---|--:|--:|--:|",
    ]
    for mine in (s for s in summaries if s.engine == "infire"):
        for engine, name in [("transformers", "transformers best"), ("llama.cpp", "llama.cpp")]:
            cells = []
            for metric in metrics:
                peer = best_of(summaries, engine, metric)
                cells.append(_ratio(getattr(mine, metric), getattr(peer, metric, None)))
            rows.append(f"| infire {mine.weights} / {name} | {' | '.join(cells)} |")
        rows.append(
            f"| infire {mine.weights} / its roofline | "
            f"{_ratio(mine.decode_tok_s, mine.roofline_tok_s)} | | |"
        )
    return rows


def markdown_report(
    summaries: list[PeerSummary],
    plan: dict[str, str],
    bandwidth: dict[str, float],
    weights: dict[str, Any],
    llamacpp_error: str | None,
) -> str:
    """The tables and the notes docs/benchmarks.md needs, as markdown."""
    lines = [
        f"Workloads: batch-1 decode and first token: {plan['single']}; prefill: "
        f"{plan['prefill']}, max_tokens=1; batch: {plan['batch']}.",
        f"Read bandwidth {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s (torch.sum), copy "
        f"{bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s; {weights['parameters'] / 1e6:.1f}M "
        f"parameters, {weights['gguf_bytes'] / 1e6:.1f} MB as {weights['gguf_format']} GGUF.",
        "",
        *results_table(summaries, plan),
        "",
        *ratio_table(summaries, plan),
    ]
    extras = [s for s in summaries if s.stream_decode_tok_s or s.batch_prefill_tok_s]
    for s in extras:
        lines.append(
            f"\n{s.label}: decode from per-token timestamps {_fmt(s.stream_decode_tok_s)} tok/s; "
            f"prefill of the batch prompts {_fmt(s.batch_prefill_tok_s, 0)} tok/s."
        )
    agreement = [
        f"{s.label} {s.greedy_agreement}" for s in summaries if s.greedy_agreement is not None
    ]
    if agreement:
        lines.append(
            "\nGreedy tokens equal to transformers float32's (leading): "
            + ", ".join(agreement)
            + "."
        )
    disturbance = [s.max_others_cores for s in summaries if s.max_others_cores is not None]
    if disturbance:
        lines.append(
            f"\nOther processes used at most {max(disturbance):.2f} cores during any "
            "measurement kept."
        )
    if llamacpp_error:
        lines.append(f"\nllama.cpp: not available ({llamacpp_error}).")
    lines += [f"\n{s.label}: failed mid-run ({s.error})." for s in summaries if s.error]
    return "\n".join(lines)


def plot(summaries: list[PeerSummary], path: Path, batch_size: int) -> None:
    """Two panels of bars (batch-1 decode, batch throughput), labelled with ratio to infire."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("decode_tok_s", "batch-1 decode, tok/s"),
        ("batch_tok_s", f"batch-{batch_size} output throughput, tok/s"),
    ]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for axis, (metric, title) in zip(axes, panels, strict=True):
        _panel(axis, summaries, metric, title)
    figure.suptitle("infire vs transformers vs llama.cpp, SmolLM2-135M, CPU (2 threads)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _panel(axis: Any, summaries: list[PeerSummary], metric: str, title: str) -> None:
    shown = [s for s in summaries if getattr(s, metric)]
    reference = best_of(summaries, "infire", metric)
    values = [getattr(s, metric) for s in shown]
    colors = [_color(s, summaries) for s in shown]
    bars = axis.bar([s.label.replace(" ", "\n", 1) for s in shown], values, color=colors)
    for bar, value in zip(bars, values, strict=True):
        text = f"{value:,.0f}"
        if reference is not None:
            text += f"\n{value / getattr(reference, metric):.2f}x"
        axis.annotate(text, (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    if reference is not None:
        axis.set_xlabel(f"ratio: bar / {reference.label} (best infire)")
    if metric == "decode_tok_s" and reference is not None and reference.roofline_tok_s:
        axis.axhline(reference.roofline_tok_s, color="#d9480f", linestyle="--", linewidth=1)
        axis.annotate(
            f"{reference.label} roofline {reference.roofline_tok_s:.0f}",
            (-0.4, reference.roofline_tok_s), va="bottom", color="#d9480f", fontsize=8,
        )  # fmt: skip
    axis.set_title(title)
    axis.set_ylim(0, max(values + [1]) * 1.25)
    axis.tick_params(axis="x", labelsize=8)


def _color(summary: PeerSummary, summaries: list[PeerSummary]) -> str:
    if summary.engine != "infire":
        return PEER_COLORS.get(summary.engine, "#868e96")
    index = [s.label for s in summaries if s.engine == "infire"].index(summary.label)
    return INFIRE_COLORS[index % len(INFIRE_COLORS)]
