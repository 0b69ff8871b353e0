"""Where does a student part from the expert: where the expert switches between pushing the
part and going around it, or elsewhere?

    .venv/bin/python -m bench.student_switches --policy DIR [--world cell-09] [--day 0]
        [--episodes 150] [--seed 90101] [--json]

The privileged expert (refcell/expert.py) pushes when it is lined up behind the part and
repositions otherwise: a switch its true state decides, and a student's noisy, late frames
can only guess. This bench runs the student on the line as on `--day`, and at every step asks
the expert, on the true state, what it would do (`label`) and in which mode. It reports the
student's largest per-axis difference from the label within 3 steps of a switch of mode and
away from one, and how many switches the student's successful and failed episodes made, with
the expert's own episodes for comparison. docs/calibration.md ("Several students averaged")
has what it found on cell-09.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.cli import report_or_error
from refcell.expert import Expert, push_frame

NEAR_STEPS = 3  # steps either side of a switch that count as near it
BIG_ERROR = 0.5  # a difference this large turns the command by ~30 degrees or more


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.student_switches", description=__doc__)
    parser.add_argument("--policy", type=Path, required=True, help="a policy folder")
    parser.add_argument("--world", default="cell-09")
    parser.add_argument("--day", type=float, default=0.0, help="the line as on this day")
    parser.add_argument("--episodes", type=int, default=150)
    parser.add_argument("--seed", type=int, default=90101, help="a held-out evaluation seed")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    return report_or_error("student_switches", lambda: run(args), print_report, args.json)


class Probe:
    """Wraps a controller: records, per step, its action, the expert's label and mode."""

    def __init__(self, controller, cell):
        self.controller, self.cell, self.steps = controller, cell, []
        self.name = getattr(controller, "name", "controller")

    def begin_episode(self) -> None:
        self.steps = []
        if hasattr(self.controller, "begin_episode"):
            self.controller.begin_episode()

    def observe(self, obs: np.ndarray):
        return self.controller.observe(obs)

    def act(self, obs: np.ndarray) -> np.ndarray:
        state = self.cell.true_state()
        # the expert acts on the true state (refcell.runner.propose), a student on `obs`
        action = self.controller.act(state if isinstance(self.controller, Expert) else obs)
        frame = push_frame(state)
        self.steps.append((action, Expert().act(state), frame is not None and frame.pushing))
        return action


def episode_rows(controller, cell, args) -> list[dict]:
    """Per episode: success, the step errors near and away from a switch, the switches."""
    from refcell.runner import run_episode

    probe, rows = Probe(controller, cell), []
    for index in range(args.episodes):
        result = run_episode(cell, probe, args.seed, index, args.episodes)
        actions, labels, pushing = (np.array(column) for column in zip(*probe.steps, strict=True))
        errors = np.abs(actions - labels).max(axis=1)
        switches = np.flatnonzero(np.diff(pushing.astype(int)) != 0)
        near = np.zeros(len(errors), bool)
        for step in switches:
            near[max(0, step + 1 - NEAR_STEPS) : step + 1 + NEAR_STEPS] = True
        rows.append(
            {
                "success": result.success,
                "near": errors[near],
                "away": errors[~near],
                "switches": len(switches),
            }
        )
    return rows


def summary(rows: list[dict]) -> dict:
    near = np.concatenate([r["near"] for r in rows])
    away = np.concatenate([r["away"] for r in rows])

    def switches(success: bool) -> float | None:
        counts = [r["switches"] for r in rows if r["success"] == success]
        return float(np.mean(counts)) if counts else None

    return {
        "success_rate": float(np.mean([r["success"] for r in rows])),
        "steps_near_switch": len(near),
        "steps_away": len(away),
        "mean_error_near_switch": float(near.mean()) if len(near) else None,
        "mean_error_away": float(away.mean()) if len(away) else None,
        "big_error_share_near_switch": float((near > BIG_ERROR).mean()) if len(near) else None,
        "big_error_share_away": float((away > BIG_ERROR).mean()) if len(away) else None,
        "switches_per_success": switches(True),
        "switches_per_failure": switches(False),
    }


def run(args) -> dict:
    from pipelines.contract.params import load_params
    from pipelines.training import load_policy
    from refcell.cell import Cell
    from refcell.timeline import load_timeline, world_on_day
    from refcell.world import WORLD_NAMES, load_world

    if args.world not in WORLD_NAMES:
        raise ValueError(f"--world {args.world}: unknown line; use one of {', '.join(WORLD_NAMES)}")
    params = load_params(args.params)
    line = world_on_day(load_world(args.world), load_timeline(args.world), args.day)
    student = load_policy(args.policy)  # FileNotFoundError/ValueError: one line, named
    expert_rows = episode_rows(Expert(), Cell(line, params.cell), args)
    student_rows = episode_rows(student, Cell(line, params.cell), args)
    expert = summary(expert_rows)
    return {
        "policy": str(args.policy),
        "world": args.world,
        "day": args.day,
        "seed": args.seed,
        "episodes": args.episodes,
        "student": summary(student_rows),
        "expert": {k: expert[k] for k in ("success_rate", "switches_per_success")},
    }


def print_report(report: dict) -> None:
    s, e = report["student"], report["expert"]
    print(
        f"{report['policy']} on {report['world']} day {report['day']:g}, seed {report['seed']}, "
        f"{report['episodes']} episodes: success {s['success_rate']:.1%} "
        f"(expert {e['success_rate']:.1%})"
    )
    print(
        f"  |student - expert| near a switch (±{NEAR_STEPS} steps): mean "
        f"{s['mean_error_near_switch']:.3f}, over {BIG_ERROR} on "
        f"{s['big_error_share_near_switch']:.0%} of {s['steps_near_switch']} steps"
    )
    print(
        f"  away from switches: mean {s['mean_error_away']:.3f}, over {BIG_ERROR} on "
        f"{s['big_error_share_away']:.0%} of {s['steps_away']} steps"
    )
    failures = s["switches_per_failure"]
    print(
        f"  switches per episode: student's successes {s['switches_per_success']:.1f}, "
        f"failures {'-' if failures is None else f'{failures:.1f}'}; "
        f"expert {e['switches_per_success']:.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
