"""Fine-tuning efficacy: line success against the real episodes used, per `train.mode`, from
the sim policy and from a calibrated policy.

    .venv/bin/python -m bench.efficacy [--cache DIR] [--episodes 50,150,300]
        [--modes full,anchored,residual] [--eval-episodes 100] [--json]

The line data is what the loop trains on: each base runs a shift on cell-07's line with the
operator on (`record_shift`, as `realloop cell record --interventions` does), the logs are
ingested and read back with `read_dataset`, and `training_examples` builds the TrainingSet. The
first `n` episodes of a fixed permutation of the shift are used for `n` in --episodes (nested:
the 50 are among the 150). Each fine-tuned policy (and the base) is evaluated on cell-07 with no
operator on three held-out seeds, each at another offset into the shift (the lighting and load
follow the shift's clock); the figure is the mean over the three runs, with their range, never
the best. Base and candidates see the same episodes (common seeds), so their difference is
less noisy than either figure.

The calibrated base is made once: `realloop calibrate` on the sim policy's recorded shift,
then `realloop cell pretrain --calibration`. Everything slow (the shifts, the ingest, the
calibration and the calibrated pretraining) is cached under --cache and reused (the first run
makes it: about 20 minutes); the default run then fine-tunes and evaluates only: 18
fine-tunes and 20 evaluations, 7.8 minutes of CPU on one core (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.cli import report_or_error

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"  # the figures are per core, as the loop's `train.threads: 1` runs

ROOT = Path(__file__).resolve().parent.parent
CELL_WORLD = "cell-07"
SHIFT_EPISODES = 300  # one recorded shift per base: the largest training budget
SHIFT_START = datetime(2026, 1, 5, 6, 0, tzinfo=UTC)  # timestamps only; lighting follows the index
RECORD_SEEDS = {"sim": 101, "calibrated": 102}  # never used for evaluation
EVAL_SEEDS = (9001, 9002, 9003)  # held out: neither recorded nor trained on
SUBSET_SEED = 5  # the permutation of the shift's episodes the budgets take prefixes of
DEFAULT_CACHE = Path("/tmp/realloop-efficacy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.efficacy", description=__doc__)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="recorded shifts etc.")
    parser.add_argument("--episodes", default="50,150,300", help="real episodes used, each run")
    parser.add_argument("--modes", default="full,anchored,residual", help="train.mode values")
    parser.add_argument("--bases", default="sim,calibrated")
    parser.add_argument("--eval-episodes", type=int, default=100, help="per held-out seed")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    errors = (FileNotFoundError, ValueError, subprocess.CalledProcessError)
    return report_or_error("efficacy", lambda: run(args), print_report, args.json, errors)


def _say(message: str) -> None:
    print(f"[efficacy] {message}", file=sys.stderr, flush=True)


# --- the cached line data and calibrated base -------------------------------------------------


def _workspace(cache: Path, base: str) -> Path:
    return cache / f"line-{base}"


def _realloop(workspace: Path, *args: str) -> str:
    """The `realloop` command line in `workspace`, as a user runs it; its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    gitconfig = workspace.parent / "gitconfig"  # dataset versions are git commits
    if not gitconfig.exists():
        gitconfig.write_text("[user]\n\tname = bench\n\temail = bench@example.invalid\n")
    env["GIT_CONFIG_GLOBAL"] = str(gitconfig)
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"realloop {' '.join(args)} in {workspace}: {reason}")
    return done.stdout


def _record_and_ingest(workspace: Path, base_policy: Path, seed: int, params_path: Path) -> None:
    """One shift of SHIFT_EPISODES on cell-07 with the operator on, ingested (`realloop ingest`)."""
    from pipelines.contract.params import load_params
    from pipelines.training.policy import load_policy
    from refcell.shift import record_shift
    from refcell.world import load_world

    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "params.yaml").write_text(params_path.read_text())
    params = load_params(params_path)
    policy = load_policy(base_policy)
    _say(f"recording {SHIFT_EPISODES} episodes of {policy.name} on {CELL_WORLD} (operator on)")
    record_shift(
        load_world(CELL_WORLD),
        params.cell,
        params.record,
        policy,
        SHIFT_EPISODES,
        workspace / params.ingest.landing,
        seed,
        interventions=True,
        policy_version=policy.name,
        shift_start=SHIFT_START,
    )
    _say(f"ingesting into {workspace / params.ingest.dataset}")
    _realloop(workspace, "ingest", "--json")
    (workspace / "ready").write_text(str(base_policy) + "\n")


