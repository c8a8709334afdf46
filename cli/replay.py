"""`ddiloco replay TAPE_DIR`: run the syncer core over a recorded tape and check it bit for bit.

Prints the events replayed, the merges checked, the time taken and OK, or the first diverging
event. Exit status 0 when every recorded fragment version (and, at a clean end, the final state
hash) is reproduced, 1 on a divergence, 2 when the tape cannot be used (corrupt, or recorded
without payloads). A torn tail (a syncer killed mid-write) is cut from what is read, with a note;
the file itself is left as it is.

`ddiloco replay DIR --full` takes a whole run recorded by `ddiloco demo --record DIR`: it trains
every learner again in this process, following its tape, and replays the syncer's tape(s) with the
pushes the learners made again (demo.replay). Same exit statuses.

Without `--full`, a directory that holds no tape itself but syncer tapes in subfolders (a demo's
`syncer/`, `syncer.2/`...) has those replayed, one after the other, when they kept their payloads;
a demo's did not (it records them with `--record-no-payloads`), and the answer is one line that
says to use `--full`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ddiloco.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "tape_dir",
        type=Path,
        metavar="TAPE_DIR",
        help="a directory written by `ddiloco syncer --record` (or by `ddiloco demo --record` with --full)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="re-execute the learners of a recorded demo too and reproduce the final merged parameters",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    import orjson

    from ddiloco.core import tape

    started = time.perf_counter()
    try:
        doc = _full(args) if args.full else _syncer_only(args)
    except (tape.TapeError, ValueError) as exc:
        print(f"ddiloco replay: bad tape: {exc}", file=sys.stderr)
        return 2
    doc["seconds"] = time.perf_counter() - started
    print(f"time             {doc['seconds']:.3f} s")
    print("OK: bit-identical" if doc["ok"] else f"DIVERGED at {doc['divergence_text']}")
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 0 if doc["ok"] else 1


def _result_json(result) -> dict:
    d = result.divergence
    return {
        "ok": result.ok,
        "events": result.events,
        "merges_checked": result.merges_checked,
        "final_checked": result.final_checked,
        "state_hash": result.state_hash,
        "torn": result.torn,
        "divergence": None
        if d is None
        else {"index": d.index, "event": d.event, "what": d.what, "expected": d.expected, "got": d.got},
    }


def _print_syncer(result, name: str = "") -> None:
    prefix = f"{name}: " if name else ""
    if result.torn:
        print(f"warning: {prefix}{result.torn}", file=sys.stderr)
    print(f"{prefix}events replayed  {result.events}")
    print(f"{prefix}merges checked   {result.merges_checked}")
    final = "checked" if result.final_checked else "not checked: no close record, the run did not end cleanly"
    print(f"{prefix}final state hash {result.state_hash[:16]} ({final})")


class NotASyncerTape(UserError):
    """A directory given to `ddiloco replay` without --full that holds no syncer tape it can replay."""


def _syncer_only(args: argparse.Namespace) -> dict:
    from ddiloco.core import replay
    from ddiloco.core.tape import TAPE_FILE
    from ddiloco.net import recording

    if not args.tape_dir.is_dir():
        raise NotASyncerTape(f"{args.tape_dir} is not a directory: a tape is the directory `--record DIR` wrote")
    if (args.tape_dir / TAPE_FILE).is_file():
        result = replay.replay(recording.read(args.tape_dir))
        _print_syncer(result)
        return {**_result_json(result), "divergence_text": str(result.divergence)}
    inner = _syncer_tapes_under(args.tape_dir, TAPE_FILE)
    if not inner:
        raise NotASyncerTape(
            f"{args.tape_dir} holds no syncer tape ({TAPE_FILE}, itself or in a subfolder): "
            "give a directory written by `ddiloco syncer --record DIR`, "
            "or `ddiloco demo --record DIR` with --full"
        )
    tapes = [(d.name, recording.read(d)) for d in inner]
    if not all(t.header.get("keep_payloads", True) for _, t in tapes):
        # Checked before replaying anything: the answer is the same whichever tape comes first.
        raise NotASyncerTape(
            f"{args.tape_dir} is a recorded demo: its syncer tapes keep no payloads (the learners' "
            f"tapes make them again), so replay it whole with `ddiloco replay {args.tape_dir} --full`"
        )
    which = "tape in" if len(tapes) == 1 else "tapes in"
    print(
        f"{args.tape_dir}: replaying the syncer {which} {', '.join(n + '/' for n, _ in tapes)} "
        "(--full re-executes the learners too)"
    )
    results = []
    for name, tape in tapes:
        results.append((name, replay.replay(tape)))
        _print_syncer(results[-1][1], name)
    diverged = [f"{name}: {r.divergence}" for name, r in results if not r.ok]
    return {
        "ok": not diverged,
        "state_hash": results[-1][1].state_hash,
        "divergence_text": diverged[0] if diverged else "None",
        "syncers": {n: _result_json(r) for n, r in results},
    }


def _syncer_tapes_under(directory: Path, tape_file: str) -> list[Path]:
    """Subfolders holding a syncer tape, in the order a demo writes them: syncer/, syncer.2/, ..."""
    found = [p for p in directory.glob("*") if (p / tape_file).is_file()] if directory.is_dir() else []

    def order(p: Path) -> tuple[str, int]:
        stem, _, number = p.name.partition(".")
        return stem, int(number) if number.isdigit() else 1

    return sorted(found, key=order)


def _full(args: argparse.Namespace) -> dict:
    from ddiloco.cli import require_learner_extra

    require_learner_extra()
    import logging

    from ddiloco.demo import replay as full

    # The learners' own log lines (late pushes, rejoins) were said in the recorded run already.
    logging.getLogger("ddiloco.learner").setLevel(logging.ERROR)

    result = full.replay_full(args.tape_dir, cache_dir=args.tape_dir / "jax-cache")
    for r in result.learners:
        end = "final parameters checked" if r.final_checked else "killed: no final parameters to check"
        print(
            f"learner {r.name}: {r.calls} calls, {r.pushes} pushes, {r.inits} initial fragments, "
            f"{r.published} snapshots for peers; {end}" + (f"; DIVERGED: {r.divergence}" if r.divergence else "")
        )
    for name in result.never_joined:
        print(f"learner {name}: stopped before the syncer welcomed it; it sent nothing, nothing to re-execute")
    for name, s in result.syncers:
        _print_syncer(s, name)
    print(
        f"fragment versions applied by learners, found in the syncer's replay: {result.updates_checked}"
        + (f" ({result.updates_note})" if result.updates_note else "")
    )
    return {
        "ok": result.ok,
        "full": True,
        "state_hash": result.state_hash,
        "divergence_text": result.divergence,
        "learners": [vars(r) for r in result.learners],
        "syncers": {n: _result_json(s) for n, s in result.syncers},
        "updates_checked": result.updates_checked,
        "never_joined": result.never_joined,
    }
