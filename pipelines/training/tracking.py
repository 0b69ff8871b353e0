"""MLflow tracking and registry for fine-tuning runs and the policies they produce.

Where: MLFLOW_TRACKING_URI when set (a server, any store), else a SQLite file in the workspace,
`<workspace>/mlflow.db`, with artifacts beside it in `<workspace>/mlartifacts`. The workspace
is the one `use_workspace` (or `start_finetune_run`) named last, else the current directory;
every function also takes `workspace=` to say it explicitly. Each call talks to the store
through an MlflowClient bound to `tracking_uri(workspace)`. Nothing here calls
`mlflow.set_tracking_uri`: it also exports MLFLOW_TRACKING_URI to the process environment,
which would pin every later workspace (and every child process) to the first one.

What: a run logs the params.yaml `train` section, the dataset version (run tags plus an MLflow
dataset input), per-epoch losses in batches and a learning-curve plot. A policy is registered
as its two files (safetensors weights, JSON config) uploaded as run artifacts; the model
version's source is that artifact folder. No `log_model` flavour: they pickle, and a model
file here is never unpickled.

mlflow is imported on first use, not with this module: it takes seconds, and `realloop --help`
should not wait for it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
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
POLICY_ARTIFACT_DIR = "policy"
GATE_ARTIFACT = "gate.json"
TRAINING_BATCHES_ARTIFACT = "training_batches.json"
LEARNING_CURVE_ARTIFACT = "learning_curve.png"
METRIC_NAMES = ("train_loss", "val_loss", "epoch")
# Tags the registry keeps on a model version, so a version answers lineage questions alone.
POLICY_SHA256_TAG = "policy.sha256"
DATASET_VERSION_TAG = "dataset_version"
DVC_HASH_TAG = "dvc.dataset_hash"
BASE_POLICY_TAG = "base_policy"
# The SQL stores keep at most 36 characters of a dataset digest (a DVC md5 with ".dir" fits).
_MAX_DIGEST = 36

_workspace_in_use: Path | None = None
_active_run_id: ContextVar[str | None] = ContextVar("realloop_active_run_id", default=None)


def use_workspace(workspace: Path) -> str:
    """Make `workspace` the default store of every function here; return its tracking URI."""
    global _workspace_in_use
    _workspace_in_use = _workspace(workspace)
    return tracking_uri(_workspace_in_use)


def current_workspace(workspace: Path | None = None) -> Path:
    """The explicit workspace, else the one in use, else the current directory."""
    if workspace is not None:
        return Path(workspace)
    return _workspace_in_use or Path.cwd()


def tracking_uri(workspace: Path) -> str:
    """MLFLOW_TRACKING_URI when set, else `sqlite:///<workspace>/mlflow.db`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{_workspace(workspace) / DB_FILE}"


