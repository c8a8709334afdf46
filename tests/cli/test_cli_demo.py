"""`ddiloco demo` and `ddiloco bench learner` flags: what they map to, and clear errors for bad ones."""

import pytest

from ddiloco.cli import build_parser, main
from ddiloco.cli.demo import config_from_args


def _config(*argv):
    return config_from_args(build_parser().parse_args(["demo", *argv]))


def test_quick_sets_short_defaults_and_flags_win():
    quick = _config("--quick")
    assert (quick.steps, quick.kills, quick.pauses, quick.period, quick.overlap) == (60, 1, 1, 8, 4)
    cfg = _config(
        "--quick",
        "--steps",
        "80",
        "--kills",
        "2",
        "--period",
        "12",
        "--no-chaos",
        "--baseline",
        "none",
        "--speeds",
        "1,1,0.7,0.7",
        "--kill-syncer",
        "--quorum",
        "2",
        "--outer-lr",
        "0.5",
    )
    assert (cfg.steps, cfg.kills, cfg.period, cfg.chaos, cfg.baseline) == (80, 2, 12, False, False)
    assert cfg.speeds == (1.0, 1.0, 0.7, 0.7) and cfg.kill_syncer and cfg.quorum == 2 and cfg.outer_lr == 0.5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speeds", "1,fast"], "--speeds must be comma-separated numbers"),
        (["--speeds", "1,1"], "--speeds has 2 values for 4 learners"),
        (["--speeds", "1,1,1,2"], "every speed must lie in (0, 1]"),
    ],
)
def test_bad_demo_flags_get_one_clear_line(argv, message, capsys):
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_learner_is_a_bench_kind():
    args = build_parser().parse_args(["bench", "learner", "--steps", "10", "--json", "out.json"])
    assert args.kind == "learner" and args.steps == 10
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "learner", "--steps", "0"])
