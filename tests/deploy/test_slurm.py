"""deploy/slurm/ddiloco.sbatch: shellcheck finds nothing, the #SBATCH directives describe the job
docs/deployment.md promises (a heterogeneous job: the syncer on a CPU node, learners on GPU nodes,
restarts by requeue), and a dry run, with srun, scontrol, python and ddiloco replaced by stubs that
record their arguments, renders the commands a job runs, unsharded and with DDILOCO_SHARDS=2."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco.cli.syncer import SETTINGS as SYNCER_SETTINGS

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "ddiloco.sbatch"


def directives():
    """The #SBATCH options of each component of the heterogeneous job, in order. sbatch reads
    them only up to the first command, so every one must come before it."""
    components, options = [[]], []
    for line in SCRIPT.read_text().splitlines():
        if line.startswith("#SBATCH"):
            option = line.split(None, 1)[1].strip()
            if option == "hetjob":
                components.append([])
            else:
                components[-1].append(option)
                options.append(option)
        elif line.strip() and not line.startswith("#"):
            break  # the first command: sbatch reads no further
    rest = SCRIPT.read_text().split("\nset -euo pipefail", 1)[1]
    assert "#SBATCH" not in rest, "an #SBATCH line after the first command is ignored by sbatch"
    return components, options


def as_dict(options):
    out = {}
    for option in options:
        name, _, value = option.partition("=")
        out[name] = value
    return out


def test_shellcheck_finds_nothing():
    assert shutil.which("shellcheck"), "shellcheck is not installed: `apt-get install shellcheck` (.ci/run does it)"
    out = subprocess.run(
        ["shellcheck", "--severity=style", str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout
    syntax = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert syntax.returncode == 0, syntax.stderr


def test_a_heterogeneous_job_syncer_on_cpu_learners_on_gpus():
    components, _ = directives()
    assert len(components) == 2, "component 0: the syncer; component 1: the learners"
    syncer, learners = as_dict(components[0]), as_dict(components[1])
    assert syncer["--nodes"] == "1" and syncer["--ntasks"] == "1"
    assert not any("gpu" in name or "gres" in name for name in syncer), "the syncer needs no accelerator"
    assert learners["--gpus-per-task"] == "1"  # one learner per GPU
    assert int(learners["--nodes"]) >= 1 and int(learners["--ntasks-per-node"]) >= 1


def test_restarts_by_requeue_with_the_log_kept_and_a_warning_before_the_time_limit():
    components, _ = directives()
    job = as_dict(components[0])
    assert "--requeue" in job and job["--open-mode"] == "append"
    assert re.fullmatch(r"B:TERM@\d+", job["--signal"]), "the batch shell must hear of the time limit to stop cleanly"
    text = SCRIPT.read_text()
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "trap on_time_limit TERM" in text


def test_the_syncer_resumes_and_the_token_is_a_private_file():
    text = SCRIPT.read_text()
    assert 'START=(--resume "$dir")' in text and 'START=(--checkpoint-dir "$dir")' in text
    assert '--auth-token-file "$TOKEN_FILE"' in text and '--token-file "$TOKEN_FILE"' in text
    assert "umask 077" in text and 'chmod 600 "$TOKEN_FILE"' in text
    assert not re.search(r"\$\(cat[^)]*TOKEN", text), "the token is never expanded onto a command line"
    assert "--het-group=0" in text and "--het-group=1" in text


# ---- dry runs: the script itself, run with stubs in place of SLURM and ddiloco ----

DRY_RUN_S_MAX = 60  # a dry run starts nothing real: it ends in seconds, or something hangs
STUB_SLEEP_S = 30  # how long a stub syncer waits for the script's SIGTERM before it gives up
LEARNER_TASKS = 3  # the tasks the stub srun runs for the learner step (component 1)
POLL_S = 0.1  # how often a dry run looks whether the learners train yet
SYNCER_NODE = "cpu-node-7"

# Each stub writes its arguments, NUL-separated, to a file of its own under $DRY_DIR/calls (the
# syncer shards run at once, so one shared file could interleave).
_RECORD = 'f="$(mktemp "$DRY_DIR/calls/XXXXXXXX")"; printf \'%s\\0\' "$(basename "$0")" "$@" > "$f"\n'
STUBS = {
    "scontrol": _RECORD + 'if [ "$1" = show ]; then echo ' + SYNCER_NODE + "; fi\n",
    # srun: drop its options, then run the command as component 0 (one task, in place) or as every
    # task of component 1, each with its SLURM_PROCID, as SLURM would; a SIGTERM to srun reaches
    # every process of every task (each task its own process group).
    "srun": _RECORD
    + """group=""
while [ "$#" -gt 0 ] && [ "${1#-}" != "$1" ]; do
  case "$1" in --het-group=*) group="${1#--het-group=}" ;; esac
  shift
done
if [ "$group" = 0 ]; then exec "$@"; fi
tasks=()
trap 'for t in "${tasks[@]}"; do kill -TERM -- "-$t" 2> /dev/null || true; done' TERM
for ((task = 0; task < DRY_LEARNER_TASKS; task++)); do
  SLURM_PROCID=$task SLURM_NTASKS=$DRY_LEARNER_TASKS setsid "$@" &
  tasks+=($!)
