"""How much of a novel part's ground truth does the episode's geometry decide?

    .venv/bin/python -m bench.triage_ceiling --seed 200 [--draws 8] [--max-offset-m 0.022]
        [--workdir /tmp/triage-shifts] [--json]

The ground truth (refcell/truth.py) blames the part when the same episode, replayed with a
standard part under the *same* noise, succeeds. Triage sees the logs: the start, the target,
the light, the camera's offset; never the noise the replay shares. This bench asks what the
best possible triage from that information could reach: for each failed episode of a novel
part in good light (the camera's offset, fitted from the snapshots as triage does, at most
`--max-offset-m`) of a shift recorded by `bench.triage`, it replays the episode with a standard
part on the true line under `--draws` fresh draws of the sensor, perception and latency noise
(same start, part pose, target and light), and scores the share that succeeds (`p_standard`)
against the ground truth: ROC AUC, and precision and recall above 0.6. It uses the reference
cell's true line and the policy, which triage never has, so it is an upper bound for any
triage that models the standard part's chances from the episode's geometry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

SIM_POLICY = Path("models") / "sim-policy"
_NOISE_STREAMS = ("sensors", "perception", "latency")  # refcell.cell's per-concern streams
_FRESH_BASE = 1000  # fresh draws are seeded [seed, episode, stream, _FRESH_BASE + draw]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.triage_ceiling", description=__doc__)
    parser.add_argument("--seed", type=int, default=200)
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--max-offset-m", type=float, default=0.022)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/triage-shifts"))
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    root = args.workdir / f"seed-{args.seed}"
    if not (root / "recorded.json").is_file():
        print(
            f"bench.triage_ceiling: {root}: no recorded shift; run `python -m bench.triage "
            f"--seeds {args.seed} --workdir {args.workdir}` first",
            file=sys.stderr,
        )
        return 1
    report = run(root, args.seed, args.draws, args.max_offset_m, args.params)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"seed {args.seed}: {report['episodes']} failed novel-part episodes in good light, "
            f"{report['novel_part']} blamed on the part; p_standard AUC {report['auc']:.3f}; "
            f"above 0.6: {report['predicted']} predicted, precision {report['precision']:.2f}, "
            f"recall {report['recall']:.2f}"
        )
    return 0


def candidates(root: Path, params, max_offset_m: float) -> list[tuple[str, int, bool]]:
    """(episode id, episode index, blamed on the part) of the failed episodes with another
    part where the snapshots' camera offset at the episode's light is at most max_offset_m."""
    from bench.triage import truth_rows
    from pipelines.ingest import read_dataset
    from pipelines.quality.triage import triage
    from pipelines.quality.triage.report import read_capture_sidecars

    truth = truth_rows(Path(json.loads((root / "recorded.json").read_text())["ground_truth"]))
    captures = root / "data" / "landing" / "captures"
    episodes, steps = read_dataset(root / "data" / "dataset")
    refs = read_capture_sidecars(captures, episodes)
    window = params.record.capture_window_steps
    report = triage(episodes, steps, params.cell, params.triage, refs, window, captures)
    out = []
    for episode_id, s in report.signals.items():
        row = truth[episode_id]
        if row["part_variant"] == "standard" or row["safety_stop"]:
            continue
        if s.camera_offset_m <= max_offset_m:
            out.append((episode_id, row["episode_index"], row["true_cause"] == "novel_part"))
    return out


def run(root: Path, seed: int, draws: int, max_offset_m: float, params_path: Path) -> dict:
    from scipy.stats import mannwhitneyu

    from pipelines.contract.params import load_params
    from pipelines.training.policy import load_policy
    from refcell.cell import _STREAMS, Cell
    from refcell.runner import run_episode
    from refcell.world import load_world

    class FreshNoiseCell(Cell):
        """The line, with the noise streams redrawn after each reset (draw `self.draw`)."""

        draw = 0

        def reset(self, seed, episode_index, shift_episodes, world=None):
            super().reset(seed, episode_index, shift_episodes, world=world)
            for i, name in enumerate(_STREAMS):
                if name in _NOISE_STREAMS:
                    fresh = [seed, episode_index, i, _FRESH_BASE + self.draw]
                    self.rng[name] = np.random.default_rng(fresh)
            self.perceived = self._perceive()
            return self.observation()

    params = load_params(params_path)
    shift_episodes = json.loads((root / "recorded.json").read_text())["episodes"]
    line, sim = load_world("line"), load_world("sim")
    standard = dataclasses.replace(line, parts=sim.parts)
    policy = load_policy(SIM_POLICY)
    cell = FreshNoiseCell(line, params.cell)
    rows = []
    for episode_id, index, novel in candidates(root, params, max_offset_m):
        wins = []
        for draw in range(draws):
            cell.draw = draw
            result = run_episode(cell, policy, seed, index, shift_episodes, world=standard)
            wins.append(result.success)
        rows.append({"episode_id": episode_id, "novel_part": novel, "p_standard": np.mean(wins)})
    y = np.array([r["novel_part"] for r in rows])
    p = np.array([r["p_standard"] for r in rows])
    chosen = p > 0.6
    return {
        "seed": seed,
        "draws": draws,
        "max_offset_m": max_offset_m,
        "episodes": len(rows),
        "novel_part": int(y.sum()),
        # ROC AUC: the Mann-Whitney U of the blamed episodes' scores over all pairs.
        "auc": float(mannwhitneyu(p[y], p[~y]).statistic / (y.sum() * (~y).sum()))
        if 0 < y.sum() < len(y)
        else None,
        "predicted": int(chosen.sum()),
        "precision": float(y[chosen].mean()) if chosen.any() else None,
        "recall": float(y[chosen].sum() / y.sum()) if y.sum() else None,
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
