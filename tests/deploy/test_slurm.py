"""deploy/slurm/ddiloco.sbatch: shellcheck finds nothing, and the #SBATCH directives describe the job
docs/deployment.md promises (a heterogeneous job: the syncer on a CPU node, learners on GPU nodes,
restarts by requeue)."""

import re
import shutil
import subprocess
from pathlib import Path

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
    assert 'START=(--resume "$CHECKPOINTS")' in text and 'START=(--checkpoint-dir "$CHECKPOINTS")' in text
    assert '--auth-token-file "$TOKEN_FILE"' in text and '--token-file "$TOKEN_FILE"' in text
    assert "umask 077" in text and 'chmod 600 "$TOKEN_FILE"' in text
    assert not re.search(r"\$\(cat[^)]*TOKEN", text), "the token is never expanded onto a command line"
    assert "--het-group=0" in text and "--het-group=1" in text
