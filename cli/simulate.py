"""`ddiloco simulate`: goodput of a cluster under chip failures, for one system or the paper's grid.

    ddiloco simulate --chips 1.2e6 --system decoupled --learners 8 --seeds 5 [--json PATH] [--plot PATH]
    ddiloco simulate --table paper [--json PATH] [--plot PATH]
    ddiloco simulate --scenario mixed|scavenge [--json PATH]
    ddiloco simulate --calibrate            (the documented parameter search; minutes)

The model and its calibrated defaults: docs/simulator.md. The first line printed is the resolved
configuration. JSON cells: {system, learners, quorum, chips, goodput, uptime, paper, ...}, fractions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ddiloco.errors import UserError

SEEDS_MAX = 10_000


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 1.2e6, got {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--table", choices=["paper"], help="run the paper's Table 1 grid and print it beside the paper")
    mode.add_argument("--scenario", choices=["mixed", "scavenge"], help="mixed hardware or opportunistic compute")
    mode.add_argument("--calibrate", action="store_true", help="rerun the parameter search of docs/simulator.md")
    parser.add_argument("--chips", type=_number, default=1.2e6, help="cluster size in chips (default 1.2e6)")
    parser.add_argument(
        "--mtbi-chip-years", type=_number, default=1.0, help="mean time between interruptions per chip (default 1)"
    )
    parser.add_argument("--system", choices=["dp", "elastic-dp", "decoupled"], default="decoupled")
    parser.add_argument("--learners", type=int, default=8, help="M, Decoupled DiLoCo only (default 8)")
    parser.add_argument("--quorum", type=int, default=1, help="K, Decoupled DiLoCo only (default 1)")
    parser.add_argument("--speed-sigma", type=_number, default=0.0, help="spread of per-learner speed (default 0)")
    parser.add_argument("--days", type=_number, default=7.0, help="simulated wall time per run (default 7)")
    parser.add_argument("--seeds", type=_positive_int, default=5, help="runs per cell, seeds 0..N-1 (default 5)")
    cal = parser.add_argument_group("model parameters (defaults: the calibrated values)")
    cal.add_argument("--slice-chips", type=int, help="chips per slice, the unit a failure takes out")
    cal.add_argument("--repair", choices=["fixed", "exponential", "lognormal"], help="repair time distribution")
    cal.add_argument("--repair-mean-s", type=_number, help="mean time for failed capacity to come back")
    cal.add_argument("--repair-cv", type=_number, default=1.0, help="lognormal repair: std / mean (default 1)")
    cal.add_argument("--restart-s", type=_number, help="synchronous job's cost of one incident")
    cal.add_argument("--scale-down-s", type=_number, help="elastic pause to drop a failed slice")
    cal.add_argument("--scale-up-s", type=_number, help="elastic pause to add repaired slices back")
    cal.add_argument("--join-wait-s", type=_number, help="longest wait of a repaired slice before its own scale-up")
    parser.add_argument(
        "--extra",
        type=_number,
        nargs="+",
        default=[0.25, 0.5, 1.0, 2.0, 3.0],
        help="scavenge: temporary compute as shares of the base (default 0.25 .. 3)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="draw goodput against cluster size (PNG)")


def run(args: argparse.Namespace) -> int:
    from ddiloco import sim

    model = _model(args, sim)
    if args.seeds > SEEDS_MAX:
        raise UserError(f"--seeds must be at most {SEEDS_MAX}, got {args.seeds}")
    seeds = list(range(args.seeds))
    sim.warm_up()
    if args.calibrate:
        return _calibrate(args, sim, seeds)
    if args.scenario == "mixed":
        return _mixed(args, sim)
    if args.scenario == "scavenge":
        return _scavenge(args, sim, model)
    if args.table == "paper":
        print(f"config: {_describe(model)} days={args.days:g} seeds={len(seeds)}")
        cells = sim.run_table1(model.timings, seeds, slice_chips=model.slice_chips, repair=model.repair, days=args.days)
        _print_table(cells)
        _write(args.json, [_cell_record(c) for c in cells])
        if args.plot:
            _plot(args.plot, cells, with_paper=True)
        return 0
    return _single(args, sim, model, seeds)


def _model(args: argparse.Namespace, sim: Any) -> Any:
    """The calibrated model with the flags given on the command line replacing its values."""
    from dataclasses import replace

    base = sim.CALIBRATED
    timings = replace(
        base.timings,
        **{
            k: getattr(args, k)
            for k in ("restart_s", "scale_down_s", "scale_up_s", "join_wait_s")
            if getattr(args, k) is not None
        },
    )
    repair = base.repair
    if args.repair is not None or args.repair_mean_s is not None:
        repair = sim.RepairTime(
            args.repair or repair.kind,
            args.repair_mean_s if args.repair_mean_s is not None else repair.mean_s,
            args.repair_cv,
        )
    slice_chips = args.slice_chips if args.slice_chips is not None else base.slice_chips
    return sim.Calibration(slice_chips, repair, timings)


def _describe(model: Any) -> str:
    t = model.timings
    return (
        f"slice_chips={model.slice_chips} repair={model.repair.kind.value}(mean {model.repair.mean_s:g} s) "
        f"restart_s={t.restart_s:g} scale_down_s={t.scale_down_s:g} scale_up_s={t.scale_up_s:g} join_wait_s={t.join_wait_s:g}"
    )


def _single(args: argparse.Namespace, sim: Any, model: Any, seeds: list[int]) -> int:
    system = sim.SystemConfig.of(args.system, args.learners, args.quorum, args.speed_sigma)
    cluster = sim.ClusterConfig(args.chips, args.mtbi_chip_years, model.slice_chips, model.repair)
    run_cfg = sim.RunConfig(days=args.days)
    print(
        f"config: system={system.label} chips={args.chips:g} mtbi_chip_years={args.mtbi_chip_years:g} "
        f"days={args.days:g} seeds={len(seeds)} speed_sigma={args.speed_sigma:g} {_describe(model)}"
    )
    cell = sim.run_cell(cluster, system, model.timings, run_cfg, seeds)
    every = cluster.failure_rate_per_s
    print(f"a failure every {1 / every:.3g} s" if every > 0 else "no failures (infinite MTBI)")
    print(
        f"goodput {cell.goodput:.1%} +- {cell.goodput_std:.1%}   uptime {cell.uptime:.1%} +- {cell.uptime_std:.1%}",
        end="",
    )
    if system.system is sim.System.DECOUPLED:
        print(
            f"   steps merged with fewer than M learners {cell.partial_share:.1%} +- {cell.partial_share_std:.1%}",
            end="",
        )
    print("" if cell.paper is None else f"   (paper {cell.paper:.0%})")
    _write(args.json, [_cell_record(cell)])
    if args.plot:
        sizes = sorted(set(sim.TABLE1_CHIPS) | {args.chips})
        cells = []
        for s in [sim.SystemConfig.of("dp"), sim.SystemConfig.of("elastic-dp"), system]:
            for n in sizes:
                c = sim.ClusterConfig(n, args.mtbi_chip_years, model.slice_chips, model.repair)
                cells.append(sim.run_cell(c, s, model.timings, run_cfg, seeds))
        _plot(args.plot, cells, with_paper=False)
    return 0


def _cell_record(cell: Any) -> dict[str, Any]:
    return {
        "system": cell.system.system.value,
        "learners": cell.system.learners,
        "quorum": cell.system.quorum,
        "chips": cell.chips,
        "goodput": cell.goodput,
        "goodput_std": cell.goodput_std,
        "uptime": cell.uptime,
        "uptime_std": cell.uptime_std,
        "partial_share": cell.partial_share,
        "seeds": cell.seeds,
        "paper": cell.paper,
    }


def _print_table(cells: list[Any]) -> None:
    sizes = sorted({c.chips for c in cells})
    print(f"{'system':<16}" + "".join(f"{_chips(n):>22}" for n in sizes))
    print(f"{'':<16}" + "".join(f"{'ours paper diff':>22}" for _ in sizes))
    for label in dict.fromkeys(c.system.label for c in cells):
        row = {c.chips: c for c in cells if c.system.label == label}
        line = f"{label:<16}"
        for n in sizes:
            c = row[n]
            paper = "  -" if c.paper is None else f"{c.paper * 100:3.0f}"
            diff = "    " if c.paper is None else f"{(c.goodput - c.paper) * 100:+4.1f}"
            line += f"{c.goodput * 100:>11.1f} {paper:>4} {diff:>5}"
        print(line)
    errors = [abs(c.error) for c in cells if c.error is not None]
    if errors:
        within = sum(e <= 0.03 for e in errors)
        print(f"largest |diff| {max(errors) * 100:.1f} points; {within}/{len(errors)} cells within 3 points")
    print(
        "uptime:   "
        + "  ".join(f"{c.system.label} @{_chips(c.chips)} {c.uptime:.1%}" for c in cells if c.chips == sizes[-1])
    )


def _chips(n: float) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k"


def _mixed(args: argparse.Namespace, sim: Any) -> int:
    import numpy as np

    from ddiloco.sim.paper import MIXED_GOODPUT

    cfg = sim.MixedConfig()
    print(f"config: {cfg}")
    results = sim.simulate_mixed(cfg, np.random.default_rng(0))
    print(f"{'policy':<12}{'goodput':>9}{'paper':>7}{'learners merged per round':>28}")
    for r in results:
        print(f"{r.policy:<12}{r.goodput:>9.1%}{MIXED_GOODPUT[r.policy]:>7.0%}{r.merged_share:>28.1%}")
    _write(
        args.json,
        [
            {"policy": r.policy, "goodput": r.goodput, "merged_share": r.merged_share, "paper": MIXED_GOODPUT[r.policy]}
            for r in results
        ],
    )
    return 0


def _scavenge(args: argparse.Namespace, sim: Any, model: Any) -> int:
    from ddiloco.sim.paper import SCAVENGE_EXTRA, SCAVENGE_WALL_DECOUPLED, SCAVENGE_WALL_DP

    paper = {e: (d, p) for e, d, p in zip(SCAVENGE_EXTRA, SCAVENGE_WALL_DECOUPLED, SCAVENGE_WALL_DP)}
    configs = [
        sim.ScavengeConfig(extra=e, scale_down_s=model.timings.scale_down_s, scale_up_s=model.timings.scale_up_s)
        for e in args.extra
    ]
    print(f"config: {configs[0]} (extra varies)")
    print(f"{'extra':>7}{'wall decoupled':>16}{'paper':>7}{'wall DP':>10}{'paper':>7}")
    records = []
    for cfg in configs:
        r = sim.scavenge(cfg)
        pd, pp = paper.get(cfg.extra, (None, None))
        print(f"{cfg.extra:>+7.0%}{r.wall_decoupled:>15.2f}x{_opt(pd):>7}{r.wall_dp:>9.2f}x{_opt(pp):>7}")
        records.append(
            {
                "extra": cfg.extra,
                "wall_decoupled": r.wall_decoupled,
                "wall_dp": r.wall_dp,
                "paper_decoupled": pd,
                "paper_dp": pp,
            }
        )
    _write(args.json, records)
    return 0


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _calibrate(args: argparse.Namespace, sim: Any, seeds: list[int]) -> int:
    space = sim.SearchSpace()
    print(f"config: search over {space.size} candidates, seeds={len(seeds)} days={args.days:g}: {space}")
    best, candidates = sim.search(space, seeds, args.days)
    print("best 10 (largest |diff| over the five non-DP rows):")
    for c in candidates[:10]:
        print(f"  {c.error_max * 100:5.2f} points  {_describe(c.calibration)}")
    print(f"chosen: {_describe(best.calibration)}; largest |diff| over all rows {best.error_max * 100:.2f} points")
    _write(args.json, [{"error_max": c.error_max, "model": _describe(c.calibration)} for c in candidates])
    return 0


def _write(path: Path | None, records: list[dict[str, Any]]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {path}")


def _plot(path: Path, cells: list[Any], *, with_paper: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: install the dev extra, `pip install 'ddiloco[dev]'`") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(c.system.label for c in cells):
        row = sorted((c for c in cells if c.system.label == label), key=lambda c: c.chips)
        line = ax.errorbar(
            [c.chips for c in row],
            [c.goodput * 100 for c in row],
            yerr=[c.goodput_std * 100 for c in row],
            marker="o",
            capsize=3,
            label=label,
        )
        if with_paper:
            paper = [(c.chips, c.paper * 100) for c in row if c.paper is not None]
            ax.plot(*zip(*paper), linestyle="none", marker="x", color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("cluster size (chips)")
    ax.set_ylabel("goodput (%)")
    ax.set_title("goodput under chip failures" + (" (x: paper, Table 1)" if with_paper else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    from ddiloco.cli import main

    sys.exit(main(["simulate", *sys.argv[1:]]))
