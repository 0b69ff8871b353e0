"""What a loop cycle leaves for DVC and git, so that the pipeline in dvc.yaml describes the
loop that ran: after it, `dvc status` finds its `finetune@<cell>` stages up to date, `dvc exp
show` compares cycles (one git commit each), `dvc metrics show` and `dvc plots show` read what
it measured. (Stages the loop does not run, such as calibrate, stay as their last run left them.)

Per cell, under `<train.cycles>/<cell>/`:

- training-set.json: the dataset version and validated batches the fine-tune read, pinned
  before training (as the base policy is pinned in models/cells/<cell>/base), so that the
  `finetune@<cell>` stage depends on exactly its input, not on the dataset folder, which
  grows while the cell runs its trials;
- train.json (DVC metrics) and learning_curve.csv (DVC plots: per-epoch losses, as MLflow
  logged them): written by the fine-tune itself, so `dvc repro` writes them too;

and `<train.cycles>/trials.json` (top-level DVC metrics), one entry per cell: its last gated
trials. At the end of a cycle, `Repo.commit` records each fine-tuned cell's stage in dvc.lock
from the files the loop wrote, exactly as `dvc repro` would have, and one git commit (tagged
`cycle-<n>`) holds dvc.lock and these files.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from pipelines.contract.params import Params

TRAINING_SET, TRAIN_METRICS = "training-set.json", "train.json"
LEARNING_CURVE, TRIALS_METRICS = "learning_curve.csv", "trials.json"
FINETUNE_STAGE = "finetune@{cell}"  # dvc.yaml: `finetune`, foreach over fleet.cells
CYCLE_TAG = "cycle-{cycle}"
# Committed with dvc.lock: the lock records their stages and values, and `dvc exp show` reads
# a commit's metrics through its dvc.yaml (an edit the cycle ran with is part of its record).
PIPELINE_FILES = ("dvc.yaml", "params.yaml")


def cell_folder(workspace: Path, params: Params, cell_id: str) -> Path:
    return Path(workspace) / params.train.cycles / cell_id


def pin_training_set(
    workspace: Path, params: Params, cell_id: str, dataset_version: str, batches: list[str]
) -> Path:
    """Write the fine-tune's input (what `realloop train --training-set` reads back)."""
    path = cell_folder(workspace, params, cell_id) / TRAINING_SET
    _write(path, json.dumps({"dataset_version": dataset_version, "batches": sorted(batches)}))
    return path


