"""Wall time of one retraining cycle with the cells as processes, by stage, for one cell and
for three cells in parallel.

    .venv/bin/python -m bench.loop [--params params.yaml] [--cells 1 3] [--json]

For each fleet size: a fresh workspace with the sim policy copied in, that many reference
cells started as processes (`realloop cell run` with params' `demo:` speed and shift size) and
the sim policy deployed to each, one whole shift landed from every cell; then one cycle of
`realloop loop` through Prefect, timed by the loop itself stage by stage (summary
`timings_s`), the wait for the interleaved trials included. The ratio of the three-cell cycle
to the one-cell cycle says how far the cells' branches overlap (1.0: fully parallel, 3.0:
serial). The direct-call figures from before the cells were processes are in
docs/benchmarks.md. Target: one cycle under 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

CELLS = ("cell-07", "cell-08", "cell-09")
TARGET_CYCLE_S = 600.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loop", description=__doc__)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--cells", type=int, nargs="+", default=[1, 3], choices=[1, 2, 3])
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    try:
        runs = {str(n): run(args.params.resolve(), n) for n in args.cells}
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"bench.loop: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    report = {"runs": runs, "target_cycle_s": TARGET_CYCLE_S}
    if "1" in runs and "3" in runs:
        report["ratio_three_to_one"] = runs["3"]["cycle_s"] / runs["1"]["cycle_s"]
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0


def run(params_path: Path, cells: int) -> dict:
    from flows.demo import Fleet, deploy_initial, running_cells, wait_for_shifts
    from pipelines.contract.params import load_params

    params = load_params(params_path)
    sim_policy = Path(params.pretrain.out).resolve()
    if not (sim_policy / "config.json").is_file():
        raise FileNotFoundError(f"{sim_policy}: no sim policy; run `realloop cell pretrain`")
    with _workspace(params_path, sim_policy) as root:
        fleet = Fleet(str(root / params.ingest.landing), params.promote.channel, [*CELLS[:cells]])
        bench_params = _fleet_params(params_path, root, fleet.cells)
        for cell in fleet.cells:
            deploy_initial(bench_params, params.pretrain.out, cell)
        shift_files = -(-params.demo.episodes_per_shift // params.record.episodes_per_file)
        with running_cells(fleet, params.demo):
            wait_for_shifts(fleet, shift_files, params.demo.first_shift_timeout_s)
            started = time.perf_counter()
            summary = _one_cycle(bench_params, root)
            cycle_s = time.perf_counter() - started
    return {
        "cells": cells,
        "cycle_s": cycle_s,
        "stages_s": summary["timings_s"],
        "outcomes": {c["cell"]: c["outcome"] for c in summary["cells"]},
        "trial_episodes_per_arm": params.demo.trial_episodes,
    }


def _one_cycle(params_path: Path, root: Path) -> dict:
    from flows.commands import _workspace as as_workspace
    from flows.loop import loop_flow

    as_workspace()
    return loop_flow(params_path=str(params_path), workspace=str(root))


def _fleet_params(params_path: Path, root: Path, cells: list[str]) -> Path:
    document = yaml.safe_load(params_path.read_text())
    demo = document["demo"]
    document["fleet"] = {"cells": cells}
    document["trials"] |= {
        "max_episodes": demo["trial_episodes"],
        "poll_s": demo["poll_s"],
        "timeout_s": demo["trial_timeout_s"],
    }
    out = root / "params.yaml"
    out.write_text(yaml.safe_dump(document))
    return out


@contextmanager
def _workspace(params_path: Path, sim_policy: Path) -> Iterator[Path]:
    """A fresh workspace, entered: the cells' boxes and the loop's stores live under it."""
    from pipelines.contract.params import load_params

    here = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="realloop-bench-") as tmp:
        root = Path(tmp)
        shutil.copytree(sim_policy, root / load_params(params_path).pretrain.out)
        os.chdir(root)
        try:
            yield root
        finally:
            os.chdir(here)


def _format(report: dict) -> str:
    lines = []
    for n, run in report["runs"].items():
        outcomes = ", ".join(f"{cell} {outcome}" for cell, outcome in run["outcomes"].items())
        lines.append(f"{n} cell(s): one cycle {run['cycle_s']:.1f} s ({outcomes})")
        lines += [f"  {stage:<16} {s:7.1f} s" for stage, s in run["stages_s"].items()]
    if "ratio_three_to_one" in report:
        lines.append(f"three cells / one cell: {report['ratio_three_to_one']:.2f}")
    lines.append(f"target: one cycle under {report['target_cycle_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
