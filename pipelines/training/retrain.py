"""The fine-tuning stage as both the loop flow and `dvc repro` run it.

Read the validated batches of a dataset version, fine-tune the base policy on them, and
leave a complete record in MLflow: params, per-epoch metrics, the dataset as a run input,
the learning curve, the batches used, and a registered model version (safetensors + config).
"""

from __future__ import annotations

from pathlib import Path

from pipelines.contract.params import Params
from pipelines.ingest import read_dataset
from pipelines.quality.triage.selection import novel_part_ids
from pipelines.training.cycle_runs import stage_run_name, start_cycle_run
from pipelines.training.finetune import TrainingSet, finetune, training_examples
from pipelines.training.onnx_export import save_policy_for_edge
from pipelines.training.ood import learned_footprints, part_footprints
from pipelines.training.policy import load_policy
from pipelines.training.registry import register_policy
from pipelines.training.tracking import (
    EpochLogger,
    log_edge_export,
    log_learning_curve,
    log_training_batches,
    start_finetune_run,
)

INPUT_EXAMPLE_ROWS = 5  # observations of the training set logged with the model


def fine_tune_and_register(
    params: Params,
    workspace: Path,
    base: Path,
    dataset_version: str,
    batches: list[str],
    cell_id: str | None = None,
    cycle: int | None = None,
    out: Path | None = None,
    stage: str = "finetune",
) -> dict:
    """Fine-tune `base` on `batches` and register the result. With `cell_id`, only that cell's
    batches are used, the policy is written to `<train.out>/<cell_id>` (cells train side by
    side) and the model version is tagged with the cell. With `cycle` (the loop's), the run
    ("finetune cell-07 cycle 3") is a child of the cell's cycle run ("cycle 3 cell-07").
    `out` and `stage` (the run's name): another candidate of the same cell and cycle (the
    loop's calibrated_finetune, flows/candidates.py) beside the finetune@<cell> stage's."""
    dataset = workspace / params.ingest.dataset
    if cell_id is not None:
        batches = cell_batches(dataset, batches, cell_id)
    if not batches:
        whose = f" from {cell_id}" if cell_id else ""
        raise ValueError(f"{dataset}: no validated batches{whose} to train on")
    train = params.train
    out = Path(out) if out is not None else workspace / train.out / (cell_id or "")
    data = training_set(params, dataset, batches)
    base_policy = load_policy(base)
    who = cell_id or "all cells"
    parent = None
    if cycle is not None and cell_id is not None:
        parent = start_cycle_run(workspace, train.experiment, cycle, cell_id, dataset_version)
    description = _description(base_policy.name, who, len(batches), dataset_version, data)
    with start_finetune_run(
        workspace,
        train.experiment,
        train,
        dataset_version=dataset_version,
        dataset_source=str(dataset),
        dataset_profile=_profile(data),
        run_name=stage_run_name(stage, who, cycle),
        cell_id=cell_id,
        parent_run_id=parent,
        description=description,
    ) as run:
        run_id = run.info.run_id
        log_training_batches(batches, base_policy.name)
        with EpochLogger(run_id) as on_epoch:
            net, history = finetune(
                base_policy.net, data, train, version=f"ft-{run_id[:8]}", on_epoch=on_epoch
            )
        log_learning_curve(history)
        folder, export = _save_for_edge(net, base_policy.net, data, params, out)
        log_edge_export(export)
        tags = {"dataset_version": dataset_version, "base_policy": base_policy.name}
        version = register_policy(
            run_id,
            folder,
            train.registered_model,
            tags=tags | ({"cell_id": cell_id} if cell_id else {}),
            input_example=data.observations[:INPUT_EXAMPLE_ROWS],
        )
    return {
        "cell_id": cell_id,
        "policy_folder": str(folder),
        "mlflow_run_id": run_id,
        "mlflow_cycle_run_id": parent,
        "registered_model": train.registered_model,
        "model_version": version,
        "policy_version": net.config.version,
        "base_policy": base_policy.name,
        "finetune_mode": train.mode,
        "dataset_version": dataset_version,
        "batches": len(batches),
        **_profile(data),
        "final_train_loss": history[-1].train_loss,
        "final_val_loss": history[-1].val_loss,
    }


def training_set(params: Params, dataset: Path, batches: list[str]) -> TrainingSet:
    """The batches' examples, novel-part episodes weighed up (triage.novel_part_weight). The
    part is judged from the logs alone, not the captures: the finetune stage's DVC inputs are
    the dataset, and the logs find 96-99% of those episodes (docs/triage.md)."""
    episodes, steps = read_dataset(dataset, sources=batches)
    novel = novel_part_ids(episodes, steps, None, params.triage)
    return training_examples(
        episodes, steps, params.train.intervention_weight, novel, params.triage.novel_part_weight
    )


def _save_for_edge(net, base, data: TrainingSet, params: Params, out: Path) -> tuple[Path, dict]:
    """The fine-tuned policy with its edge files, knowing its base's parts and the line's."""
    net.config.trained_on |= _footprints_learned(base, data, params)
    edge = params.edge
    return save_policy_for_edge(
        net, out, data.inputs(net.config), edge.ood_false_alarm, edge.footprint_tolerance_m
    )


def _footprints_learned(base, data: TrainingSet, params: Params) -> dict:
    """The part footprints the fine-tuned policy knows: its base's and the line parts it
    trained on (pipelines.training.ood.learned_footprints); {} for a base without a record."""
    known = part_footprints(base.config.trained_on)
    footprints = learned_footprints(
        known, data.part_footprints_m, params.edge.footprint_tolerance_m
    )
    return {"part_footprints_m": list(footprints)} if footprints else {}


def cell_batches(dataset: Path, batches: list[str], cell_id: str) -> list[str]:
    """The batches among `batches` that hold `cell_id`'s episodes (a batch is one log file,
    and a log is one cell's), read from the episodes files' cell_id column alone."""
    import pyarrow.parquet as pq

    mine = []
    for sha in batches:
        path = Path(dataset) / "episodes" / f"{sha}.parquet"
        cells = pq.read_table(path, columns=["cell_id"]).column("cell_id").unique().to_pylist()
        if cell_id in cells:
            mine.append(sha)
    return mine


def _description(policy: str, who: str, logs: int, dataset_version: str, data) -> str:
    """The fine-tune run's description (its MLflow note)."""
    return (
        f"Fine-tunes policy {policy} for {who} on {logs} validated logs of "
        f"dataset version {dataset_version}: {len(data)} examples, {data.success_steps} steps "
        f"of successful episodes and {data.correction_steps} operator corrections."
    )


def _profile(data: TrainingSet) -> dict:
    """What the training set holds, for the MLflow dataset input and the summary."""
    return {
        "examples": len(data),
        "episodes_used": data.episodes_used,
        "success_steps": data.success_steps,
        "correction_steps": data.correction_steps,
    }