def read_training_set(path: Path) -> tuple[str, list[str]]:
    """(dataset version, batches) from a pinned training set."""
    try:
        pinned = json.loads(Path(path).read_text())
        return pinned["dataset_version"], list(pinned["batches"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: not a training set written by `realloop loop` ({exc}); "
            "run a loop cycle for the cell first"
        ) from None


def write_training_record(workspace: Path, params: Params, trained: dict) -> dict[str, str]:
    """train.json (final losses, what the training set held) and learning_curve.csv (per-epoch
    losses from the run's MLflow metric history) for the cell the candidate was trained for."""
    from pipelines.training.tracking import mlflow_client

    folder = cell_folder(workspace, params, trained["cell_id"])
    metrics = {
        key: trained[key]
        for key in (
            "final_train_loss",
            "final_val_loss",
            "examples",
            "episodes_used",
            "success_steps",
            "correction_steps",
            "batches",
        )
    }
    _write(folder / TRAIN_METRICS, json.dumps(metrics, indent=2))
    client = mlflow_client(Path(workspace))
    curves = {
        name: {m.step: m.value for m in client.get_metric_history(trained["mlflow_run_id"], name)}
        for name in ("train_loss", "val_loss")
    }
    train, val = curves["train_loss"], curves["val_loss"]
    rows = [["epoch", "train_loss", "val_loss"]]
    rows += [[epoch, train[epoch], val.get(epoch, "")] for epoch in sorted(train)]
    _write(folder / LEARNING_CURVE, "".join(",".join(map(str, row)) + "\n" for row in rows))
    return {"metrics": str(folder / TRAIN_METRICS), "plots": str(folder / LEARNING_CURVE)}


def fine_tune_cell(
    params: Params,
    workspace: Path,
    base: Path,
    dataset_version: str,
    batches: list[str],
    cell_id: str,
    cycle: int | None = None,
) -> dict:
    """The `finetune@<cell>` stage as the loop and `dvc repro` run it: pin the training set,
    fine-tune and register (pipelines.training; `cycle`: the loop's), write its metrics and
    learning curve."""
    from pipelines.training import fine_tune_and_register
    from pipelines.training.retrain import cell_batches

    batches = cell_batches(Path(workspace) / params.ingest.dataset, batches, cell_id)
    if batches:  # none: fine_tune_and_register says so, and the last pin stands
        pin_training_set(workspace, params, cell_id, dataset_version, batches)
    trained = fine_tune_and_register(
        params, workspace, base, dataset_version, batches, cell_id, cycle=cycle
    )
    write_training_record(workspace, params, trained)
    return trained


def trial_metrics(cell: dict, cycle: int) -> dict | None:
    """A cell's numbers for trials.json from its line of the cycle summary (None: no gate)."""
    if cell.get("gate") is None:
        return None
    trials = cell["trials"]
    metrics = {"cycle": cycle, "gate_passed": int(cell["gate"]["passed"])}
    metrics["promoted"] = int(cell["outcome"] == "promoted")
    trialled = (cell.get("prescreen") or {}).get("trialled") or {}
    if trialled.get("score") is not None:  # what the pre-screen expected of it (prescreen.py)
        metrics["prescreen_score"] = trialled["score"]
    for arm in ("candidate", "incumbent"):
        stats = trials[arm]
        metrics |= {
            f"{arm}_success_rate": stats["success_rate"],
            f"{arm}_success_lower": stats["interval"][0],
            f"{arm}_episodes": stats["n"],
        }
    return metrics


def record_cycle(workspace: Path, params: Params, summary: dict) -> dict:
    """trials.json updated with the cycle's gated cells; each fine-tuned cell's stage committed
    to dvc.lock; one git commit of dvc.lock and `<train.cycles>` tagged `cycle-<n>`.

    Does nothing to DVC or git in a workspace without dvc.yaml (nothing describes the loop
    there); a cell whose stage dvc.yaml lacks (not in fleet.cells) is reported, not committed.
    """
    from pipelines.ingest.versioning import _locked

    workspace = Path(workspace).resolve()
    folder = workspace / params.train.cycles
    trials_path = folder / TRIALS_METRICS
    recorded = json.loads(trials_path.read_text()) if trials_path.is_file() else {}
    for cell in summary["cells"]:
        if (metrics := trial_metrics(cell, summary["cycle"])) is not None:
            recorded[cell["cell"]] = metrics
    if recorded:
        _write(trials_path, json.dumps(recorded, indent=2, sort_keys=True))
    if not (workspace / "dvc.yaml").is_file():
        return {"commit": None, "stages": [], "reason": "no dvc.yaml in the workspace"}
    trained = [c["cell"] for c in summary["cells"] if _stage_ran(c)]
    with _locked(workspace):
        stages, missing = _commit_stages(workspace, trained)
        commit = _git_commit(workspace, params, summary["cycle"], stages)
    return {"commit": commit, "stages": stages, "not_in_dvc_yaml": missing}


def _stage_ran(cell: dict) -> bool:
    """Whether the cell's finetune@<cell> stage ran this cycle: the incumbent_finetune
    candidate was built (flows/candidates.py), or, in a summary from before candidates, the
    cell was fine-tuned."""
    prescreen = cell.get("prescreen")
    if prescreen is None:
        return bool(cell.get("training"))
    built = [c["name"] for c in prescreen["candidates"] if not c.get("error")]
    return "incumbent_finetune" in built


def _commit_stages(workspace: Path, cells: list[str]) -> tuple[list[str], list[str]]:
    """`dvc commit -f finetune@<cell>` for each cell: dvc.lock records the stage's deps and
    outs as the loop left them."""
    from dvc.exceptions import NoOutputOrStageError
    from dvc.stage.exceptions import StageNotFound

    from pipelines.ingest.dvc_repo import _dvc_repo

    committed, missing = [], []
    # In the workspace, as DVC's own CLI runs: its run cache resolves stage paths against the
    # cwd (the loop runs there anyway; this matters to a caller elsewhere, such as a test).
    with contextlib.chdir(workspace), _dvc_repo(workspace) as repo:
        for cell in cells:
            stage = FINETUNE_STAGE.format(cell=cell)
            try:
                repo.commit(stage, force=True)
            except (NoOutputOrStageError, StageNotFound):
                missing.append(stage)
                continue
            committed.append(stage)
    return committed, missing


def _git_commit(workspace: Path, params: Params, cycle: int, stages: list[str]) -> str | None:
    """Commit dvc.lock, dvc.yaml, params.yaml and the cycle's files (only those: a pathspec
    commit, whatever else is staged), tag it."""
    from pipelines.ingest.git_tags import _git, _identity

    paths = [
        p for p in ("dvc.lock", params.train.cycles, *PIPELINE_FILES) if (workspace / p).exists()
    ]
    _git(workspace, "add", "-f", "--", *paths)
    if not _git(workspace, "status", "--porcelain", "--", *paths).strip():
        return None  # nothing new since the last commit
    message = f"cycle {cycle}: {', '.join(stages) or 'no stage'} recorded\n"
    identity = _identity(workspace)
    _git(workspace, *identity, "commit", "-q", "--no-verify", "-m", message, "--", *paths)
    commit = _git(workspace, "rev-parse", "HEAD").strip()
    tag = CYCLE_TAG.format(cycle=cycle)
    if not _git(workspace, "rev-parse", "-q", "--verify", f"refs/tags/{tag}", check=False).strip():
        _git(workspace, "tag", tag, commit)
    return commit


def _write(path: Path, text: str) -> None:
    """Atomically: a crash leaves the old file or the new one, never half of one."""
    from pipelines.ingest.versioning import _write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, text if text.endswith("\n") else text + "\n")