done
status=0
for t in "${tasks[@]}"; do wait "$t" || status=1; done
exit "$status"
""",
    # ddiloco: a syncer says it is up (a file named for its port) and runs until the script's
    # SIGTERM, which it notes (another file); a learner spends its budget at once, or with
    # DRY_LEARNER_SLEEP_S set, says it is training and trains until it is stopped.
    "ddiloco": _RECORD
    + """if [ "$1" = syncer ]; then
  nap=""
  trap 'kill "$nap" 2> /dev/null; touch "$DRY_DIR/stopped-$port"; exit 0' TERM
  port="$(printf '%s\\n' "$@" | sed -n '/^--port$/{n;p;}')"
  env | sed -n 's/^\\(DDILOCO_[A-Z0-9_]*\\)=.*/\\1/p' > "$DRY_DIR/env-$port"
  touch "$DRY_DIR/up-$port"
  sleep "$DRY_STUB_SLEEP_S" & nap=$!
  wait "$nap"
elif [ -n "${DRY_LEARNER_SLEEP_S:-}" ]; then
  touch "$DRY_DIR/training-$SLURM_PROCID"
  sleep "$DRY_LEARNER_SLEEP_S"
fi
exit 0
""",
    # python: /healthz answers once that port's syncer is up; the rest (the token) is the real
    # interpreter's.
    "python": _RECORD
    + """case "$*" in
  *urlopen*) port="${*: -1}"; port="${port##*:}"; [ -e "$DRY_DIR/up-${port%%/*}" ]; exit ;;
