"""Whose is a cell's gap to the expert: the calibration's, or the student's?

    .venv/bin/python -m bench.student_gap --calibration CAL.yaml [--cell cell-09] [--day 0]
        [--pretrain-seeds 7 8 9] [--set KEY=JSON ...] [--episodes 100] [--workdir DIR] [--json]

The loop's calibrated candidate is a student pretrained (behaviour cloning and DAgger, with
the loop's settings: `loop.pretrain_*`) in the sim a calibration file describes. Its success on
the line falls short of the privileged expert's for two reasons: the calibrated sim is not the
line, and the student (a few noisy, late frames in: `loop.pretrain_history`) is not the
expert. This bench
pretrains the same student twice per pretrain seed: in the calibrated sim (`calibrated`), and
in the reference cell's TRUE line on that day with the same randomization ranges
(`true_line`: the best any calibration could give). It evaluates both, and the expert, on the
line with `realloop cell eval`'s held-out seeds (100 episodes each at three offsets into the
shift). `calibration_share` = true_line - calibrated: what a better calibration could still
win; `student_share` = expert - true_line: what only a better student can.

`--set` changes the student's pretrain settings in both arms (e.g. `--set hidden=[256,256]`,
`--set epochs=80`, `--set dagger_target_success=0.97`, or `--set history=1 --set
output_gain=1.0` for the one-frame student before 1ce81a8): keys of params.yaml `pretrain:`,
values as JSON.

`--finetune-on WORKSPACE` also fine-tunes every student the way the loop makes its
`calibrated_finetune` candidate (`train:` with `loop.calibrated_finetune_mode`), on the line
data the loop trained that candidate on in cycle `--finetune-cycle` (default 0) of a campaign or
loop workspace (the run's `training_batches.json` in the workspace's MLflow store), and
evaluates it too: `finetuned` is what the student would bring to trials.

CAL: any sim-calibration.yaml of the cell, e.g. a campaign workspace's
`models/calibrated/<cell>/<hash>/sim-calibration.yaml`, or `realloop calibrate` on a recorded
shift. Each pretrain seed costs two pretrains (about a minute each on one core for cell-09)
and two evaluations.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from bench.cli import report_or_error

EVAL_SEEDS = (90101, 90202, 90303)  # the campaign's held-out evaluation seeds
ARMS = ("calibrated", "true_line")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.student_gap", description=__doc__)
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--cell", default="cell-09")
    parser.add_argument("--day", type=float, default=0.0, help="the line as on this day")
    parser.add_argument("--pretrain-seeds", type=int, nargs="+", default=[7, 8, 9])
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a pretrain setting for both arms, e.g. hidden=[256,256]",
    )
    parser.add_argument(
        "--arms", nargs="+", choices=ARMS, default=list(ARMS), help="which students to pretrain"
    )
    parser.add_argument(
        "--finetune-on",
        type=Path,
        metavar="WORKSPACE",
        help="also fine-tune each student on the line data of this workspace's loop cycle",
    )
    parser.add_argument("--finetune-cycle", type=int, default=0, metavar="N")
    parser.add_argument("--episodes", type=int, default=100, help="per evaluation seed")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/realloop-student-gap"))
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    return report_or_error("student_gap", lambda: run(args), print_report, args.json)


def pretrain_settings(params, overrides: list[str], seed: int):
    """The loop's pretrain settings (`loop.pretrain_*` over `pretrain:`), `overrides` and
    `seed` applied; ValueError (one line) for a key `pretrain:` does not have."""
    import json

    from pipelines.training.calibrated import loop_pretrain_params

    settings = loop_pretrain_params(params)
    changes = {"seed": seed}
    for item in overrides:
        key, _, value = item.partition("=")
        if not hasattr(settings, key):
            raise ValueError(f"--set {item}: pretrain has no setting {key!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"--set {item}: {value!r} is not JSON") from None
        changes[key] = tuple(parsed) if isinstance(parsed, list) else parsed  # as params reads

    return dataclasses.replace(settings, **changes)


def pretrain_worlds(args, pretrain_params) -> dict:
    """(world, pretrain params) per arm: the calibrated sim, and the true line on the day with
    the calibration's randomization ranges."""
    from refcell.pretrain import calibrated_setup
    from refcell.timeline import load_timeline, world_on_day
    from refcell.world import load_world

    world, ranged, _ = calibrated_setup(pretrain_params, args.calibration)
    line = world_on_day(load_world(args.cell), load_timeline(args.cell), args.day)
    return {"calibrated": (world, ranged), "true_line": (line, ranged)}


