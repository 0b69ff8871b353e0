"""Control steps per second of the reference cell on the line, without and with logging.

    .venv/bin/python -m bench.refcell [--steps N] [--operator] [--json]

Both modes run in one process, pinned to one thread, with the same controller, seed and
episode count: (a) `run_episodes` with no observers, (b) `record_shift` writing MCAP logs and
captures into a temporary folder. The ratio (b)/(a) is the cost of logging; the target is
at least 1,000 control steps/s per core with logging on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.cli import report_or_error

# numpy and torch are imported inside functions, after this: the figures are per core.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

TARGET_STEPS_PER_S = 1000.0
SHIFT_START = datetime(2026, 1, 5, 6, 0, tzinfo=UTC)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.refcell", description=__doc__)
    parser.add_argument(
        "--steps", type=int, default=30000, help="step budget per mode (steps/max_steps episodes)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--operator", action="store_true", help="operator takes over in both modes, as on shifts"
    )
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)

    def produce() -> dict:
        return run(args.steps, args.seed, args.operator, args.params)

    return report_or_error("refcell", produce, print_report, args.json)


def run(step_budget: int, seed: int, operator_on: bool, params_path: Path) -> dict:
    import matplotlib.image  # noqa: F401  (the recorder's snapshots need it: a one-off import)
    import torch

    from pipelines.contract.params import load_params
    from refcell.runner import Operator, run_episodes
    from refcell.world import load_world

    torch.set_num_threads(1)
    params = load_params(params_path)
    controller = _controller(params)
    line = load_world("line")
    episodes = max(1, math.ceil(step_budget / params.cell.max_steps))
    operator = Operator(params.record.operator) if operator_on else None

    list(run_episodes(line, params.cell, controller, 2, seed + 1, operator))  # warm up

    started = time.perf_counter()
    plain = list(run_episodes(line, params.cell, controller, episodes, seed, operator))
    plain_s = time.perf_counter() - started
    plain_steps = sum(r.steps for r in plain)
    plain_rate = plain_steps / plain_s

    logged = _record(line, params, controller, episodes, seed, operator_on)
    logged_rate = logged["steps"] / logged["seconds"]
    return {
        "controller": controller.name,
        "world": "line",
        "operator": operator_on,
        "episodes": episodes,
        "seed": seed,
        "threads": torch.get_num_threads(),
        "no_logging": {
            "steps": plain_steps,
            "seconds": round(plain_s, 3),
            "steps_per_s": round(plain_rate, 1),
        },
        "logging": {**logged, "steps_per_s": round(logged_rate, 1)},
        "ratio": round(logged_rate / plain_rate, 3),
        "target_steps_per_s": TARGET_STEPS_PER_S,
        "target_met": logged_rate >= TARGET_STEPS_PER_S,
    }


def _record(line, params, controller, episodes: int, seed: int, operator_on: bool) -> dict:
    """Time `record_shift` up to its last episode; its ground-truth replays come after."""
    from refcell.shift import record_shift

    episode_done_at: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-refcell-") as out:
        started = time.perf_counter()
        summary = record_shift(
            line, params.cell, params.record, controller, episodes, Path(out), seed,
            interventions=operator_on, policy_version=controller.name, shift_start=SHIFT_START,
            progress=lambda done, total: episode_done_at.append(time.perf_counter()),
        )  # fmt: skip
        finished = time.perf_counter()
        rows = Path(summary["ground_truth"]).read_text().splitlines()
        steps = sum(json.loads(row)["steps"] for row in rows)  # one EpisodeResult per row
        logs = [*Path(out).glob("*.mcap"), *Path(out, "captures").iterdir()]
        written = sum(p.stat().st_size for p in logs)
    return {
        "steps": steps,
        "seconds": round(episode_done_at[-1] - started, 3),
        "ground_truth_s": round(finished - episode_done_at[-1], 3),  # not timed: refcell-only
        "files": len(summary["files"]),
        "captures": len(summary["captures"]),
        "megabytes_written": round(written / 1e6, 2),
    }


def _controller(params):
    """The sim policy from pretrain.out, or the privileged expert if none was trained."""
    folder = Path(params.pretrain.out)
    if (folder / "config.json").is_file():
        from pipelines.training import load_policy

        return load_policy(folder)
    from refcell.expert import Expert

    return Expert()


def print_report(r: dict) -> None:
    a, b = r["no_logging"], r["logging"]
    operator = "on" if r["operator"] else "off"
    print(
        f"reference cell: {r['controller']} on the {r['world']}, {r['episodes']} episodes, "
        f"seed {r['seed']}, operator {operator}, {r['threads']} thread"
    )
    print(f"  no logging: {a['steps_per_s']:8.1f} steps/s ({a['steps']} steps, {a['seconds']} s)")
    print(
        f"  logging:    {b['steps_per_s']:8.1f} steps/s ({b['steps']} steps, {b['seconds']} s; "
        f"{b['files']} logs, {b['captures']} captures, {b['megabytes_written']} MB)"
    )
    print(f"  ratio logging/no-logging: {r['ratio']:.3f}")
    verdict = "met" if r["target_met"] else "NOT met"
    print(f"  target >= {r['target_steps_per_s']:.0f} steps/s per core, logging on: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
