"""What a finished cycle leaves behind: its summary appended to the workspace's ledger
(`.realloop/cycles.jsonl`, whose length numbers the cycles), each cell's MLflow run of the
cycle with its trials and gate, and the DVC/git commit tagged cycle-<n>."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipelines.contract.params import Params

CYCLES = Path(".realloop/cycles.jsonl")  # one summary per finished cycle, in the workspace
THIN = {"cache_policy": NO_CACHE}  # stage results are never reused across runs


def record(params: Params, root: Path, summary: dict) -> None:
    """The cycle in DVC and git (its result in the summary), its MLflow runs, the ledger."""
    summary["dvc"] = _dvc_commit(params, root, summary)
    mlflow_cycle_runs(params, root, summary, return_state=True)  # a failure is logged, no more
    record_cycle(root, summary)


@task(name="mlflow-cycle-runs", **THIN)
def mlflow_cycle_runs(params: Params, workspace: Path, summary: dict) -> dict[str, str]:
    """Each cell's MLflow run of the cycle ended, with its trials and gate as child runs."""
    from pipelines.training.cycle_runs import log_cycle_runs

    return log_cycle_runs(workspace, params.train.experiment, summary)


@task(name="dvc-commit", **THIN)
def dvc_commit(params: Params, workspace: Path, summary: dict) -> dict:
    """The cycle in DVC and git: trials.json, each fine-tuned cell's stage in dvc.lock, one
    commit tagged cycle-<n> (pipelines/release/cycle_record.py)."""
    from pipelines.release.cycle_record import record_cycle as record_in_dvc

    return record_in_dvc(workspace, params, summary)


def _dvc_commit(params: Params, root: Path, summary: dict) -> dict:
    """A failed record does not undo the cycle (its promotions stand): it is reported in the
    summary, and `dvc status` shows what stays to commit."""
    state = dvc_commit(params, root, summary, return_state=True)
    if state.is_completed():
        return state.result()
    reason = str(state.result(raise_on_failure=False)).splitlines()[0]
    get_run_logger().warning("recording the cycle in DVC and git failed: %s", reason)
    return {"commit": None, "stages": [], "error": reason}


def cycles_done(root: Path) -> int:
    ledger = root / CYCLES
    return len(ledger.read_text().splitlines()) if ledger.is_file() else 0


def record_cycle(root: Path, summary: dict) -> None:
    ledger = root / CYCLES
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a") as handle:
        handle.write(json.dumps(summary, default=str) + "\n")
