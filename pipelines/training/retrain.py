"""The fine-tuning stage as both the loop flow and `dvc repro` run it.

Read the validated batches of a dataset version, fine-tune the base policy on them, and
leave a complete record in MLflow: params, per-epoch metrics, the dataset as a run input,
the learning curve, the batches used, and a registered model version (safetensors + config).
"""

from __future__ import annotations

from pathlib import Path

from pipelines.contract.params import Params
from pipelines.ingest import read_dataset
from pipelines.training.finetune import TrainingSet, finetune, training_examples
from pipelines.training.policy import load_policy, save_policy
from pipelines.training.registry import register_policy
from pipelines.training.tracking import (
    EpochLogger,
    log_learning_curve,
    log_training_batches,
    start_finetune_run,
)


def fine_tune_and_register(
    params: Params, workspace: Path, base: Path, dataset_version: str, batches: list[str]
) -> dict:
    if not batches:
        raise ValueError(f"{workspace / params.ingest.dataset}: no validated batches to train on")
    train = params.train
    episodes, steps = read_dataset(workspace / params.ingest.dataset, sources=batches)
    data = training_examples(episodes, steps, train.intervention_weight)
    base_policy = load_policy(base)
    with start_finetune_run(
        workspace,
        train.experiment,
        train,
        dataset_version=dataset_version,
        dataset_source=str(workspace / params.ingest.dataset),
        dataset_profile=_profile(data),
    ) as run:
        run_id = run.info.run_id
        log_training_batches(batches, base_policy.name)
        with EpochLogger(run_id) as on_epoch:
            net, history = finetune(
                base_policy.net, data, train, version=f"ft-{run_id[:8]}", on_epoch=on_epoch
            )
        log_learning_curve(history)
        folder = save_policy(net, workspace / train.out)
        version = register_policy(
            run_id,
            folder,
            train.registered_model,
            tags={"dataset_version": dataset_version, "base_policy": base_policy.name},
        )
    return {
        "mlflow_run_id": run_id,
        "registered_model": train.registered_model,
        "model_version": version,
        "policy_version": net.config.version,
        "base_policy": base_policy.name,
        "dataset_version": dataset_version,
        "batches": len(batches),
        **_profile(data),
        "final_train_loss": history[-1].train_loss,
        "final_val_loss": history[-1].val_loss,
    }


def _profile(data: TrainingSet) -> dict:
    """What the training set holds, for the MLflow dataset input and the summary."""
    return {
        "examples": len(data),
        "episodes_used": data.episodes_used,
        "success_steps": data.success_steps,
        "correction_steps": data.correction_steps,
    }