esac
exec "$DRY_PYTHON" "$@"
""",
}


def dry_run(tmp_path, shards=None, checkpoints=(), settings=None, time_limit=False):
    """Run the script with the stubs; (its completed process, the calls, each a list of arguments
    beginning with the command's name). `checkpoints`: files to make under the checkpoint directory
    first, as a requeued job finds them. `time_limit`: the learners train until stopped, and the
    script gets SLURM's SIGTERM once they all train, as before the time limit."""
    bin_dir, calls, run_dir = tmp_path / "bin", tmp_path / "calls", tmp_path / "run"
    bin_dir.mkdir()
    calls.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/bash\nset -euo pipefail\n" + body)
        (bin_dir / name).chmod(0o755)
    for name in checkpoints:
        (run_dir / "checkpoints" / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints" / name).write_text("")
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "DRY_DIR": str(tmp_path),
        "DRY_PYTHON": sys.executable,
        "DRY_LEARNER_TASKS": str(LEARNER_TASKS),
        "DRY_STUB_SLEEP_S": str(STUB_SLEEP_S),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST_HET_GROUP_0": f"{SYNCER_NODE}",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "DDILOCO_RUN_DIR": str(run_dir),
    }
    if shards is not None:
        env["DDILOCO_SHARDS"] = str(shards)
    env.update(settings or {})
    if time_limit:
        env["DRY_LEARNER_SLEEP_S"] = str(STUB_SLEEP_S)
    with subprocess.Popen(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as job:
        deadline = time.monotonic() + DRY_RUN_S_MAX
        try:
            while time_limit and not all((tmp_path / f"training-{i}").exists() for i in range(LEARNER_TASKS)):
                assert job.poll() is None and time.monotonic() < deadline, "the learners never started"
                time.sleep(POLL_S)
            if time_limit:
                job.send_signal(signal.SIGTERM)
            stdout, stderr = job.communicate(timeout=max(deadline - time.monotonic(), 1))
        finally:
            if job.poll() is None:
                job.kill()
    out = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    recorded = [f.read_bytes().decode().split("\0")[:-1] for f in calls.iterdir()]
    return out, recorded


def _after(args, flag):
    return args[args.index(flag) + 1]


def _syncers(recorded):
    return sorted((c for c in recorded if c[:2] == ["ddiloco", "syncer"]), key=lambda c: int(_after(c, "--port")))


def _learners(recorded):
    return sorted((c for c in recorded if c[:2] == ["ddiloco", "learner"]), key=lambda c: _after(c, "--name"))


def test_a_dry_run_unsharded_renders_the_one_syncer_as_before(tmp_path):
    out, recorded = dry_run(tmp_path)
    assert out.returncode == 0, out.stderr
    run = tmp_path / "run"
    token = str(run / "token")
    (syncer,) = _syncers(recorded)
    assert syncer == [
        "ddiloco",
        "syncer",
        "--host",
        "0.0.0.0",
        "--port",
        "8470",
        "--auth-token-file",
        token,
        "--checkpoint-dir",
        str(run / "checkpoints"),
        "--fragments",
        "8",
        "--checkpoint-every-merges",
        "20",
    ]
    (step,) = [c for c in recorded if c[0] == "srun" and "--het-group=0" in c]
    assert step[: step.index("ddiloco")] == ["srun", "--het-group=0", "--ntasks=1", "--kill-on-bad-exit=1"]
    learners = _learners(recorded)
    assert len(learners) == LEARNER_TASKS
    for i, learner in enumerate(learners):
        assert learner == [
            "ddiloco",
            "learner",
            "--syncer",
            f"ws://{SYNCER_NODE}:8470/ws",
            "--token-file",
            token,
            "--shard",
            f"{i}/{LEARNER_TASKS}",
            "--name",
            f"learner-{i}",
            "--steps",
            "2000",
        ]
    # asked again until the syncer is up, as it is on a cluster
    health = {c[-1] for c in recorded if c[0] == "python" and "urlopen" in " ".join(c)}
    assert health == {f"http://{SYNCER_NODE}:8470/healthz"}
    assert (run / "logs" / "syncer.log").exists() and not (run / "checkpoints" / "shard-0").exists()
    assert not any(c[:2] == ["scontrol", "requeue"] for c in recorded)
    assert os.stat(token).st_mode & 0o777 == 0o600


def test_a_dry_run_with_two_shards_starts_each_on_its_port_and_directory_and_learners_dial_both(tmp_path):
    # shard 1 was checkpointed before a requeue, shard 0 not yet: each decides for itself
    out, recorded = dry_run(tmp_path, shards=2, checkpoints=["shard-1/ckpt-00000012"])
    assert out.returncode == 0, out.stderr
    run, token = tmp_path / "run", str(tmp_path / "run" / "token")
    syncers = _syncers(recorded)
    assert len(syncers) == 2
    for shard, syncer in enumerate(syncers):
        directory = str(run / "checkpoints" / f"shard-{shard}")
        start = ["--resume", directory] if shard == 1 else ["--checkpoint-dir", directory]
        assert syncer == [
            "ddiloco",
            "syncer",
            "--host",
            "0.0.0.0",
            "--port",
            str(8470 + shard),
            "--auth-token-file",
            token,
            *start,
            "--shard",
            str(shard),
            "--shards",
            "2",
            "--fragments",
            "8",
            "--checkpoint-every-merges",
            "20",
        ]
        assert (run / "logs" / f"syncer-{shard}.log").exists()
    # two steps on component 0's one task: they must share it, or the second waits for the first
    steps = [c for c in recorded if c[0] == "srun" and "--het-group=0" in c]
    assert len(steps) == 2 and all("--overlap" in step[: step.index("ddiloco")] for step in steps)
    urls = f"ws://{SYNCER_NODE}:8470/ws,ws://{SYNCER_NODE}:8471/ws"
    learners = _learners(recorded)
    assert len(learners) == LEARNER_TASKS
    for i, learner in enumerate(learners):
        assert _after(learner, "--syncer") == urls
        assert _after(learner, "--shard") == f"{i}/{LEARNER_TASKS}"  # its data shard, unchanged
    health = {c[-1] for c in recorded if c[0] == "python" and "urlopen" in " ".join(c)}
    assert health == {f"http://{SYNCER_NODE}:{port}/healthz" for port in (8470, 8471)}
    assert not (run / "logs" / "syncer.log").exists()


@pytest.mark.parametrize("shards", ["0", "65", "two", ""])
def test_a_dry_run_refuses_a_bad_shard_count_before_starting_anything(tmp_path, shards):
    out, recorded = dry_run(tmp_path, shards=shards)
    if shards == "":  # empty is unset: the default, one syncer
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode == 2 and "DDILOCO_SHARDS" in out.stderr
    assert not any(c[0] in ("srun", "ddiloco") for c in recorded)


def test_the_scripts_own_settings_stay_out_of_the_syncers_environment(tmp_path):
    """`ddiloco syncer` refuses an unknown DDILOCO_* variable, and a step inherits the batch shell's
    environment: the script's settings, given at submission, must not reach it; a setting of the
    syncer's own, given the same way, does."""
    settings = {
        "DDILOCO_PORT": "8470",
        "DDILOCO_SYNCER_ARGS": "--fragments 8 --checkpoint-every-merges 20",
        "DDILOCO_LEARNER_ARGS": "--steps 2000",
        "DDILOCO_REQUEUES_MAX": "20",
        "DDILOCO_LEARNER_RESTARTS_MAX": "10",
        "DDILOCO_LOG_LEVEL": "info",  # the syncer's own
    }
    out, _ = dry_run(tmp_path, shards=2, settings=settings)
    assert out.returncode == 0, out.stderr
    known = {s.env for s in SYNCER_SETTINGS}
    for port in (8470, 8471):
        seen = set((tmp_path / f"env-{port}").read_text().split())
        assert seen <= known, f"the syncer would refuse {sorted(seen - known)}"
        assert "DDILOCO_LOG_LEVEL" in seen


def test_a_dry_run_stopped_before_the_time_limit_stops_every_shard_and_requeues(tmp_path):
    out, recorded = dry_run(tmp_path, shards=2, time_limit=True)
    assert out.returncode == 0, out.stderr
    assert "the time limit is near" in out.stdout
    # SIGTERM reached every shard, each the chance to write its last checkpoint, before the requeue
    assert (tmp_path / "stopped-8470").exists() and (tmp_path / "stopped-8471").exists()
    assert ["scontrol", "requeue", "4242"] in recorded
