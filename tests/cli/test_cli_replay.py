"""`ddiloco replay DIR` on a directory that holds syncer tapes in subfolders (a recorded demo's
layout): replayed when they kept their payloads, one line pointing to --full when they did not."""

import shutil
from pathlib import Path

import orjson

from ddiloco.cli import main
from ddiloco.core import tape as tapes
from ddiloco.net import recording

GOLDEN = Path(__file__).parents[1] / "core" / "golden_tapes" / "kill_rejoin"  # a real syncer tape, payloads kept


def without_payloads(source: Path, target: Path) -> None:
    """The same records, the header saying payloads were not kept, and none stored (a demo's syncer tape)."""
    tape = recording.read(source)
    tape.header["keep_payloads"] = False
    (target / tapes.PAYLOAD_DIR).mkdir(parents=True)
    with open(target / tapes.TAPE_FILE, "wb") as fh:
        fh.write(tapes.preamble(tapes.MAGIC))
        fh.writelines(tapes.framed(r) for r in [tape.header, *tape.records, tape.close])


def test_a_demo_recording_whose_syncer_tapes_kept_payloads_has_them_replayed_in_order(tmp_path, capsys):
    rec = tmp_path / "rec"
    for name in ("syncer.2", "syncer"):
        shutil.copytree(GOLDEN, rec / name)
    (rec / "learners").mkdir()
    assert main(["replay", str(rec), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{rec}: replaying the syncer tapes in syncer/, syncer.2/ ")
    assert out.index("syncer: events replayed") < out.index("syncer.2: events replayed") and "OK: bit-identical" in out
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    assert doc["ok"] and set(doc["syncers"]) == {"syncer", "syncer.2"}
    assert all(s["final_checked"] and s["merges_checked"] > 0 for s in doc["syncers"].values())

    # a damaged payload in the second tape: exit 1, that tape named
    push = next(r for r in recording.read(rec / "syncer.2").events if r["kind"] == "Push")
    stored = rec / "syncer.2" / tapes.PAYLOAD_DIR / push["fields"]["payload"]["$payload"]["sha256"]
    stored.write_bytes(stored.read_bytes()[::-1])
    assert main(["replay", str(rec)]) == 1
    assert f"DIVERGED at syncer.2: event {push['i']} " in capsys.readouterr().out


def test_a_demo_recording_without_payloads_is_one_line_pointing_to_full(tmp_path, capsys):
    rec = tmp_path / "rec"
    without_payloads(GOLDEN, rec / "syncer")
    (rec / "learners" / "learner-0.0").mkdir(parents=True)
    assert main(["replay", str(rec)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing replayed
    assert captured.err == (
        f"ddiloco replay: error: {rec} is a recorded demo: its syncer tapes keep no payloads "
        f"(the learners' tapes make them again), so replay it whole with "
        f"`ddiloco replay {rec} --full`\n"
    )


def test_a_directory_without_any_syncer_tape_is_one_line(tmp_path, capsys):
    (tmp_path / "empty" / "learners").mkdir(parents=True)
    assert main(["replay", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no syncer tape (tape.ddtp, itself or in a subfolder)" in err
    assert main(["replay", str(tmp_path / "missing")]) == 2
    assert (
        capsys.readouterr().err == f"ddiloco replay: error: {tmp_path / 'missing'} is not a directory: "
        "a tape is the directory `--record DIR` wrote\n"
    )
