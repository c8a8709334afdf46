"""The demo's live view: a rich table on a terminal, one plain line per poll otherwise."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from ddiloco.demo.config import LOG_EVERY_STEPS, DemoConfig, model_config

if TYPE_CHECKING:
    from ddiloco.demo.supervisor import LearnerProcess, LossLog, SyncerProcess

__all__ = ["DECISION_CHARS_MAX", "PlainView", "RichView", "fit_words", "learner_rows", "make_view", "newest_rows"]

DECISION_CHARS_MAX = 60  # the last decision's reason on a plain line, shortened at a word boundary


def fit_words(text: str, width: int) -> str:
    """`text` in at most `width` characters, shortened at a word boundary with " ..." when it is
    longer: a reason cut mid-word ("merged 1/2 (quor") reads as a different word or a number."""
    if len(text) <= width:
        return text
    shortened = textwrap.shorten(text, width, placeholder=" ...")
    # A first word longer than the whole width leaves only the placeholder: then that word, cut, is
    # still more use than three dots.
    return shortened if shortened != "..." else text[: max(0, width - 3)] + "..."


def newest_rows(status: dict) -> dict[str, dict]:
    """name -> the status row with the highest id (a restarted learner is a new id, same name)."""
    rows: dict[str, dict] = {}
    for r in sorted(status.get("learners", []), key=lambda r: r["id"]):
        rows[r["name"]] = r
    return rows


def learner_rows(status: dict, learners: list[LearnerProcess], logs: list[LossLog], cfg: DemoConfig) -> list[dict]:
    rows = newest_rows(status)
    out = []
    for lr, log in zip(learners, logs):
        r = rows.get(f"learner-{lr.index}")
        # A process that has not joined yet says what it is doing (demo/learner_process.py): the
        # first compile of its step takes seconds to tens of seconds, before the syncer hears of it.
        state = (
            "done"
            if lr.done
            else "stopping"
            if lr.stopping
            else "killed"
            if lr.killed_at is not None
            else "paused"
            if lr.paused_until
            else log.phase
            if log.phase in ("starting", "compiling")
            else (r["status"] if r else "joining")
        )
        out.append(
            {
                "learner": lr.index,
                "state": state,
                "step": r["step"] if r else None,
                "tokens": len(log.points) * LOG_EVERY_STEPS * cfg.batch * model_config(cfg).seq,
                "loss": log.points[-1][1] if log.points else None,
                "versions": r["versions"] if r else None,
                "restarts": lr.restarts,
            }
        )
    return out


def _headline(now: float, status: dict, syncer: SyncerProcess) -> tuple[str, str]:
    if not status:
        return f"[{now:6.1f}s] syncer {'down' if syncer.killed_at is not None else 'starting'}", ""
    versions = ",".join(str(f["version"]) for f in status.get("fragments", []))
    last = status["decisions"][-1]["reason"] if status.get("decisions") else ""
    return f"[{now:6.1f}s] step {status['global_step']:4d} merges {status['merges']:4d} v[{versions}]", last


class PlainView:
    """One line per poll: for logs, pipes and terminals without rich."""

    def __init__(self, out) -> None:
        self.out = out

    def note(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def update(self, now, status, learners, logs, cfg, syncer) -> None:
        head, last = _headline(now, status, syncer)
        cells = " ".join(
            f"L{r['learner']}:{r['state']}@{'-' if r['step'] is None else r['step']}"
            for r in learner_rows(status, learners, logs, cfg)
        )
        print(f"{head} {cells} | {fit_words(last, DECISION_CHARS_MAX)}", file=self.out, flush=True)

    def close(self) -> None:
        pass


class RichView:
    """A live table on a terminal: per learner state, step, tokens, loss, fragment versions."""

    def __init__(self, out) -> None:
        from rich.console import Console
        from rich.live import Live

        self.live = Live(console=Console(file=out), refresh_per_second=4)
        self.live.start()

    def note(self, text: str) -> None:
        self.live.console.print(text)

    def update(self, now, status, learners, logs, cfg, syncer) -> None:
        from rich.table import Table

        head, last = _headline(now, status, syncer)
        table = Table(title=head, caption=f"last decision: {last}" if last else None, expand=False)
        for name in ("learner", "state", "step", "tokens", "loss", "versions held", "restarts"):
            table.add_column(name, justify="left" if name in ("state", "versions held") else "right")
        for r in learner_rows(status, learners, logs, cfg):
            table.add_row(
                str(r["learner"]),
                r["state"],
                "-" if r["step"] is None else str(r["step"]),
                f"{r['tokens']:,}",
                "-" if r["loss"] is None else f"{r['loss']:.3f}",
                "-" if r["versions"] is None else ",".join(map(str, r["versions"])),
                str(r["restarts"]),
            )
        self.live.update(table)

    def close(self) -> None:
        self.live.stop()


def make_view(out):
    """A rich live table when `out` is a terminal and rich is installed, plain lines otherwise."""
    if not (hasattr(out, "isatty") and out.isatty()):
        return PlainView(out)
    try:
        import rich.live  # noqa: F401  (the learner extra brings it; without it, plain lines)
    except ImportError:
        return PlainView(out)
    return RichView(out)
