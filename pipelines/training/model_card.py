"""The model card: a registered model version's description, in Markdown, as the MLflow UI
shows it on the version's page. What the policy is and where it comes from (its run), what it
was trained on (dataset version, source logs, examples), how (hyperparameters, final losses),
and, once the gate has judged it, its hardware trials and the gate's verdict."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pipelines.training.cycle_runs import ARMS, arm_line
from pipelines.training.tracking import BASE_POLICY_TAG, DATASET_VERSION_TAG

if TYPE_CHECKING:
    from mlflow.entities import Run


def model_card(
    run: Run,
    policy_version: str,
    batches: list[str] | None,
    gate_record: Mapping[str, Any] | None = None,
) -> str:
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_RUN_NAME, MLFLOW_RUN_NOTE

    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    name = tags.get(MLFLOW_RUN_NAME) or run.info.run_name or run.info.run_id
    lines = [f"## Policy {policy_version}", ""]
    lines.append(f"From MLflow run `{name}` ({run.info.run_id})")
    if tags.get(MLFLOW_GIT_COMMIT):
        lines[-1] += f", code at git commit `{tags[MLFLOW_GIT_COMMIT][:12]}`"
    lines[-1] += "."
    if tags.get(MLFLOW_RUN_NOTE):
        lines += ["", tags[MLFLOW_RUN_NOTE]]
    lines += ["", "### Data", *_data_lines(run, tags, batches)]
    lines += ["", "### Training"]
    if tags.get(BASE_POLICY_TAG):
        lines.append(f"- fine-tuned from policy {tags[BASE_POLICY_TAG]}")
    if params:
        lines.append("- " + ", ".join(f"{k} = {v}" for k, v in sorted(params.items())))
    losses = [f"{k} {metrics[k]:.4g}" for k in ("train_loss", "val_loss") if k in metrics]
    if losses:
        lines.append("- final " + ", ".join(losses))
    lines += ["", "### Hardware trials", *_trial_lines(gate_record)]
    lines += ["", "### Gate", *_gate_lines(gate_record)]
    return "\n".join(lines) + "\n"


def _data_lines(run: Run, tags: Mapping[str, str], batches: list[str] | None) -> list[str]:
    version = tags.get(DATASET_VERSION_TAG)
    if not version:
        return ["- no dataset recorded (a policy deployed as it came, not trained here)"]
    lines = [f"- dataset version `{version}`"]
    if batches:
        lines.append(
            f"- {len(batches)} source logs (batches), listed in the run's training_batches.json"
        )
    for item in run.inputs.dataset_inputs if run.inputs else []:
        profile = json.loads(item.dataset.profile) if item.dataset.profile else {}
        if {"examples", "episodes_used", "success_steps", "correction_steps"} <= set(profile):
            lines.append(
                f"- {profile['examples']} examples from {profile.get('episodes_used')} episodes: "
                f"{profile.get('success_steps')} steps of successful episodes, "
                f"{profile.get('correction_steps')} operator corrections"
            )
    return lines


def _trial_lines(gate_record: Mapping[str, Any] | None) -> list[str]:
    if gate_record is None:
        return ["Not trialled yet."]
    lines = []
    if gate_record.get("trial_request_id"):
        lines.append(
            f"Request {gate_record['trial_request_id']}, attempt "
            f"{gate_record.get('trial_attempt')}, {gate_record.get('episodes_per_arm')} "
            "episodes per arm:"
        )
    return lines + [arm_line(arm, gate_record.get(arm)) for arm in ARMS]


def _gate_lines(gate_record: Mapping[str, Any] | None) -> list[str]:
    if gate_record is None:
        return ["Not judged yet: no gate, no promotion."]
    verdict = "passed" if gate_record.get("passed") is True else "failed"
    return [f"The gate {verdict}:", *(f"- {r}" for r in gate_record.get("reasons", []))]