def prepare(cache: Path, params_path: Path) -> dict[str, Path]:
    """The two bases' folders, with their recorded and ingested shifts; made once, then reused."""
    cache.mkdir(parents=True, exist_ok=True)
    sim_policy = ROOT / "models" / "sim-policy"
    if not (sim_policy / "config.json").is_file():
        raise FileNotFoundError(f"{sim_policy}: missing; run `realloop cell pretrain` first")
    sim_ws = _workspace(cache, "sim")
    if not (sim_ws / "ready").is_file():
        _record_and_ingest(sim_ws, sim_policy, RECORD_SEEDS["sim"], params_path)
    calibrated = sim_ws / "models" / "calibrated-policy"
    if not (calibrated / "config.json").is_file():
        (sim_ws / "params.yaml").write_text(params_path.read_text())  # today's keys
        if not (sim_ws / "sim-calibration.yaml").is_file():
            _say("calibrating on the sim policy's shift")
            _realloop(sim_ws, "calibrate", "--json")
        _say("pretraining in the calibrated sim")
        _realloop(
            sim_ws, "cell", "pretrain", "--calibration", "sim-calibration.yaml",
            "--out", str(calibrated), "--json",
        )  # fmt: skip
    cal_ws = _workspace(cache, "calibrated")
    if not (cal_ws / "ready").is_file():
        _record_and_ingest(cal_ws, calibrated, RECORD_SEEDS["calibrated"], params_path)
    return {"sim": sim_policy, "calibrated": calibrated}


# --- fine-tune and evaluate ---------------------------------------------------------------


def line_tables(workspace: Path, params_path: Path):
    """The ingested shift's (episodes, steps) tables, read as the loop reads them."""
    from pipelines.contract.params import load_params
    from pipelines.ingest import read_dataset

    return read_dataset(workspace / load_params(params_path).ingest.dataset)


def first_episodes(episodes, steps, n: int):
    """`n` episodes of the shift: a prefix of a fixed permutation, so smaller budgets are
    subsets of larger ones and every budget spans the whole shift (lighting, load)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = episodes["episode_id"].to_numpy(zero_copy_only=False)
    keep = np.sort(np.random.default_rng(SUBSET_SEED).permutation(len(ids))[:n])
    chosen = episodes.take(pa.array(keep))
    wanted = pc.is_in(steps["episode_id"], value_set=chosen["episode_id"])
    return chosen, steps.filter(wanted)


def evaluate(net, cell_params, eval_episodes: int) -> dict:
    """Success on cell-07 with no operator: one run per held-out seed, each starting at another
    third of the shift; the mean and range over the runs."""
    from pipelines.training.policy import Policy
    from refcell.cell import Cell
    from refcell.runner import run_episode
    from refcell.world import load_world

    policy, cell = Policy(net), Cell(load_world(CELL_WORLD), cell_params)
    rates = []
    for i, seed in enumerate(EVAL_SEEDS):
        start = i * SHIFT_EPISODES // len(EVAL_SEEDS)
        wins = sum(
            run_episode(cell, policy, seed, start + k, SHIFT_EPISODES).success
            for k in range(eval_episodes)
        )
        rates.append(wins / eval_episodes)
    return {
        "success": round(sum(rates) / len(rates), 4),
        "range": [min(rates), max(rates)],
        "per_seed": rates,
    }


def run(args: argparse.Namespace) -> dict:
    import torch

    from pipelines.contract.params import load_params
    from pipelines.training.finetune import finetune, training_examples
    from pipelines.training.policy import load_policy

    torch.set_num_threads(1)
    params = load_params(args.params)
    bases = prepare(args.cache, args.params)
    budgets = [int(n) for n in args.episodes.split(",")]
    modes = args.modes.split(",")
    report = {
        "cell": CELL_WORLD,
        "eval_seeds": list(EVAL_SEEDS),
        "eval_episodes_per_seed": args.eval_episodes,
        "default_mode": params.train.mode,
        "bases": {},
    }
    for name in args.bases.split(","):
        base = load_policy(bases[name]).net
        episodes, steps = line_tables(_workspace(args.cache, name), args.params)
        _say(f"evaluating base {name}")
        entry = {
            "policy": str(bases[name]),
            "base": evaluate(base, params.cell, args.eval_episodes),
        }
        for mode in modes:
            train = dataclasses.replace(params.train, mode=mode, threads=1)
            rows = []
            for n in budgets:
                data = training_examples(*first_episodes(episodes, steps, n),
                                         train.intervention_weight)  # fmt: skip
                started = time.perf_counter()
                net, _ = finetune(base, data, train, version=f"{name}-{mode}-{n}")
                seconds = time.perf_counter() - started
                result = evaluate(net, params.cell, args.eval_episodes)
                delta = round(result["success"] - entry["base"]["success"], 4)
                rows.append({"episodes": n, "examples": len(data), "train_s": round(seconds, 1),
                             **result, "vs_base": delta})  # fmt: skip
                _say(f"{name} {mode} {n}: {result['success']:.3f} ({delta:+.3f} vs base)")
            entry[mode] = rows
        report["bases"][name] = entry
    return report


def print_report(report: dict) -> None:
    print(f"line success on {report['cell']}, mean [range] over held-out seeds "
          f"{report['eval_seeds']} x {report['eval_episodes_per_seed']} episodes")  # fmt: skip
    for name, entry in report["bases"].items():
        base = entry["base"]
        print(f"base {name}: {base['success']:.1%} [{base['range'][0]:.0%}-{base['range'][1]:.0%}]")
        for mode, rows in entry.items():
            if mode in ("policy", "base"):
                continue
            cells = "  ".join(
                f"{r['episodes']}: {r['success']:.1%} ({r['vs_base']:+.1%})" for r in rows
            )
            print(f"  {mode:9s} {cells}")


if __name__ == "__main__":
    sys.exit(main())