def line_training_set(params, workspace: Path, cell: str, cycle: int):
    """The examples the loop fine-tuned `cell`'s calibrated candidate on in `cycle` of
    `workspace`: the batches its MLflow run recorded, read from the workspace's dataset."""
    from pipelines.training.cycle_runs import stage_run_name
    from pipelines.training.retrain import training_set
    from pipelines.training.tracking import logged_training_batches

    name = stage_run_name("finetune-calibrated", cell, cycle)
    batches = logged_training_batches(workspace, params.train.experiment, name)
    if batches is None:
        raise ValueError(
            f"{workspace}: no MLflow run {name!r} with its training batches; "
            "give a campaign or loop workspace where that cycle ran"
        )
    return training_set(params, workspace / params.ingest.dataset, batches)


def finetuned(net, data, params):
    """`net` fine-tuned as the loop fine-tunes its calibrated candidate (flows/candidates.py)."""
    from pipelines.training.finetune import finetune

    recipe = dataclasses.replace(params.train, mode=params.loop.calibrated_finetune_mode)
    return finetune(net, data, recipe, f"{net.config.version}-finetuned")[0]


def evaluate(policy: str, args) -> dict:
    from flows.cell import run_eval_seeds

    row = run_eval_seeds(
        policy, args.cell, args.episodes, list(EVAL_SEEDS), False, args.params, args.day
    )
    return {k: row[k] for k in ("success_rate", "success_min", "success_max", "episodes")}


def run(args) -> dict:
    import time

    from pipelines.contract.params import load_params
    from pipelines.training.policy import save_policy
    from refcell.pretrain import pretrain_with_observations

    params = load_params(args.params)
    line_data = None
    if args.finetune_on is not None:
        line_data = line_training_set(params, args.finetune_on, args.cell, args.finetune_cycle)
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for seed in args.pretrain_seeds:
        settings = pretrain_settings(params, args.overrides, seed)
        worlds = pretrain_worlds(args, settings)
        for arm in args.arms:
            world, pretrain_params = worlds[arm]
            started = time.monotonic()
            net, _ = pretrain_with_observations(world, params.cell, pretrain_params)
            folder = save_policy(net, args.workdir / f"{arm}-seed-{seed}")
            seconds = round(time.monotonic() - started, 1)
            row = {"seed": seed, "pretrain_s": seconds, **evaluate(str(folder), args)}
            if line_data is not None:
                tuned = save_policy(
                    finetuned(net, line_data, params), args.workdir / f"{arm}-seed-{seed}-ft"
                )
                row["finetuned"] = evaluate(str(tuned), args)
            runs[arm].append(row)
    rates = {arm: [r["success_rate"] for r in rows] for arm, rows in runs.items()}
    mean = {arm: sum(values) / len(values) for arm, values in rates.items()}
    expert = evaluate("expert", args)
    both = len(mean) == len(ARMS)
    return {
        "cell": args.cell,
        "day": args.day,
        "calibration": str(args.calibration),
        "overrides": args.overrides,
        "finetuned_on": _finetuned_on(args, line_data),
        "eval_seeds": list(EVAL_SEEDS),
        "runs": runs,
        "mean": mean,
        "range": {arm: [min(values), max(values)] for arm, values in rates.items()},
        "finetuned": _finetuned_summary(runs) if line_data is not None else None,
        "expert": expert,
        "calibration_share": mean["true_line"] - mean["calibrated"] if both else None,
        "student_share": expert["success_rate"] - mean["true_line"] if both else None,
    }


def _finetuned_on(args, line_data) -> dict | None:
    if line_data is None:
        return None
    return {
        "workspace": str(args.finetune_on),
        "cycle": args.finetune_cycle,
        "episodes": line_data.episodes_used,
        "examples": len(line_data),
        "correction_steps": line_data.correction_steps,
    }


def _finetuned_summary(runs: dict) -> dict:
    """Per arm, the fine-tuned students' mean and range of line success."""
    summary = {}
    for arm, rows in runs.items():
        values = [r["finetuned"]["success_rate"] for r in rows]
        summary[arm] = {"mean": sum(values) / len(values), "range": [min(values), max(values)]}
    return summary


def print_report(report: dict) -> None:
    print(f"{report['cell']} on day {report['day']:g}, eval seeds {report['eval_seeds']}")
    for arm in report["runs"]:
        rates = ", ".join(
            f"{r['success_rate']:.1%} (seed {r['seed']})" for r in report["runs"][arm]
        )
        print(f"  {arm:<11} mean {report['mean'][arm]:.1%}: {rates}")
        if report["finetuned"] is not None:
            tuned = ", ".join(f"{r['finetuned']['success_rate']:.1%}" for r in report["runs"][arm])
            mean = report["finetuned"][arm]["mean"]
            print(f"  {'  finetuned':<11} mean {mean:.1%}: {tuned}")
    print(f"  expert      {report['expert']['success_rate']:.1%}")
    if report["calibration_share"] is not None:
        print(
            f"  gap to the expert: calibration {report['calibration_share']:+.1%}, "
            f"student {report['student_share']:+.1%}"
        )


if __name__ == "__main__":
    sys.exit(main())
