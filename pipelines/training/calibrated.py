"""The loop's calibrated candidates: the sim calibrated from a cell's newest shifts, a policy
pretrained there (kept by the calibration's content hash: pipelines.calibrate.cache), and
that policy registered as a candidate of the cell's cycle.

The simulator comes in as callables (params `simulator:`, loaded by flows.plugins): nothing
here imports one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipelines.calibrate.cache import CachedCalibration, choose_calibration
from pipelines.contract.params import Params, PretrainParams

CALIBRATED_DIR = Path("models/calibrated")  # per cell: <hash>/ (calibration, policy), current.json
FINETUNED_DIR = "finetuned"  # per cell: the calibrated policy fine-tuned (calibrated_finetune)


def cell_folder(workspace: Path, cell_id: str) -> Path:
    return Path(workspace) / CALIBRATED_DIR / cell_id


def calibrate_cell(
    params: Params,
    workspace: Path,
    cell_id: str,
    batches: list[str],
    dataset_version: str,
    simulator: Any,
    sim_world: Mapping,
) -> CachedCalibration:
    """Calibrate from the cell's `batches` (its newest whole shifts among them up to
    `loop.calibrate_episodes` episodes) and choose the calibration to pretrain in: this one,
    or the one in use when nothing moved beyond `loop.recalibrate_sigmas` standard errors.
    ValueError (one line) when those shifts hold fewer than calibrate.min_episodes."""
    from pipelines.calibrate import calibrate, write_calibration
    from pipelines.ingest import read_dataset

    dataset = Path(workspace) / params.ingest.dataset
    episodes, steps = read_dataset(dataset, sources=batches)
    settings = dataclasses.replace(params.calibrate, episodes=params.loop.calibrate_episodes)
    calibration, fitted = calibrate(episodes, steps, simulator, sim_world, params.cell, settings)
    provenance = {
        "dataset_version": dataset_version,
        "cell_id": cell_id,
        "batches": len(batches),
        "shifts": sorted({logged.shift_id for logged in fitted["logs"]}),  # the ones it read
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return choose_calibration(
        cell_folder(workspace, cell_id),
        calibration.as_dict(),
        params.loop.recalibrate_sigmas,
        lambda path: write_calibration(calibration, path, provenance),
        floor=params.calibrate.randomization_floor,
    )


def loop_pretrain_params(params: Params) -> PretrainParams:
    """`pretrain:` with the loop's cheaper settings (`loop.pretrain_*`)."""
    loop = params.loop
    return dataclasses.replace(
        params.pretrain,
        demo_episodes=loop.pretrain_demo_episodes,
        dagger_rounds=loop.pretrain_dagger_rounds,
        dagger_max_rounds=loop.pretrain_dagger_max_rounds,
        dagger_target_success=loop.pretrain_dagger_target_success,
        dagger_episodes=loop.pretrain_dagger_episodes,
        epochs=loop.pretrain_epochs,
        learning_rate_schedule=loop.pretrain_learning_rate_schedule,
        history=loop.pretrain_history,
        output_gain=loop.pretrain_output_gain,
        ensemble=loop.pretrain_ensemble,
        reinforce=loop.pretrain_reinforce,
    )


def ensure_calibrated_policy(
    params: Params, calibration: CachedCalibration, pretrain: Callable[..., tuple[Any, Any]]
) -> dict:
    """The calibration's policy: the cached one, or pretrained now through `pretrain` (params
    `simulator.pretrain`) and saved with its edge files. Returns folder, whether it was
    cached, and the seconds spent."""
    from pipelines.training.onnx_export import save_policy_for_edge
    from pipelines.training.train import intra_op_threads

    settings = loop_pretrain_params(params)
    if calibration.pretrained and _same_student(calibration.policy, settings):
        return {"policy_folder": str(calibration.policy), "cached": True, "seconds": 0.0}
    started = time.monotonic()
    with intra_op_threads(params.train.threads):
        net, observations = pretrain(
            calibration.path, params.cell, settings, f"sim-cal-{calibration.hash[:8]}"
        )
    folder, _ = save_policy_for_edge(
        net,
        calibration.policy,
        observations,
        params.edge.ood_false_alarm,
        params.edge.footprint_tolerance_m,
    )
    seconds = round(time.monotonic() - started, 1)
    return {"policy_folder": str(folder), "cached": False, "seconds": seconds}


def _same_student(folder: Path, settings: PretrainParams) -> bool:
    """The cached policy is the student `settings` would pretrain (frames seen, output gain,
    members, iterations paid for success): a workspace from before a change of
    `loop.pretrain_history` gets a new one."""
    from pipelines.training.policy import load_policy

    config = load_policy(folder).net.config
    reinforced = config.trained_on.get("reinforce", {}).get("iterations", 0)
    student = (config.history, config.output_gain, config.ensemble, reinforced)
    wanted = settings.reinforce.iterations if settings.reinforce else 0
    return student == (settings.history, settings.output_gain, settings.ensemble, wanted)


def register_calibrated(
    params: Params,
    workspace: Path,
    cell_id: str,
    calibration: CachedCalibration,
    policy_folder: Path,
    dataset_version: str,
    cycle: int,
) -> dict:
    """The calibrated policy as the cell's `calibrated` candidate this cycle: registered from
    a child run of the cycle run, tagged with its calibration. Returns what a fine-tune
    returns (retrain.fine_tune_and_register), so trials and the gate treat it alike."""
    from pipelines.training.cycle_runs import (
        CALIBRATION_HASH_TAG,
        CALIBRATION_PATH_TAG,
        candidate_run,
        end_candidate_run,
    )
    from pipelines.training.policy import load_policy
    from pipelines.training.registry import register_policy
    from pipelines.training.tracking import CELL_TAG

    policy = load_policy(policy_folder)
    path = _relative(calibration.path, workspace)
    tags = {
        CALIBRATION_HASH_TAG: calibration.hash,
        CALIBRATION_PATH_TAG: path,
        "base_policy": policy.name,
    }
    description = (
        f"Candidate of {cell_id} in cycle {cycle}: policy {policy.name}, pretrained in the sim "
        f"calibrated from {cell_id}'s shifts (calibration {calibration.hash}, {path}); "
        f"no line data trained on."
    )
    experiment, model = params.train.experiment, params.train.registered_model
    run_id = candidate_run(workspace, experiment, cycle, cell_id, dataset_version, "calibrated")
    status = "FAILED"
    try:
        version = register_policy(
            run_id, Path(policy_folder), model, tags=tags | {CELL_TAG: cell_id}
        )
        status = "FINISHED"
    finally:
        end_candidate_run(workspace, run_id, tags, description, status)
    return {
        "cell_id": cell_id,
        "policy_folder": str(policy_folder),
        "mlflow_run_id": run_id,
        "registered_model": params.train.registered_model,
        "model_version": version,
        "policy_version": policy.name,
        "base_policy": policy.name,
        "dataset_version": dataset_version,
        "batches": 0,
        "examples": 0,
        "episodes_used": 0,
        "success_steps": 0,
        "correction_steps": 0,
        "final_train_loss": None,
        "final_val_loss": None,
    }


def _relative(path: Path, workspace: Path) -> str:
    """A path as the workspace names it (no absolute path of this machine in a record)."""
    try:
        return str(Path(path).resolve().relative_to(Path(workspace).resolve()))
    except ValueError:
        return str(path)
