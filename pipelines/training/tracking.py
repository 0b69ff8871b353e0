"""MLflow tracking: where the store is, and the fine-tuning and calibration runs logged to it.

Where: MLFLOW_TRACKING_URI when set (a server, any store), else a SQLite file in the workspace,
`<workspace>/mlflow.db`, with artifacts beside it in `<workspace>/mlartifacts`. The workspace
is the one `use_workspace` (or `start_finetune_run`) named last, else the current directory;
every function also takes `workspace=` to say it explicitly. Each call talks to the store
through an MlflowClient bound to `tracking_uri(workspace)`. Nothing here calls
`mlflow.set_tracking_uri`: it also exports MLFLOW_TRACKING_URI to the process environment,
which would pin every later workspace (and every child process) to the first one. (Logging
an MLflow model needs it: `mlflow_context.in_process_store` sets it for that block only.)

What: a fine-tuning run is named for what it is ("finetune cell-07 cycle 3"), says so in its
description (`mlflow.note.content`), records the code (git commit, branch, dirty) and the user,
logs the hyperparameters of params.yaml's `train` section as params (nothing else), the dataset
version (run tags plus an MLflow dataset input), per-epoch losses in batches, system metrics
(CPU, memory, disk, network; GPU where there is one) and a learning-curve plot. Inside the loop
it is the child of the cell's cycle run (`pipelines.training.cycle_runs`). Experiments are
marked for model training (`mlflow.experimentKind`), so MLflow opens them on their runs. The
policies a run produces go to the model registry: `pipelines.training.registry`. Every name
is listed in docs/tracking.md.

mlflow is imported on first use, not with this module: it takes seconds, and `realloop --help`
should not wait for it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.data.dataset_source import DatasetSource
    from mlflow.entities import Run

    from pipelines.contract.params import TrainParams
    from pipelines.training.train import EpochMetrics

DB_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
DATASET_NAME = "line-dataset"
DATASET_CONTEXT = "training"
TRAINING_BATCHES_ARTIFACT = "training_batches.json"
LEARNING_CURVE_ARTIFACT = "learning_curve.png"
METRIC_NAMES = ("train_loss", "val_loss", "epoch")
# Of params.yaml's `train` section, what changes the model: the run's params (`train.<name>`).
# Where files go and what things are called (out, experiment, registered_model) are not.
HYPERPARAMETERS = (
    "seed",
    "epochs",
    "batch_size",
    "learning_rate",
    "val_fraction",
    "intervention_weight",
    "mode",  # train.mode and its knobs: how far fine-tuning may move the base
    "anchor_weight",
    "distill_weight",
    "residual_hidden",
)
# MLflow 3 opens an experiment by its kind; without the tag a new one may open on GenAI pages.
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
CELL_TAG = "cell_id"
STAGE_TAG = "realloop.stage"  # finetune, cycle, trials, gate; calibrate
# Tags on a run (and, copied by the registry, on its model versions) that answer lineage
# questions.
DATASET_VERSION_TAG = "dataset_version"
DVC_HASH_TAG = "dvc.dataset_hash"
BASE_POLICY_TAG = "base_policy"
# The SQL stores keep at most 36 characters of a dataset digest (a DVC md5 with ".dir" fits).
_MAX_DIGEST = 36

_workspace_in_use: Path | None = None
_active_run_id: ContextVar[str | None] = ContextVar("realloop_active_run_id", default=None)


def use_workspace(workspace: Path) -> str:
    """Make `workspace` the default store of every tracking and registry function; return its
    tracking URI."""
    global _workspace_in_use
    _workspace_in_use = _workspace(workspace)
    return tracking_uri(_workspace_in_use)


def current_workspace(workspace: Path | None = None) -> Path:
    """The explicit workspace, else the one in use, else the current directory."""
    if workspace is not None:
        return Path(workspace)
    return _workspace_in_use or Path.cwd()


def tracking_uri(workspace: Path) -> str:
    """MLFLOW_TRACKING_URI when set, else `sqlite:///<workspace>/mlflow.db`.

    The workspace's own store is re-rooted here first when the workspace was moved or copied
    since it was written: MLflow keeps only absolute artifact URIs (`store_root` says why)."""
    if configured := os.environ.get("MLFLOW_TRACKING_URI"):
        return configured
    from pipelines.training.store_root import reroot_store

    root = _workspace(workspace)
    reroot_store(root / DB_FILE, root / ARTIFACTS_DIR)
    return f"sqlite:///{root / DB_FILE}"


def artifact_location(workspace: Path) -> str | None:
    """Where a new experiment keeps artifacts: beside the workspace's SQLite file, or wherever
    the configured server decides (None)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return str(_workspace(workspace) / ARTIFACTS_DIR)