def artifact_location(workspace: Path) -> str | None:
    """Where a new experiment keeps artifacts: beside the workspace's SQLite file, or wherever
    the configured server decides (None)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return str(_workspace(workspace) / ARTIFACTS_DIR)


@dataclass(frozen=True)
class ModelVersionInfo:
    registered_model: str
    version: str
    run_id: str | None
    source: str
    tags: dict[str, str]
    aliases: list[str]


@contextmanager
def start_finetune_run(
    workspace: Path,
    experiment: str,
    params: TrainParams,
    dataset_version: str,
    dataset_source: str,
    dataset_profile: Mapping[str, Any],
    run_name: str | None = None,
) -> Iterator[Run]:
    """Open a run in `experiment` that records what it trains on, and yield it (an MLflow Run:
    `run.info.run_id`). Inside the block it is the active run of EpochLogger,
    log_learning_curve and log_training_batches, and `workspace` is the workspace in use.
    The run ends FINISHED, or FAILED (KILLED on Ctrl-C) when the block raises.

    Params are the `train` section, flattened to params.yaml's dotted keys ("train.epochs").
    `dataset_version` (the DVC hash of the dataset) goes into the run tags `dataset_version`
    and `dvc.dataset_hash`, and into an MLflow dataset input named "line-dataset" (context
    "training") whose digest is that version, whose source is `dataset_source` (a path,
    relative to the workspace, or a file://, s3://, https:// URI) and whose profile is
    `dataset_profile` (summary numbers: episodes, steps, interventions, ...).
    """
    _quiet_mlflow()
    from mlflow.entities import DatasetInput, InputTag, Param

    if not dataset_version:
        raise ValueError("dataset_version: empty; a run must name the dataset version it uses")
    dataset = _line_dataset(workspace, dataset_version, dataset_source, dataset_profile)
    use_workspace(workspace)
    client = _client(workspace)
    experiment_id = _experiment_id(client, workspace, experiment)
    run = client.create_run(
        experiment_id,
        run_name=run_name,
        tags={DATASET_VERSION_TAG: dataset_version, DVC_HASH_TAG: dataset_version},
    )
    run_id = run.info.run_id
    status = "FAILED"
    active = _active_run_id.set(run_id)
    try:
        params_flat = _flatten({"train": dataclasses.asdict(params)})
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
        client.set_terminated(run_id, status)


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
        self._client = _client(workspace)
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
        self._client.log_batch(self.run_id, metrics=self._pending)
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
    _quiet_mlflow()
    from mlflow.entities import DatasetInput, InputTag, Metric, Param

    dataset = _line_dataset(workspace, dataset_version, dataset_source, dataset_profile)
    use_workspace(workspace)
    client = _client(workspace)
    run = client.create_run(
        _experiment_id(client, workspace, experiment),
        run_name=f"calibrate-{dataset_version[:12]}",
        tags={DATASET_VERSION_TAG: dataset_version, DVC_HASH_TAG: dataset_version},
    )
    run_id, status = run.info.run_id, "FAILED"
    try:
        now = int(time.time() * 1000)
        numbers = {
            **_numeric(_flatten(calibration["world"], keep_lists=False)),
            **{f"std.{k}": v for k, v in _numeric(_flatten(calibration["uncertainty"])).items()},
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
        _client(workspace).log_artifact(_run_id(run_id), str(path))


def log_training_batches(
    batches: list[str],
    base_policy: str,
    run_id: str | None = None,
    *,
    workspace: Path | None = None,
) -> None:
    """Record which ingested batches (source-file sha256s) the run trains on and the policy
    it starts from: artifact `training_batches.json` and tag `base_policy`."""
    client = _client(workspace)
    run_id = _run_id(run_id)
    client.set_tag(run_id, BASE_POLICY_TAG, base_policy)
    record = {"base_policy": base_policy, "batches": sorted(batches)}
    client.log_dict(run_id, record, TRAINING_BATCHES_ARTIFACT)


def register_policy(
    run_id: str,
    policy_folder: Path,
    registered_model: str,
    tags: Mapping[str, Any] | None = None,
    *,
    workspace: Path | None = None,
) -> str:
    """Upload the policy's weights and config to the run's `policy/` artifacts and register
    that folder as a new version of `registered_model`; return the version.

    The version is tagged with the weights' sha256 and the run's dataset version. Registering
    the same weights from the same run again returns the existing version, so a re-run after a
    crash does not make duplicates. Other weights from a run that already registered a policy
    are refused: they would overwrite that version's files.
    """
    _quiet_mlflow()
    from mlflow.exceptions import MlflowException

    from pipelines.training.policy import CONFIG_FILE, WEIGHTS_FILE, load_policy

    policy_folder = Path(policy_folder)
    load_policy(policy_folder)  # refuse to register anything that would not load on the cell
    weights_sha256 = _sha256(policy_folder / WEIGHTS_FILE)
    client = _client(workspace)
    run = client.get_run(run_id)
    existing = _registered_from_run(client, registered_model, run_id, weights_sha256)
    if existing is not None:
        return existing
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        client.log_artifact(run_id, str(policy_folder / name), POLICY_ARTIFACT_DIR)
    try:
        client.create_registered_model(registered_model)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version_tags = {
        **{key: str(value) for key, value in (tags or {}).items()},
        POLICY_SHA256_TAG: weights_sha256,
        DATASET_VERSION_TAG: run.data.tags.get(DATASET_VERSION_TAG, ""),
    }
    # The artifact folder itself, not runs:/..., as MLflow's own docs resolve it: a server's
    # source validation accepts it because it lies inside this run's artifact root.
    source = f"{run.info.artifact_uri.rstrip('/')}/{POLICY_ARTIFACT_DIR}"
    version = client.create_model_version(
        registered_model, source, run_id=run_id, tags=version_tags
    )
    return str(version.version)


def record_gate(
    registered_model: str,
    version: str,
    gate_record: Mapping[str, Any],
    run_id: str,
    *,
    workspace: Path | None = None,
) -> None:
    """Keep the gate's verdict on the model version (tags: gate.passed, gate.reasons and the
    numbers behind them) and the whole record as `gate.json` on the run."""
    client = _client(workspace)
    for key, value in gate_tags(gate_record).items():
        client.set_model_version_tag(registered_model, str(version), key, value)
    client.log_dict(run_id, _jsonable(dict(gate_record)), GATE_ARTIFACT)


def gate_tags(gate_record: Mapping[str, Any]) -> dict[str, str]:
    """gate.passed ("true"/"false"), gate.reasons ("; "-joined) and every scalar in the
    record under its dotted path, e.g. gate.candidate.success_rate. Lists (trial source
    hashes, intervals) stay in gate.json."""
    tags = {
        "gate.passed": "true" if gate_record.get("passed") is True else "false",
        "gate.reasons": "; ".join(str(r) for r in gate_record.get("reasons", [])),
    }
    rest = {k: v for k, v in gate_record.items() if k not in ("passed", "reasons")}
    for key, value in _flatten({"gate": rest}, keep_lists=False).items():
        tags[key] = str(value)
    return tags


def set_production_alias(
    registered_model: str, alias: str, version: str, *, workspace: Path | None = None
) -> None:
    _client(workspace).set_registered_model_alias(registered_model, alias, str(version))


def production_version(
    registered_model: str, alias: str, *, workspace: Path | None = None
) -> ModelVersionInfo | None:
    """The version `alias` names, or None when the model or the alias does not exist yet."""
    _quiet_mlflow()
    from mlflow.exceptions import MlflowException

    client = _client(workspace)
    try:
        model = client.get_registered_model(registered_model)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    # An unknown alias is INVALID_PARAMETER_VALUE in get_model_version_by_alias, the same code
    # as a malformed one, so look it up in the model's alias table instead.
    version = model.aliases.get(alias)
    if version is None:
        return None
    return model_version_info(registered_model, version, workspace=workspace)


def model_version_info(
    registered_model: str, version: str, *, workspace: Path | None = None
) -> ModelVersionInfo:
    mv = _client(workspace).get_model_version(registered_model, str(version))
    return ModelVersionInfo(
        registered_model=registered_model,
        version=str(mv.version),  # an int from the SQL store, a str over REST
        run_id=mv.run_id or None,
        source=mv.source,
        tags=dict(mv.tags),
        aliases=list(mv.aliases),
    )


def download_policy(
    registered_model: str, version: str, dest: Path, *, workspace: Path | None = None
) -> Path:
    """Fetch the version's weights and config into the folder `dest` (replacing it), after
    checking the weights' sha256 against the registry and that the policy loads."""
    from pipelines.training.policy import CONFIG_FILE, WEIGHTS_FILE, load_policy

    info = model_version_info(registered_model, version, workspace=workspace)  # quietly imports
    import mlflow.artifacts

    dest = Path(dest)
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"{info.source.rstrip('/')}/{name}",
                dst_path=str(staging),
                tracking_uri=tracking_uri(current_workspace(workspace)),
            )
        expected = info.tags.get(POLICY_SHA256_TAG)
        actual = _sha256(staging / WEIGHTS_FILE)
        if expected is not None and actual != expected:
            raise ValueError(
                f"{registered_model} version {info.version}: {WEIGHTS_FILE} sha256 {actual} "
                f"differs from the registered {expected}; refusing to use it"
            )
        load_policy(staging)
        _replace_folder(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def model_version_record(
    registered_model: str, version: str, *, workspace: Path | None = None
) -> dict[str, Any]:
    """Everything lineage needs about one version, as plain JSON: the version (source, tags,
    aliases), its dataset version, run params, the batches it trained on and its base policy,
    its gate record, and the run (tags, final metrics, dataset inputs)."""
    info = model_version_info(registered_model, version, workspace=workspace)
    record: dict[str, Any] = {
        **dataclasses.asdict(info),
        "dataset_version": info.tags.get(DATASET_VERSION_TAG) or None,
        "params": {},
        "training_batches": [],
        "base_policy": None,
        "gate": None,
        "run": None,
        "datasets": [],
    }
    if info.run_id is None:
        return record
    client = _client(workspace)
    run = client.get_run(info.run_id)
    batches = _run_json(client, info.run_id, TRAINING_BATCHES_ARTIFACT) or {}
    record.update(
        dataset_version=record["dataset_version"] or run.data.tags.get(DATASET_VERSION_TAG),
        params=dict(run.data.params),
        training_batches=batches.get("batches", []),
        base_policy=batches.get("base_policy") or run.data.tags.get(BASE_POLICY_TAG),
        gate=_run_json(client, info.run_id, GATE_ARTIFACT),
    )
    record["run"] = {
        "run_id": run.info.run_id,
        "experiment_id": run.info.experiment_id,
        "status": run.info.status,
        "start_time": run.info.start_time,
        "end_time": run.info.end_time,
        "tags": dict(run.data.tags),
        "metrics": dict(run.data.metrics),
    }
    record["datasets"] = [
        {
            "name": item.dataset.name,
            "digest": item.dataset.digest,
            "source_type": item.dataset.source_type,
            "source": json.loads(item.dataset.source),
            "profile": json.loads(item.dataset.profile) if item.dataset.profile else None,
            "tags": {tag.key: tag.value for tag in item.tags},
        }
        for item in (run.inputs.dataset_inputs if run.inputs else [])
    ]
    return record


def model_version_records(
    registered_model: str, *, workspace: Path | None = None
) -> list[dict[str, Any]]:
    """model_version_record of every version of `registered_model`, oldest first; [] when the
    model was never registered."""
    client = _client(workspace)
    versions = sorted(
        int(mv.version) for mv in client.search_model_versions(f"name = '{registered_model}'")
    )
    return [model_version_record(registered_model, str(v), workspace=workspace) for v in versions]


def model_version_summaries(
    registered_model: str, *, workspace: Path | None = None
) -> list[dict[str, Any]]:
    """version, dataset_version, training_batches and gate of every version of the model,
    oldest first ([] when it was never registered).

    What `model_version_records` returns of each version, without the rest it also
    reads (run params, metrics, inputs, aliases): through the `runs:/` resolution that costs
    a dozen store queries per version, 65 ms each at 12 versions (measured). Here the
    versions and their tags come from one query, and each version's artifact root from its
    registered source (`<run artifact root>/policy`, as `register_policy` writes it;
    otherwise from its run)."""
    from mlflow.exceptions import MlflowException

    client = _client(workspace)
    uri = tracking_uri(current_workspace(workspace))
    try:
        found = client.search_model_versions(f"name = '{registered_model}'")
    except MlflowException:
        return []
    records = []
    for mv in sorted(found, key=lambda mv: int(mv.version)):
        root = _artifact_root(client, mv)
        batches = _artifact_json_at(root, TRAINING_BATCHES_ARTIFACT, uri) or {}
        dataset_version = mv.tags.get(DATASET_VERSION_TAG) or None
        if dataset_version is None and mv.run_id:
            run = client.get_run(mv.run_id)
            dataset_version = run.data.tags.get(DATASET_VERSION_TAG)
        records.append(
            {
                "version": str(mv.version),
                "dataset_version": dataset_version,
                "training_batches": batches.get("batches", []),
                "gate": _artifact_json_at(root, GATE_ARTIFACT, uri),
            }
        )
    return records


def _artifact_root(client, mv) -> str | None:
    if not mv.run_id:
        return None
    suffix = f"/{POLICY_ARTIFACT_DIR}"
    source = (mv.source or "").rstrip("/")
    if source.endswith(suffix) and not source.startswith(("runs:", "models:")):
        return source.removesuffix(suffix)
    return client.get_run(mv.run_id).info.artifact_uri


def _artifact_json_at(root: str | None, name: str, tracking_uri: str):
    """A small JSON artifact under a run's artifact root, or None when it has none."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    if root is None:
        return None
    local = _local_path(root)
    if local is not None:  # the default store: a folder in the workspace, read as it is
        try:
            return json.loads((local / name).read_text())
        except FileNotFoundError:
            return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = download_artifacts(
                artifact_uri=f"{root.rstrip('/')}/{name}", dst_path=tmp, tracking_uri=tracking_uri
            )
        except (MlflowException, OSError):
            return None
        return json.loads(Path(local).read_text())


def _local_path(uri: str) -> Path | None:
    """The folder an artifact URI names when it is a local path or file:// URI, else None."""
    from urllib.parse import unquote

    parsed = urlparse(uri)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and Path(uri).is_absolute():
        return Path(uri)
    return None


# --- internals ---------------------------------------------------------------------------


@functools.cache
def _quiet_mlflow() -> None:
    """Import mlflow so that a normal run prints nothing of its own."""
    # No usage telemetry: the cells' network has no internet, and nothing here should phone out.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # tqdm bars on every artifact download, even for two small files into a pipe.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # mlflow's SQL store builds its mappers with a loader SQLAlchemy 2 deprecates; not ours to fix.
    warnings.filterwarnings(
        "ignore",
        message=r"The ``noload`` loader strategy is deprecated",
        module=r"mlflow\.store\.",
    )
    import mlflow  # noqa: F401  (configures mlflow's loggers)

    # "Creating initial MLflow database tables..." / "Updating database tables" (INFO) on the
    # first use of a SQLite file; alembic's own migration logs are already at WARNING.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


def _client(workspace: Path | None) -> MlflowClient:
    _quiet_mlflow()
    from mlflow import MlflowClient

    uri = tracking_uri(current_workspace(workspace))
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _run_id(run_id: str | None) -> str:
    run_id = run_id or _active_run_id.get()
    if not run_id:
        raise RuntimeError("no MLflow run: pass run_id, or call inside start_finetune_run")
    return run_id


def _run_json(client: MlflowClient, run_id: str, artifact: str) -> Any:
    """A small JSON artifact of a run, or None when the run has none."""
    names = {a.path for a in client.list_artifacts(run_id)}
    if artifact not in names:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(run_id, artifact, tmp)).read_text())


