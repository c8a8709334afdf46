"""`ddiloco replay TAPE_DIR`: run the syncer core over a recorded tape and check it bit for bit.

Prints the events replayed, the merges checked, the time taken and OK, or the first diverging
event. Exit status 0 when every recorded fragment version (and, at a clean end, the final state
hash) is reproduced, 1 on a divergence, 2 when the tape cannot be used (corrupt, or recorded
without payloads). A torn tail (a syncer killed mid-write) is cut from what is read, with a note;
the file itself is left as it is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tape_dir", type=Path, metavar="TAPE_DIR", help="a directory written by `ddiloco syncer --record`")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    import orjson
    from ddiloco.core import replay, tape

    started = time.perf_counter()
    try:
        recorded = tape.read(args.tape_dir)
        result = replay.replay(recorded)
    except tape.TapeError as exc:
        print(f"ddiloco replay: bad tape: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    if result.torn:
        print(f"warning: {result.torn}", file=sys.stderr)
    print(f"events replayed  {result.events}")
    print(f"merges checked   {result.merges_checked}")
    final = "checked" if result.final_checked else "not checked: no close record, the run did not end cleanly"
    print(f"final state hash {result.state_hash[:16]} ({final})")
    print(f"time             {seconds:.3f} s")
    print("OK: bit-identical" if result.ok else f"DIVERGED at {result.divergence}")
    if args.json is not None:
        doc = {
            "ok": result.ok, "events": result.events, "merges_checked": result.merges_checked,
            "final_checked": result.final_checked, "state_hash": result.state_hash, "seconds": seconds,
            "torn": result.torn,
            "divergence": None if result.ok else {
                "index": result.divergence.index, "event": result.divergence.event, "what": result.divergence.what,
                "expected": result.divergence.expected, "got": result.divergence.got,
            },
        }
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 0 if result.ok else 1