@contextmanager
def start_finetune_run(
    workspace: Path,
    experiment: str,
    params: TrainParams,
    dataset_version: str,
    dataset_source: str,
    dataset_profile: Mapping[str, Any],
    run_name: str | None = None,
    *,
    cell_id: str | None = None,
    parent_run_id: str | None = None,
    description: str | None = None,
) -> Iterator[Run]:
    """Open a run in `experiment` that records what it trains on, and yield it (an MLflow Run:
    `run.info.run_id`). Inside the block it is the active run of EpochLogger,
    log_learning_curve and log_training_batches, and `workspace` is the workspace in use.
    The run ends FINISHED, or FAILED (KILLED on Ctrl-C) when the block raises.

    Params are the `train` section's HYPERPARAMETERS under params.yaml's dotted keys
    ("train.epochs"). Tags: `cell_id`, `realloop.stage` "finetune", `mlflow.parentRunId` (the
    cycle run, when given), the description and the code and user (`run_context_tags`).
    System metrics are sampled while the block runs.
    `dataset_version` (the DVC hash of the dataset) goes into the run tags `dataset_version`
    and `dvc.dataset_hash`, and into an MLflow dataset input named "line-dataset" (context
    "training") whose digest is that version, whose source is `dataset_source` (a path,
    relative to the workspace, or a file://, s3://, https:// URI) and whose profile is
    `dataset_profile` (summary numbers: episodes, steps, interventions, ...).
    """
    quiet_mlflow()
    from mlflow.entities import DatasetInput, InputTag, Param

    from pipelines.training.mlflow_context import run_context_tags, system_metrics

    if not dataset_version:
        raise ValueError("dataset_version: empty; a run must name the dataset version it uses")
    dataset = _line_dataset(workspace, dataset_version, dataset_source, dataset_profile)
    use_workspace(workspace)
    client = mlflow_client(workspace)
    experiment_id = ensure_experiment(client, workspace, experiment)
    tags = {
        DATASET_VERSION_TAG: dataset_version,
        DVC_HASH_TAG: dataset_version,
        STAGE_TAG: "finetune",
        **({CELL_TAG: cell_id} if cell_id else {}),
        **run_context_tags(description, parent_run_id),
    }
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    run_id = run.info.run_id
    status = "FAILED"
    active = _active_run_id.set(run_id)
    monitor = system_metrics(run_id, tracking_uri(workspace))
    try:
        params_flat = flatten({"train": hyperparameters(params)})
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params_flat.items()])
        dataset_tags = [
            InputTag("mlflow.data.context", DATASET_CONTEXT),
            InputTag(DATASET_VERSION_TAG, dataset_version),
        ]
        client.log_inputs(run_id, datasets=[DatasetInput(dataset, dataset_tags)])
        yield run
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        _active_run_id.reset(active)
        if monitor is not None:
            monitor.finish()
        client.set_terminated(run_id, status)


def hyperparameters(params: TrainParams) -> dict[str, Any]:
    every = dataclasses.asdict(params)
    return {name: every[name] for name in HYPERPARAMETERS}


