"""The demo's plot: train loss against tokens, the held-out losses and the kills, as a PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddiloco.demo.report import DemoReport

__all__ = ["write_plot"]


def write_plot(r: DemoReport, path: Path) -> None:
    """A PNG of train loss against tokens for the learners and the data-parallel baseline, the
    final held-out losses as markers, and the kills as vertical lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "--plot needs matplotlib: install the learner extra (pip install 'ddiloco[learner]')"
        ) from exc
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for key, label, color in (
        ("learners", "Decoupled DiLoCo learners (train, mean)", "tab:blue"),
        ("baseline", "data-parallel (train)", "tab:orange"),
    ):
        pts = np.array(r.curves.get(key) or [], dtype=float).reshape(-1, 2)
        if pts.size:
            ax.plot(pts[:, 0], pts[:, 1], label=label, color=color)
    end = max((p[0] for c in r.curves.values() for p in c), default=0.0)
    ax.scatter([end], [r.eval_loss], marker="*", s=120, color="tab:blue", zorder=3, label="merged model (held-out)")
    if r.baseline_eval_loss is not None:
        ax.scatter(
            [end],
            [r.baseline_eval_loss],
            marker="*",
            s=120,
            color="tab:orange",
            zorder=3,
            label="data-parallel (held-out)",
        )
    for e in r.events:
        if e["what"] in ("kill", "kill-syncer"):
            ax.axvline(e["tokens"], color="tab:red" if e["what"] == "kill" else "black", linestyle="--", linewidth=1)
    if r.kills:
        ax.plot([], [], color="tab:red", linestyle="--", label="learner killed")
    if r.syncer_kills:
        ax.plot([], [], color="black", linestyle="--", label="syncer killed")
    ax.set_xlabel("tokens (all learners)")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("ddiloco demo: loss against tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
