"""Triage against the reference cell's ground truth, on whole recorded shifts.

    .venv/bin/python -m bench.triage --seeds 101 102 103 [--episodes 1000] [--workdir DIR]
        [--baseline-params OLD.yaml] [--json]

For each seed: record a shift of the sim policy (`models/sim-policy`) on the line, no
operator, as the slow test does (`refcell.shift.record_shift`, which keeps each failed
episode's counterfactual `true_cause` in a side file), ingest it (`ingest_landing`), triage
the dataset (`triage_dataset`) and score the verdicts, and the captures of failed episodes,
against the true causes: a confusion matrix and per-class precision and recall, per seed and
over all seeds, twice: with the captures' snapshots (`snapshots`) and without them
(`without_snapshots`: the rules as they were before snapshots were read, which is also what
triage does on a dataset whose captures have no snapshots). With `--workdir`, each shift is
recorded once into `<workdir>/seed-<seed>` and reused by later runs (a shift of 1,000
episodes takes minutes); without it, a temporary folder is used and removed. With
`--baseline-params`, the same shifts are also triaged with those params (with snapshots,
`baseline`): a change of limits scored before and after on the same episodes. With
`--replay`, each shift is also calibrated (`realloop calibrate`'s fit, on the shift itself;
kept as `<workdir>/seed-<seed>/sim-calibration.yaml`) and triaged with snapshots and the
replay of its failures of other parts with the standard part in that sim, by the sim policy
that ran them (`replay`; `realloop triage --policy --calibration`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from bench.cli import report_or_error

SIM_POLICY = Path("models") / "sim-policy"
# The shift clock decides the line's lighting: every shift starts at the same hour, so that a
# seed, not the time of the run, decides what is recorded.
SHIFT_START = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
CLASSES = ("perception", "control", "physics", "novel_part", "safety")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.triage", description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[101, 102, 103])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--workdir", type=Path, help="keep (and reuse) recorded shifts here")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument(
        "--baseline-params",
        type=Path,
        help="also score the same shifts with these params (with snapshots): before/after",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="also triage with each failure of another part replayed in the shift's calibrated sim",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)

    def produce() -> dict:
        extra = (args.params, args.baseline_params, args.replay)
        if args.workdir:
            return run(args.seeds, args.episodes, args.workdir, *extra)
        with tempfile.TemporaryDirectory(prefix="bench-triage-") as tmp:
            return run(args.seeds, args.episodes, Path(tmp), *extra)

    return report_or_error("triage", produce, print_report, args.json)


def record(params, root: Path, episodes: int, seed: int) -> Path:
    """Record and ingest one shift under `root` (once: a finished one is reused); returns the
    ground-truth side file."""
    from pipelines.ingest.landing import ingest_landing
    from pipelines.training.policy import load_policy
    from refcell.shift import GROUND_TRUTH_DIR, record_shift
    from refcell.world import load_world

    landing, done = root / "data" / "landing", root / "recorded.json"
    if done.is_file():
        return Path(json.loads(done.read_text())["ground_truth"])
    if not (SIM_POLICY / "model.safetensors").is_file():
        raise FileNotFoundError(f"{SIM_POLICY}: no sim policy; run `realloop cell pretrain`")
    policy = load_policy(SIM_POLICY)
    summary = record_shift(
        load_world("line"),
        params.cell,
        params.record,
        policy,
        episodes,
        landing,
        seed,
        interventions=False,
        policy_version=policy.name,
        shift_start=SHIFT_START,
    )
    ingest_landing(
        landing,
        root / "data" / "dataset",
        root / "data" / "quarantine",
        params.cell,
        params.ingest,
        "bench-triage",
    )
    truth = landing / GROUND_TRUTH_DIR / Path(summary["ground_truth"]).name
    done.write_text(json.dumps({"ground_truth": str(truth), "seed": seed, "episodes": episodes}))
    return truth


def score(pairs: list[tuple[str, str]]) -> dict:
    """Confusion matrix (true → predicted) and per-class precision, recall and support."""
    confusion = {t: dict.fromkeys(CLASSES, 0) for t in CLASSES}
    for true, predicted in pairs:
        confusion[true][predicted] += 1
    per_class = {}
    for cls in CLASSES:
        hits = confusion[cls][cls]
        predicted = sum(confusion[t][cls] for t in CLASSES)
        support = sum(confusion[cls].values())
        per_class[cls] = {
            "support": support,
            "predicted": predicted,
            "precision": hits / predicted if predicted else None,
            "recall": hits / support if support else None,
        }
    return {"confusion": confusion, "classes": per_class}


def truth_rows(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["episode_id"]: r for r in rows}


def shift_calibration(params, root: Path) -> Path:
    """The calibration of the recorded shift under `root`, fitted once and then reused."""
    from flows.plugins import load_simulator
    from pipelines.calibrate import calibrate, write_calibration
    from pipelines.ingest import read_dataset

    path = root / "sim-calibration.yaml"
    if not path.is_file():
        simulator, sim_world = load_simulator(params)
        episodes, steps = read_dataset(root / "data" / "dataset")
        calibration, _ = calibrate(
            episodes, steps, simulator, sim_world, params.cell, params.calibrate
        )
        write_calibration(calibration, path, {"dataset": str(root / "data" / "dataset")})
    return path


def shift_replay(params, root: Path, policy: Path):
    """The standard-part replay for the shift under `root`: `policy` (the folder of the policy
    that recorded it) in the sim calibrated from it."""
    from flows.plugins import load_counterfactual

    return load_counterfactual(params, policy, shift_calibration(params, root))


def score_shift(
    params, root: Path, truth_path: Path, snapshots: bool, replay_policy: Path | None = None
) -> dict:
    """The triage verdicts of one recorded shift, scored against its ground truth; with
    `replay_policy` (the folder of the policy that recorded it), failures of other parts are
    replayed with the standard part in the sim calibrated from the shift."""
    from pipelines.ingest import read_dataset
    from pipelines.quality.triage import triage
    from pipelines.quality.triage.report import read_capture_sidecars

    captures = root / "data" / "landing" / "captures"
    episodes, steps = read_dataset(root / "data" / "dataset")
    report = triage(
        episodes,
        steps,
        params.cell,
        params.triage,
        read_capture_sidecars(captures, episodes),
        params.record.capture_window_steps,
        captures if snapshots else None,
        shift_replay(params, root, replay_policy) if replay_policy else None,
    )
    truth = {e: r["true_cause"] for e, r in truth_rows(truth_path).items()}
    episode_pairs = [(truth[v.episode_id], v.failure_class) for v in report.verdicts]
    capture_pairs = [
        (truth[c["episode_id"]], c["class"]) for c in report.captures if c["episode_failed"]
    ]
    return {"episodes": episode_pairs, "captures": capture_pairs}


def run(
    seeds: list[int],
    episodes: int,
    workdir: Path,
    params_path: Path,
    baseline_path: Path | None = None,
    replay: bool = False,
) -> dict:
    """Scores per seed and over all seeds: `without_snapshots`, `snapshots` (both with
    `params_path`), with `baseline_path`, `baseline` (snapshots, those params), and with
    `replay`, `replay` (snapshots and the standard-part replay)."""
    from pipelines.contract.params import load_params

    params = load_params(params_path)
    shifts = {}
    for seed in seeds:
        root = Path(workdir) / f"seed-{seed}"
        shifts[seed] = (root, record(params, root, episodes, seed))
    out: dict = {"seeds": seeds, "episodes": episodes}
    variants = [("without_snapshots", params, False, False), ("snapshots", params, True, False)]
    if baseline_path is not None:
        variants.insert(0, ("baseline", load_params(baseline_path), True, False))
    if replay:
        variants.append(("replay", params, True, True))
    for name, chosen, snapshots, replayed in variants:
        pairs = {
            s: score_shift(chosen, root, truth, snapshots, SIM_POLICY if replayed else None)
            for s, (root, truth) in shifts.items()
        }
        out[name] = {
            "per_seed": {str(s): {k: score(v) for k, v in p.items()} for s, p in pairs.items()},
            "all": {
                k: score([pair for p in pairs.values() for pair in p[k]])
                for k in ("episodes", "captures")
            },
        }
    return out


def print_report(report: dict) -> None:
    for name in [
        n for n in ("baseline", "without_snapshots", "snapshots", "replay") if n in report
    ]:
        for seed, scored in report[name]["per_seed"].items():
            print_score(f"{name}, seed {seed}, failed episodes", scored["episodes"])
        print_score(f"{name}, all seeds, failed episodes", report[name]["all"]["episodes"])
        print_score(
            f"{name}, all seeds, captures of failed episodes", report[name]["all"]["captures"]
        )


def print_score(title: str, scored: dict) -> None:
    print(f"\n{title}\ntrue \\ predicted  " + " ".join(f"{c[:10]:>10}" for c in CLASSES))
    for true in CLASSES:
        row = " ".join(f"{scored['confusion'][true][p]:>10}" for p in CLASSES)
        print(f"{true:<17} {row}")
    for cls, m in scored["classes"].items():
        fmt = lambda x: "   -" if x is None else f"{x:.3f}"  # noqa: E731
        print(
            f"{cls:<11} support {m['support']:>4} predicted {m['predicted']:>4} "
            f"precision {fmt(m['precision'])} recall {fmt(m['recall'])}"
        )


if __name__ == "__main__":
    sys.exit(main())