class EpochLogger:
    """Per-epoch train_loss, val_loss and epoch, sent with one log_batch per `flush_every`
    epochs rather than a request per metric. Use it as `fit(..., on_epoch=logger)` inside
    `with EpochLogger(run_id) as logger:`, or call `flush()` at the end yourself. Without a
    run id it logs to the active run of `start_finetune_run`."""

    def __init__(
        self,
        run_id: str | None = None,
        flush_every: int = 10,
        *,
        workspace: Path | None = None,
    ) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every: {flush_every}; must be at least 1")
        self.run_id = _run_id(run_id)
        self.flush_every = flush_every
        self.flushes = 0  # log_batch calls made, for anyone checking the batching
        self.mlflow_client = mlflow_client(workspace)
        self._pending: list[Any] = []
        self._epochs_pending = 0

    def log(self, metrics: EpochMetrics) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        self._pending += [
            Metric(name, float(getattr(metrics, name)), timestamp, metrics.epoch)
            for name in METRIC_NAMES
        ]
        self._epochs_pending += 1
        if self._epochs_pending >= self.flush_every:
            self.flush()

    __call__ = log

    def flush(self) -> None:
        if not self._pending:
            return
        self.mlflow_client.log_batch(self.run_id, metrics=self._pending)
        self.flushes += 1
        self._pending, self._epochs_pending = [], 0

    def __enter__(self) -> EpochLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.flush()  # the epochs that ran are worth keeping, even when training failed


def log_calibration_run(
    workspace: Path,
    experiment: str,
    calibration: Mapping[str, Any],
    dataset_version: str,
    dataset_source: str,
    dataset_profile: Mapping[str, Any],
    artifacts: list[Path],
) -> str:
    """Record a real-to-sim calibration as its own run; return the run id.

    Each estimate is a metric under its world-file key (`physics.friction`), its standard
    error under `std.<key>`; the dataset version is tagged and attached as the run's input
    (context "calibration"), as a fine-tuning run does; `artifacts` (sim-calibration.yaml,
    plots, the full JSON) are uploaded as they are.
    """
    quiet_mlflow()
    from mlflow.entities import DatasetInput, InputTag, Metric, Param

    from pipelines.training.mlflow_context import run_context_tags

    dataset = _line_dataset(workspace, dataset_version, dataset_source, dataset_profile)
    use_workspace(workspace)
    client = mlflow_client(workspace)
    about = f"Real-to-sim calibration on the logs of dataset version {dataset_version}."
    run = client.create_run(
        ensure_experiment(client, workspace, experiment),
        run_name=f"calibrate-{dataset_version[:12]}",
        tags={
            DATASET_VERSION_TAG: dataset_version,
            DVC_HASH_TAG: dataset_version,
            STAGE_TAG: "calibrate",
            **run_context_tags(about),
        },
    )
    run_id, status = run.info.run_id, "FAILED"
    try:
        now = int(time.time() * 1000)
        numbers = {
            **_numeric(flatten(calibration["world"], keep_lists=False)),
            **{f"std.{k}": v for k, v in _numeric(flatten(calibration["uncertainty"])).items()},
        }
        fit = calibration.get("fit", {})
        params = {
            "episodes": fit.get("episodes"),
            "steps": fit.get("steps"),
            **{f"identified.{k}": v for k, v in calibration.get("identified", {}).items()},
        }
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, now, 0) for k, v in numbers.items()],
            params=[Param(k, str(v)) for k, v in params.items()],
        )
        tags = [
            InputTag("mlflow.data.context", "calibration"),
            InputTag(DATASET_VERSION_TAG, dataset_version),
        ]
        client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags)])
        for path in artifacts:
            client.log_artifact(run_id, str(path))
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status)
    return run_id