def _workspace(workspace: Path) -> Path:
    return Path(workspace).resolve()


def _experiment_id(client: MlflowClient, workspace: Path, name: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = artifact_location(workspace)
        if location is not None:
            Path(location).mkdir(parents=True, exist_ok=True)
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:  # another process created it first
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
    if experiment.lifecycle_stage != "active":
        raise ValueError(
            f"MLflow experiment {name!r} is deleted; restore it (mlflow experiments restore) "
            "or set train.experiment to another name"
        )
    return experiment.experiment_id


def _line_dataset(workspace: Path, version: str, source: str, profile: Mapping[str, Any]) -> Any:
    """The MLflow dataset entity for a dataset version: metadata only, the data stays in DVC."""
    from mlflow.data.meta_dataset import MetaDataset

    class LineDataset(MetaDataset):
        @property
        def profile(self) -> dict[str, Any]:
            return _jsonable(dict(profile))

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


def _registered_from_run(
    client: MlflowClient, registered_model: str, run_id: str, weights_sha256: str
) -> str | None:
    """The version of `registered_model` that already holds these weights from this run.

    A run keeps one policy: its `policy/` folder is the source of every version registered
    from it, so uploading different weights there would change versions that already exist.
    """
    existing = client.search_model_versions(f"run_id = '{run_id}'")
    for mv in existing:
        if mv.tags.get(POLICY_SHA256_TAG) != weights_sha256:
            raise ValueError(
                f"run {run_id} already registered other weights as {mv.name} version "
                f"{mv.version}; a run registers one policy (start a new run for another)"
            )
    for mv in existing:
        if mv.name == registered_model:
            return str(mv.version)
    return None


def _flatten(tree: Mapping[str, Any], prefix: str = "", keep_lists: bool = True) -> dict:
    """{"a": {"b": 1, "c": [1, 2]}} → {"a.b": 1, "a.c": "[1, 2]"} (no "a.c" without lists)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, path + ".", keep_lists))
        elif isinstance(value, list | tuple):
            if keep_lists:
                flat[path] = json.dumps(_jsonable(list(value)))
        else:
            flat[path] = value
    return flat


def _jsonable(value: Any) -> Any:
    """Plain JSON types: tuples become lists, numpy scalars become numbers, NaN stays NaN."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return value.item()
    return value


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _replace_folder(new: Path, old: Path) -> None:
    """Swap `new` into place at `old`; `old` is never half-written."""
    if not old.exists():
        new.rename(old)
        return
    trash = old.with_name(old.name + ".old")
    shutil.rmtree(trash, ignore_errors=True)
    old.rename(trash)
    new.rename(old)
    shutil.rmtree(trash)
