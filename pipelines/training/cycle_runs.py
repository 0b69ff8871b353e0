"""A loop cycle in MLflow: one parent run per cell and cycle ("cycle 3 cell-07") with a child
run per stage: "finetune cell-07 cycle 3" (tracking.start_finetune_run), "trials cell-07
cycle 3" and "gate cell-07 cycle 3" (the gate's verdict and the promotion).

The trial and gate figures that decide promotion are metrics (`trial/candidate_success`,
`gate/statistic`, ...; `trial_gate_metrics`): on the candidate's fine-tune run, where
`registry.record_gate` puts them as the gate judges, and, when the cycle ends, on the
trials or gate child and on the parent, so the experiment's runs sort and chart by them.
Every name is listed in docs/tracking.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.training.tracking import (
    CELL_TAG,
    DATASET_VERSION_TAG,
    STAGE_TAG,
    ensure_experiment,
    mlflow_client,
    quiet_mlflow,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

CYCLE_TAG = "realloop.cycle"
# The loop's candidates (flows/candidates.py): which one a run built, the calibration it used.
CANDIDATE_TAG = "realloop.candidate"
CALIBRATION_HASH_TAG, CALIBRATION_PATH_TAG = "calibration.hash", "calibration.path"
PRESCREEN_FIGURES = ("action_mse", "action_agreement", "sim_success", "score", "rank")
OUTCOME_TAG = "realloop.outcome"  # promoted, not promoted, trials incomplete, skipped, failed
ARMS = ("candidate", "incumbent")
# Per arm: trial/<arm>_<figure>, from the arm's TrialStats record.
ARM_FIGURES = {
    "episodes": "n",
    "successes": "successes",
    "success": "success_rate",
    "safety_stops": "safety_stops",
    "p95_cycle_time_s": "p95_cycle_time_s",
}
WAITED_METRIC = "trial/waited_s"
PROMOTED_METRIC = "gate/promoted"
# metric -> the gate record's field (pipelines.release.gate.GateDecision)
GATE_FIGURES = {
    "gate/statistic": "statistic",
    "gate/bound": "bound",
    "gate/noninferiority_margin": "margin",
    "gate/alpha": "alpha",
    "gate/episodes_used": "episodes_used",
    "gate/max_episodes": "max_episodes",
    "gate/cycle_time_budget_s": "cycle_time_budget_s",
}


def cycle_run_name(cycle: int, cell_id: str) -> str:
    return f"cycle {cycle} {cell_id}"


def stage_run_name(stage: str, cell_id: str, cycle: int | None) -> str:
    """ "finetune cell-07 cycle 3"; without a cycle (`realloop train`), "finetune cell-07"."""
    return f"{stage} {cell_id}" + ("" if cycle is None else f" cycle {cycle}")


def trial_gate_metrics(gate_record: Mapping[str, Any]) -> dict[str, float]:
    """The figures of a gate record as metrics: per arm trial/<arm>_episodes, _successes,
    _success (rate), _success_low and _success_high (its interval, descriptive), _safety_stops
    and _p95_cycle_time_s (absent without a successful episode); gate/passed (1 or 0) and the
    sequential test's figures (pipelines.release.gate): gate/statistic and gate/bound (the
    non-inferiority score statistic and its efficacy boundary at the deciding look),
    gate/noninferiority_margin, gate/alpha, gate/episodes_used and gate/max_episodes (per arm),
    gate/superiority (1 or 0, reported, never required), gate/cycle_time_budget_s."""
    metrics: dict[str, float] = {}
    for arm in ARMS:
        stats = gate_record.get(arm) or {}
        for name, key in ARM_FIGURES.items():
            if isinstance(stats.get(key), int | float):
                metrics[f"trial/{arm}_{name}"] = float(stats[key])
        if stats.get("interval"):
            low, high = stats["interval"]
            metrics[f"trial/{arm}_success_low"] = float(low)
            metrics[f"trial/{arm}_success_high"] = float(high)
    metrics["gate/passed"] = 1.0 if gate_record.get("passed") is True else 0.0
    for metric, key in GATE_FIGURES.items():
        if isinstance(gate_record.get(key), int | float):
            metrics[metric] = float(gate_record[key])
    superiority = gate_record.get("superiority") or {}
    if isinstance(superiority.get("shown"), bool):
        metrics["gate/superiority"] = 1.0 if superiority["shown"] else 0.0
    return metrics


def start_cycle_run(
    workspace: Path, experiment: str, cycle: int, cell_id: str, dataset_version: str
) -> str:
    """The cell's run for this cycle (made on first use, RUNNING until `log_cycle_runs` ends
    it); the id of the one already there when a cycle is re-run after a crash."""
    client = mlflow_client(workspace)
    experiment_id = ensure_experiment(client, workspace, experiment)
    return _cycle_run(client, experiment_id, cycle, cell_id, dataset_version)


def log_cycle_runs(workspace: Path, experiment: str, summary: Mapping[str, Any]) -> dict[str, str]:
    """End each cell's cycle run with what the cycle summary says of the cell: its trials and
    gate as child runs, their figures mirrored on it, its outcome as tag and description.
    A cell that stopped before fine-tuning (skipped, failed) gets its cycle run here. Returns
    cell id → cycle run id."""
    client = mlflow_client(workspace)
    experiment_id = ensure_experiment(client, workspace, experiment)
    runs = {}
    for cell in summary["cells"]:
        parent = _cycle_run(
            client, experiment_id, summary["cycle"], cell["cell"], cell["dataset_version"]
        )
        _log_cell(client, experiment_id, summary["cycle"], cell, parent)
        runs[cell["cell"]] = parent
    return runs


def candidate_run(
    workspace: Path,
    experiment: str,
    cycle: int,
    cell_id: str,
    dataset_version: str,
    candidate: str,
) -> str:
    """A candidate that no fine-tune run registers (the loop's `calibrated`: a policy
    pretrained in the calibrated sim): its own child run of the cell's cycle run ("calibrated
    cell-07 cycle 3"), tagged with the candidate and the dataset version (which the registry
    copies onto the model version registered from it). A re-run finds it again. End it with
    `end_candidate_run`."""
    client = mlflow_client(workspace)
    experiment_id = ensure_experiment(client, workspace, experiment)
    parent = _cycle_run(client, experiment_id, cycle, cell_id, dataset_version)
    run_id = _child_run(client, experiment_id, parent, candidate, cell_id, cycle)
    client.set_tag(run_id, DATASET_VERSION_TAG, dataset_version)
    client.set_tag(run_id, CANDIDATE_TAG, candidate)
    return run_id


def end_candidate_run(
    workspace: Path, run_id: str, tags: Mapping[str, str], description: str, status: str
) -> None:
    _finish(mlflow_client(workspace), run_id, {}, dict(tags), description, _now_ms(), status)


def log_prescreen(workspace: Path, candidates: list[Mapping[str, Any]]) -> None:
    """Each candidate's pre-screen on its run (`mlflow_run_id`): metrics prescreen/<figure>
    (pipelines.release.prescreen.FIGURES, those measured) and prescreen/selected; tags
    realloop.candidate and, for a calibrated one, calibration.hash and calibration.path."""
    from mlflow.entities import Metric, RunTag

    quiet_mlflow()
    client, now = mlflow_client(workspace), _now_ms()
    for candidate in candidates:
        if not candidate.get("mlflow_run_id"):
            continue
        figures = {
            f"prescreen/{k}": float(v)
            for k, v in candidate.items()
            if k in PRESCREEN_FIGURES and isinstance(v, int | float)
        }
        figures["prescreen/selected"] = 1.0 if candidate.get("selected") else 0.0
        tags = {CANDIDATE_TAG: candidate["name"]}
        if calibration := candidate.get("calibration"):
            tags |= {
                CALIBRATION_HASH_TAG: calibration["hash"],
                CALIBRATION_PATH_TAG: calibration["path"],
            }
        client.log_batch(
            candidate["mlflow_run_id"],
            metrics=[Metric(k, v, now, 0) for k, v in figures.items()],
            tags=[RunTag(k, str(v)) for k, v in tags.items()],
        )


def _now_ms() -> int:
    return int(time.time() * 1000)


# --- internals -----------------------------------------------------------------------------


def _cycle_run(
    client: MlflowClient, experiment_id: str, cycle: int, cell_id: str, dataset_version: str
) -> str:
    from pipelines.training.mlflow_context import run_context_tags

    tags = {CYCLE_TAG: str(cycle), CELL_TAG: cell_id, STAGE_TAG: "cycle"}
    found = _find_run(client, experiment_id, tags)
    if found is not None:
        return found
    description = f"Loop cycle {cycle} of {cell_id} on dataset version {dataset_version}."
    run = client.create_run(
        experiment_id,
        run_name=cycle_run_name(cycle, cell_id),
        tags=tags | {DATASET_VERSION_TAG: dataset_version} | run_context_tags(description),
    )
    return run.info.run_id


def _child_run(
    client: MlflowClient,
    experiment_id: str,
    parent: str,
    stage: str,
    cell_id: str,
    cycle: int,
    started_ms: int | None = None,
) -> str:
    from pipelines.training.mlflow_context import run_context_tags

    tags = {CYCLE_TAG: str(cycle), CELL_TAG: cell_id, STAGE_TAG: stage}
    found = _find_run(client, experiment_id, tags)
    if found is not None:
        return found
    run = client.create_run(
        experiment_id,
        start_time=started_ms,
        run_name=stage_run_name(stage, cell_id, cycle),
        tags=tags | run_context_tags(parent_run_id=parent),
    )
    return run.info.run_id


def _find_run(client: MlflowClient, experiment_id: str, tags: Mapping[str, str]) -> str | None:
    where = " and ".join(f"tags.`{key}` = '{value}'" for key, value in tags.items())
    found = client.search_runs([experiment_id], where, max_results=1)
    return found[0].info.run_id if found else None


def _log_cell(
    client: MlflowClient, experiment_id: str, cycle: int, cell: Mapping[str, Any], parent: str
) -> None:
    cell_id, now = cell["cell"], int(time.time() * 1000)
    trained = cell.get("training") or {}
    figures = {}
    if trained.get("mlflow_run_id"):
        metrics = client.get_run(trained["mlflow_run_id"]).data.metrics
        figures = {k: v for k, v in metrics.items() if k.startswith(("trial/", "gate/"))}
    if cell.get("waited_s") is not None:
        figures[WAITED_METRIC] = float(cell["waited_s"])
    promotion = cell.get("promotion")
    if promotion is not None:
        figures[PROMOTED_METRIC] = 1.0 if promotion.get("promoted") else 0.0
    if cell.get("trial_request"):
        request = cell["trial_request"]
        run_id = _child_run(
            client, experiment_id, parent, "trials", cell_id, cycle, _ms(request.get("created_at"))
        )
        tags = {"trial_request_id": request.get("request_id", "")}
        if cell.get("attempt"):
            tags["trial_attempt"] = cell["attempt"]["attempt"]
        trial_figures = {k: v for k, v in figures.items() if k.startswith("trial/")}
        _finish(client, run_id, trial_figures, tags, _trials_note(cell), now)
    if cell.get("gate"):
        run_id = _child_run(client, experiment_id, parent, "gate", cell_id, cycle)
        gate_figures = {k: v for k, v in figures.items() if k.startswith("gate/")}
        tags = {"gate.passed": "true" if cell["gate"]["passed"] else "false"}
        if promotion and promotion.get("alias"):
            tags["promotion.alias"] = promotion["alias"]
            tags["promotion.bundle_id"] = (promotion.get("bundle") or {}).get("bundle_id", "")
        _finish(client, run_id, gate_figures, tags, _gate_note(cell), now)
    tags = {OUTCOME_TAG: cell["outcome"]}
    if trained.get("model_version"):
        tags["model_version"] = str(trained["model_version"])
    status = "FAILED" if cell["outcome"] == "failed" else "FINISHED"
    _finish(client, parent, figures, tags, _cycle_note(cycle, cell), now, status)


def _finish(client, run_id, metrics, tags, note, now, status="FINISHED") -> None:
    from mlflow.entities import Metric, RunTag
    from mlflow.utils.mlflow_tags import MLFLOW_RUN_NOTE

    quiet_mlflow()
    client.log_batch(
        run_id,
        metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
        tags=[RunTag(k, str(v)) for k, v in (tags | {MLFLOW_RUN_NOTE: note}).items()],
    )
    client.set_terminated(run_id, status, end_time=now)


def _ms(iso: str | None) -> int | None:
    if not iso:
        return None
    return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)


def arm_line(arm: str, stats: Mapping[str, Any] | None) -> str:
    if not stats or "n" not in stats:
        return f"- {arm}: no trials"
    line = f"- {arm}: {stats.get('successes')}/{stats['n']} successes"
    if stats.get("interval"):
        low, high = stats["interval"]
        line += f" ({stats.get('success_rate', 0):.1%}, Wilson interval {low:.3f}–{high:.3f})"
    return line + f", {stats.get('safety_stops')} safety stops"


def _trials_note(cell: Mapping[str, Any]) -> str:
    request = cell["trial_request"]
    lines = [f"Hardware trials of request {request.get('request_id')} on {cell['cell']}."]
    if cell.get("attempt"):
        lines.append(f"Judged attempt: {cell['attempt']['attempt']}.")
    lines += [arm_line(arm, (cell.get("trials") or {}).get(arm)) for arm in ARMS]
    return "\n".join(lines)


def _gate_note(cell: Mapping[str, Any]) -> str:
    verdict = "passed" if cell["gate"]["passed"] else "failed"
    lines = [
        f"The gate {verdict} for {cell['cell']}:",
        *(f"- {r}" for r in cell["gate"]["reasons"]),
    ]
    promotion = cell.get("promotion") or {}
    lines += [f"- {r}" for r in promotion.get("reasons", []) if r not in cell["gate"]["reasons"]]
    return "\n".join(lines)


def _cycle_note(cycle: int, cell: Mapping[str, Any]) -> str:
    trained = cell.get("training") or {}
    lines = [
        f"Loop cycle {cycle} of {cell['cell']} on dataset version {cell['dataset_version']}: "
        f"{cell['outcome']}" + (f" ({cell['reason']})" if cell.get("reason") else "") + "."
    ]
    if trained:
        lines.append(
            f"Candidate: {trained.get('registered_model')} version {trained.get('model_version')}"
            f" (policy {trained.get('policy_version')}, from {trained.get('base_policy')})."
        )
    if cell.get("trials"):
        lines += [arm_line(arm, cell["trials"].get(arm)) for arm in ARMS]
    return "\n".join(lines)
