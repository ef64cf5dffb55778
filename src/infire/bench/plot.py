"""PNG plots of `infire bench serve` results (matplotlib, from the `bench` extra).

`plot_run`: one run's latency distributions (TTFT, TPOT, ITL, E2E) with p50 / p90 marks.
`plot_compare`: several runs side by side: output tokens/s, p50 TTFT, p90 TPOT and p90
E2E against the load (max concurrency or request rate), one line per label.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from infire.bench.serve import METRICS, RequestResult, latency_series
from infire.errors import InvalidRequestError

_TITLES = {"ttft": "time to first token", "tpot": "time per output token",
           "itl": "inter-token latency", "e2el": "end-to-end latency"}  # fmt: skip


def pyplot():  # noqa: ANN201 (matplotlib's module)
    try:
        import matplotlib
    except ImportError:
        raise InvalidRequestError(
            "plots need matplotlib: pip install 'infire[bench]' (or pass --no-plot)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure: object, path: Path) -> Path:
    """Lay out, write (110 dpi, the folder made) and close a benchmark's figure."""
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot().close(figure)
    return path


def plot_run(result: dict, path: Path) -> Path:
    """Histograms of one run's latencies."""
    plt = pyplot()
    s, settings = result["summary"], result["settings"]
    series = latency_series([RequestResult(**r) for r in result["requests"]])
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, name in zip(axes.flat, METRICS, strict=True):
        values = [v * 1000 for v in series[name]]
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
            for stat, style in (("p50", "--"), ("p90", ":")):
                value = s[f"{stat}_{name}_ms"]
                ax.axvline(value, color="black", linestyle=style, label=f"{stat} {value:.1f} ms")
            ax.legend()
        ax.set_title(f"{name.upper()}: {_TITLES[name]}")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle(
        f"{settings['label']}: {s['completed']} requests, {s['output_throughput']:.1f} output "
        f"tok/s, max concurrency {settings['max_concurrency'] or 'unlimited'}, "
        f"rate {settings['request_rate']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _load_level(result: dict) -> tuple[str, float]:
    settings = result["settings"]
    if settings["max_concurrency"]:
        return "max concurrency", float(settings["max_concurrency"])
    rate = settings["request_rate"]
    return "request rate (req/s)", float("inf") if rate == "inf" else float(rate)


def plot_compare(results: list[dict], path: Path) -> Path:
    """Several runs against their load, one line per label."""
    if not results:
        raise InvalidRequestError("--compare needs at least one result file")
    plt = pyplot()
    axis = {_load_level(r)[0] for r in results}
    if len(axis) > 1:
        raise InvalidRequestError(
            "--compare: mix of fixed-concurrency and request-rate runs; compare one kind"
        )
    panels = (("output_throughput", "output tokens/s"), ("p50_ttft_ms", "p50 TTFT (ms)"),
              ("p90_tpot_ms", "p90 TPOT (ms)"), ("p90_e2el_ms", "p90 E2E latency (ms)"))  # fmt: skip
    xlabel = axis.pop()
    labels = list(dict.fromkeys(r["settings"]["label"] for r in results))
    levels = sorted({_load_level(r)[1] for r in results})
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for label in labels:
            points = sorted(
                (levels.index(_load_level(r)[1]), r["summary"][key])
                for r in results
                if r["settings"]["label"] == label
            )
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xticks(np.arange(len(levels)), [f"{level:g}" for level in levels])
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