def _numeric(flat: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in flat.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def log_learning_curve(
    history: list[EpochMetrics], run_id: str | None = None, *, workspace: Path | None = None
) -> None:
    """Plot train and val loss per epoch into the run's artifact `learning_curve.png`
    (the active run's unless `run_id` is given)."""
    from matplotlib.figure import Figure  # renders with Agg; no pyplot, no global backend

    if not history:
        raise ValueError("learning curve: no epochs to plot")
    epochs = [m.epoch for m in history]
    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.subplots()
    axes.plot(epochs, [m.train_loss for m in history], label="train_loss")
    axes.plot(epochs, [m.val_loss for m in history], label="val_loss")
    losses = [v for m in history for v in (m.train_loss, m.val_loss) if math.isfinite(v)]
    if losses and min(losses) > 0:
        axes.set_yscale("log")
    axes.set(xlabel="epoch", ylabel="weighted MSE", title="fine-tuning learning curve")
    axes.legend()
    axes.grid(alpha=0.3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / LEARNING_CURVE_ARTIFACT
        figure.savefig(path, dpi=100)
        mlflow_client(workspace).log_artifact(_run_id(run_id), str(path))


def log_training_batches(
    batches: list[str],
    base_policy: str,
    run_id: str | None = None,
    *,
    workspace: Path | None = None,
) -> None:
    """Record which ingested batches (source-file sha256s) the run trains on and the policy
    it starts from: artifact `training_batches.json` and tag `base_policy`."""
    client = mlflow_client(workspace)
    run_id = _run_id(run_id)
    client.set_tag(run_id, BASE_POLICY_TAG, base_policy)
    record = {"base_policy": base_policy, "batches": sorted(batches)}
    client.log_dict(run_id, record, TRAINING_BATCHES_ARTIFACT)


def run_json(client: MlflowClient, run_id: str, artifact: str) -> Any:
    """A small JSON artifact of a run, or None when the run has none."""
    names = {a.path for a in client.list_artifacts(run_id)}
    if artifact not in names:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(run_id, artifact, tmp)).read_text())


def logged_training_batches(workspace: Path, experiment: str, run_name: str) -> list[str] | None:
    """The batches that the newest run called `run_name` in `experiment` trained on (what
    log_training_batches recorded), or None when there is no such run or record. A workspace
    without its store is answered without creating one."""
    uri = tracking_uri(workspace)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return None
    client = mlflow_client(workspace)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs(
        [found.experiment_id],
        filter_string=f"attributes.run_name = '{run_name}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    record = run_json(client, runs[0].info.run_id, TRAINING_BATCHES_ARTIFACT) if runs else None
    return None if record is None else list(record["batches"])


def log_edge_export(
    record: Mapping[str, Any], run_id: str | None = None, *, workspace: Path | None = None
) -> None:
    """The ONNX export's parity check and OOD threshold (pipelines.training.onnx_export):
    metrics `onnx_parity_max_abs_diff` and `ood_threshold`, params for the rest."""
    client = mlflow_client(workspace)
    run_id = _run_id(run_id)
    client.log_metric(run_id, "onnx_parity_max_abs_diff", float(record["parity_max_abs_diff"]))
    client.log_metric(run_id, "ood_threshold", float(record["ood_threshold"]))
    for key in ("parity_observations", "parity_tolerance", "ood_false_alarm", "onnx_opset"):
        name = key if key.startswith(("onnx_", "ood_")) else f"onnx_{key}"
        client.log_param(run_id, name, record[key])


# --- internals (the registry shares mlflow_client, quiet_mlflow, flatten and jsonable) ---


@functools.cache
def quiet_mlflow() -> None:
    """Import mlflow so that a normal run prints nothing of its own."""
    # No usage telemetry: the cells' network has no internet, and nothing here should phone out.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # tqdm bars on every artifact download, even for two small files into a pipe.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # Against a tracking server, ending a run writes "View run ... at: <url>" to stdout, which
    # broke `realloop loop --json` (found by tests/faults); the flow's artifacts link the runs.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # mlflow's SQL store builds its mappers with a loader SQLAlchemy 2 deprecates; not ours to fix.
    warnings.filterwarnings(
        "ignore",
        message=r"The ``noload`` loader strategy is deprecated",
        module=r"mlflow\.store\.",
    )
    # Logging a DataFrame input example compares its columns with a range, which pandas 3
    # deprecates; inside mlflow, not ours to fix either.
    warnings.filterwarnings(
        "ignore", message=r"Operation with range is deprecated", module=r"mlflow\.models\."
    )
    import mlflow  # noqa: F401  (configures mlflow's loggers)

    # "Creating initial MLflow database tables..." / "Updating database tables" (INFO) on the
    # first use of a SQLite file; alembic's own migration logs are already at WARNING.
    # The system-metrics sampler says when it starts and stops, and model logging that it
    # checks the input example, at INFO on every run.
    quiet = ("mlflow.store.db.utils", "mlflow.system_metrics", "mlflow.pyfunc", "mlflow.models")
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)


