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


def test_bench_learner_flags_of_the_other_loop_are_one_clear_line(capsys):
    assert main(["bench", "learner", "--params", "1M"]) == 2
    assert "--params sizes the synthetic loop (--synthetic-step-ms), not the one asked for" in capsys.readouterr().err
    assert main(["bench", "learner", "--synthetic-step-ms", "2", "--d-model", "256", "--batch", "4"]) == 2
    assert "--batch, --d-model sizes the reference loop" in capsys.readouterr().err
    assert main(["bench", "learner", "--synthetic-step-ms", "-1"]) == 2
    assert "synthetic_step_ms must lie in" in capsys.readouterr().err
    assert main(["bench", "learner", "--d-model", "130"]) == 2  # not a multiple of the 4 heads
    assert "must be a multiple of n_heads" in capsys.readouterr().err


def test_bench_learner_synthetic_defaults():
    from ddiloco.cli.bench import _learner_config

    cfg = _learner_config(build_parser().parse_args(["bench", "learner", "--synthetic-step-ms", "20"]))
    assert (cfg.synthetic_step_ms, cfg.params, cfg.fragments, cfg.period, cfg.overlap, cfg.steps) == (
        20.0,
        10 * 2**20,
        4,
        24,
        8,
        1200,
    )
    ref = _learner_config(build_parser().parse_args(["bench", "learner", "--d-model", "256", "--layers", "4"]))
    assert (ref.synthetic_step_ms, ref.d_model, ref.layers, ref.steps, ref.batch, ref.model) == (
        None,
        256,
        4,
        240,
        8,
        "dense",
    )
