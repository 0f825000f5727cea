"""Reward and loss curves of a run as a PNG, drawn with matplotlib.

``plot_metrics(metrics.jsonl, out.png, phase)`` plots the ``phase`` rows (rewards and accuracies
in [0, 1] above, losses below, against the step). matplotlib comes with the recipes' extra
(``pip install 'fsdpfn[recipes]'``); without it no PNG is written and ``plot_metrics`` returns
None (the metrics themselves are always in metrics.jsonl, and in TensorBoard on request).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["plot_metrics", "read_metrics", "plotting_available"]

# (metrics key, matplotlib colour) per panel; a key is drawn when the rows carry it
_TOP = (("reward_mean", "tab:blue"), ("accuracy", "tab:blue"), ("reward_accuracy", "tab:blue"),
        ("greedy_accuracy", "tab:green"), ("eval_accuracy", "tab:green"),
        ("eval_p_correct", "tab:purple"))
_BOTTOM = (("loss", "tab:orange"), ("eval_loss", "tab:red"), ("critic_loss", "tab:green"))
# drawn only when the rows carry it: generation ahead of training (rollout.max_staleness)
_STALE = (("staleness_mean", "tab:blue"), ("staleness_max", "tab:red"),
          ("trainer_wait_seconds", "tab:green"), ("rollout_wait_seconds", "tab:purple"))
_TITLES = {"sft": "held-out p(correct)", "rw": "pair accuracy", "dpo": "preference accuracy"}


def read_metrics(path: str | Path) -> list[dict]:
    """The JSON lines of ``path`` (a line cut short by a kill is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    return [(float(r["step"]), float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_metrics(metrics_path: str | Path, png_path: str | Path, *,
                 phase: str) -> Path | None:
    """Plot the ``phase`` rows of a metrics.jsonl file; None without matplotlib."""
    if not plotting_available():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if r.get("phase") == phase]
    panels = ((f"{phase} {_TITLES.get(phase, 'reward')}", _TOP), (f"{phase} loss", _BOTTOM))
    if _series(rows, "staleness_max"):
        panels += ((f"{phase} staleness (versions) and waits (s)", _STALE),)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), sharex=True)
    for ax, (title, keys) in zip(axes, panels):
        for key, color in keys:
            points = _series(rows, key)
            if points:
                ax.plot(*zip(*points), label=key, color=color,
                        marker="o" if len(points) == 1 else None)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