def mlflow_client(workspace: Path | None) -> MlflowClient:
    quiet_mlflow()
    from mlflow import MlflowClient

    uri = tracking_uri(current_workspace(workspace))
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _run_id(run_id: str | None) -> str:
    run_id = run_id or _active_run_id.get()
    if not run_id:
        raise RuntimeError("no MLflow run: pass run_id, or call inside start_finetune_run")
    return run_id


def _workspace(workspace: Path) -> Path:
    return Path(workspace).resolve()


def ensure_experiment(client: MlflowClient, workspace: Path, name: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = artifact_location(workspace)
        if location is not None:
            Path(location).mkdir(parents=True, exist_ok=True)
        try:
            return client.create_experiment(
                name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING}
            )
        except MlflowException as exc:  # another process created it first
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
    if experiment.lifecycle_stage != "active":
        raise ValueError(
            f"MLflow experiment {name!r} is deleted; restore it (mlflow experiments restore) "
            "or set train.experiment to another name"
        )
    if EXPERIMENT_KIND_TAG not in experiment.tags:  # made before realloop marked its experiments
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return experiment.experiment_id


def _line_dataset(workspace: Path, version: str, source: str, profile: Mapping[str, Any]) -> Any:
    """The MLflow dataset entity for a dataset version: metadata only, the data stays in DVC."""
    from mlflow.data.meta_dataset import MetaDataset

    class LineDataset(MetaDataset):
        @property
        def profile(self) -> dict[str, Any]:
            return jsonable(dict(profile))

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self.profile)}

    digest = version[:_MAX_DIGEST]  # the full version is in the input's dataset_version tag
    dataset = LineDataset(_dataset_source(workspace, source), name=DATASET_NAME, digest=digest)
    return dataset._to_mlflow_entity()


def _dataset_source(workspace: Path, source: str) -> DatasetSource:
    from mlflow.data.dataset_source_registry import (
        get_dataset_source_from_json,
        resolve_dataset_source,
    )
    from mlflow.exceptions import MlflowException

    scheme = urlparse(source).scheme
    if not scheme or len(scheme) == 1 or scheme == "file":  # a path (one letter: a drive)
        # Two registered sources claim local paths, and resolving one warns about it; the
        # local source class is generated at import, so build it by its type name instead.
        uri = source if scheme == "file" else str(_workspace(workspace) / source)
        return get_dataset_source_from_json(json.dumps({"uri": uri}), source_type="local")
    try:
        return resolve_dataset_source(source)
    except MlflowException:
        raise ValueError(
            f"dataset source {source!r}: MLflow cannot record this kind of location; "
            "use a path or a file://, s3://, gs:// or https:// URI"
        ) from None


def flatten(tree: Mapping[str, Any], prefix: str = "", keep_lists: bool = True) -> dict:
    """{"a": {"b": 1, "c": [1, 2]}} → {"a.b": 1, "a.c": "[1, 2]"} (no "a.c" without lists)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, path + ".", keep_lists))
        elif isinstance(value, list | tuple):
            if keep_lists:
                flat[path] = json.dumps(jsonable(list(value)))
        else:
            flat[path] = value
    return flat


def jsonable(value: Any) -> Any:
    """Plain JSON types: tuples become lists, numpy scalars become numbers, NaN stays NaN."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return value.item()
    return value
