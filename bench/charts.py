"""PNG charts of a benchmark run, next to the tables in bench/README.md (matplotlib, from the
`bench` extra: pip install ".[bench]")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Per scenario: (title, value) pairs to plot, each from one target's result.
PANELS: dict[str, list[tuple[str, Any]]] = {
    "S1": [
        ("requests/s", lambda r: r.load["rps"]),
        ("proxy CPU µs per request", lambda r: r.cpu_s.get("proxy", 0) / max(r.load["requests"], 1) * 1e6),
    ],
    "S2": [
        ("events/s", lambda r: r.load["events_per_s"]),
        ("proxy CPU µs per event", lambda r: r.cpu_s.get("proxy", 0) / max(r.load["events"], 1) * 1e6),
    ],
    "S3": [
        ("inter-event gap p99, ms", lambda r: r.load["gap_ms"]["p99"] if r.load.get("gap_ms") else 0),
        ("proxy CPU µs per event", lambda r: r.cpu_s.get("proxy", 0) / max(r.load["events"], 1) * 1e6),
    ],
    "S4": [
        ("latency p50, ms", lambda r: r.load["latency_ms"]["p50"]),
        ("latency p99, ms", lambda r: r.load["latency_ms"]["p99"]),
    ],
    "PD": [
        ("TTFT p50, ms", lambda r: r.load["ttft_ms"]["p50"]),
        ("TTFT p99, ms", lambda r: r.load["ttft_ms"]["p99"]),
    ],
}


def render(name: str, title: str, results: dict[str, Any], out_dir: Path) -> Path | None:
    """Writes ``<name>.png``; returns its path, or None without matplotlib or panels."""
    panels = PANELS.get(name)
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    targets = list(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5, 0.8 * len(targets)) * len(panels), 3.2))
    for ax, (label, value) in zip(axes, panels, strict=True):
        values = [value(results[t]) for t in targets]
        colors = ["#2b6cb0" if t.startswith("pdproxy") else "#a0aec0" for t in targets]
        bars = ax.bar(targets, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
